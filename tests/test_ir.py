"""IR invariants: op inference, verification errors, printing."""

from __future__ import annotations

import pytest
import torch

from dinfer_rt.ir import OPS, Graph, IRError, Node, TensorType, Value
from dinfer_rt.ir.ops import attention, router_sigmoid_grouped

F32 = torch.float32


def test_every_op_documents_its_semantics():
    assert {
        "embedding",
        "rms_norm",
        "linear",
        "add",
        "mul",
        "silu",
        "rope",
        "attention",
        "router_softmax_topk",
        "router_sigmoid_grouped",
        "moe_experts",
        "split",
        "cast",
        "view_heads",
        "merge_heads",
    } <= set(OPS)
    for op in OPS.values():
        assert op.doc, op.name


def test_shape_inference_and_printing():
    g = Graph("t")
    x = g.input("x", TensorType(("B", "T", 8), F32))
    w = g.param("w", TensorType((6, 8), F32))
    y = g.op("linear", x, w)
    assert y.type == TensorType(("B", "T", 6), F32)
    q = g.op("view_heads", y, heads=3)
    assert q.type.shape == ("B", "T", 3, 2)
    g.output("y", y)
    text = str(g.verify())
    assert "%0: f32[B,T,6] = linear(%x, %w)" in text and "return y=%0" in text


def test_type_errors_name_the_node():
    g = Graph("t")
    x = g.input("x", TensorType(("B", 8), F32))
    w = g.param("w", TensorType((6, 7), F32))
    with pytest.raises(IRError, match=r"node 0 \(linear\): linear: input f32\[B,8\] does not match weight"):
        g.op("linear", x, w)


def test_verify_rejects_use_before_definition():
    g = Graph("t")
    x = g.input("x", TensorType((4,), F32))
    ghost = Value("ghost", TensorType((4,), F32))
    g.nodes.append(Node("add", [x, ghost], {}, [Value("1", TensorType((4,), F32))]))
    with pytest.raises(IRError, match="uses %ghost before it is defined"):
        g.verify()


def test_verify_rejects_double_definition():
    g = Graph("t")
    x = g.input("x", TensorType((4,), F32))
    y = g.op("silu", x)
    g.nodes.append(Node("silu", [x], {}, [y]))
    with pytest.raises(IRError, match="defined twice"):
        g.verify()


def test_verify_rejects_stale_types():
    g = Graph("t")
    x = g.input("x", TensorType((4,), F32))
    y = g.op("silu", x)
    y.type = TensorType((5,), F32)
    with pytest.raises(IRError, match="output types"):
        g.verify()


def test_block_causal_attention_mask_is_aligned_to_position_zero():
    torch.manual_seed(0)
    q = torch.randn(1, 6, 2, 4)
    k = torch.randn(1, 6, 1, 4)
    v = torch.randn(1, 6, 1, 4)
    valid = torch.ones(1, 6, dtype=torch.bool)
    idx = torch.arange(6)
    out = attention(q, k, v, valid, idx, scale=0.5, block_size=4)
    # Tokens 0..3 see only block 0: changing token 5's value must not change them.
    v2 = v.clone()
    v2[:, 5] += 1
    out2 = attention(q, k, v2, valid, idx, scale=0.5, block_size=4)
    torch.testing.assert_close(out[:, :4], out2[:, :4])
    assert not torch.allclose(out[:, 4:], out2[:, 4:])


def test_group_limited_router_keeps_only_best_groups():
    logits = torch.tensor([[4.0, 3.9, -5, -5, 0.1, 0.0, -5, -5]])
    bias = torch.zeros(8)
    w, idx = router_sigmoid_grouped(logits, bias, k=2, n_group=4, topk_group=1, renormalize=True, scale=2.5)
    assert sorted(idx[0].tolist()) == [0, 1]
    torch.testing.assert_close(w.sum(-1), torch.tensor([2.5]))
    # The bias changes selection but not the weights.
    bias2 = torch.tensor([0.0, 0, 0, 0, 10, 10, 0, 0])
    w2, idx2 = router_sigmoid_grouped(logits, bias2, k=2, n_group=4, topk_group=1, renormalize=False, scale=1.0)
    assert sorted(idx2[0].tolist()) == [4, 5]
    torch.testing.assert_close(w2.sort().values, logits[0, 4:6].sigmoid().sort().values[None])
