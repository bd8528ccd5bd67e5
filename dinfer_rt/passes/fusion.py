"""Fusion and folding rules: a pattern, a legality check and a replacement each, run by the
rewrite engine (``rewrite.py``). Whether a legal fusion pays is the backend's decision: a rule
runs only when the backend has a kernel for its fused op (``Pass.needs_ops``).

Rules that merge weights (gate/up, Q/K/V) add a derived parameter whose tensor is built
once, at load time, by :class:`~dinfer_rt.passes.manager.PassContext`.
"""

from __future__ import annotations

import torch

from dinfer_rt.ir import TensorType
from dinfer_rt.passes.pattern import P
from dinfer_rt.passes.rewrite import Rule, Site, rules_pass

LINEARS = ("linear", "linear_wq")
"""Linears whose weight inputs concatenate along the output dim: the float one ([out, in]) and the
weight-only quantised one (qweight [out, in] and its per-row scale [out]), so merged Q/K/V and
gate/up work on quantised weights too."""


def _weights(node) -> list:
    return node.inputs[1:3] if node.op == "linear_wq" else node.inputs[1:2]


def _bias(node):
    at = 3 if node.op == "linear_wq" else 2
    return node.inputs[at] if len(node.inputs) > at else None


def _biased(node) -> bool:
    return _bias(node) is not None


def _mergeable(nodes) -> bool:
    """Linears of one kind with parameter weights of one dtype and input size (rows may differ)."""
    if len({n.op for n in nodes}) > 1:
        return False
    ws = [_weights(n) for n in nodes]
    if not all(w.kind == "param" for group in ws for w in group):
        return False
    return len({tuple((w.type.dtype, w.type.shape[1:]) for w in group) for group in ws}) == 1


def _merged_linear(m: Site, nodes, x, at: int, bias_slot: bool):
    """One linear over the row-concatenated weights (and biases) of ``nodes``, inserted at ``at``
    (``bias_slot``: pass the bias input even when there is none)."""
    ws = [_weights(n) for n in nodes]
    merged = [m.ctx.derive_concat(m.graph, [group[i] for group in ws]) for i in range(len(ws[0]))]
    bias = m.ctx.derive_concat(m.graph, [_bias(n) for n in nodes]) if _biased(nodes[0]) else None
    return m.insert(nodes[0].op, [x, *merged] + ([bias] if bias_slot or bias is not None else []), at)


def _add_rms_norm(m: Site) -> bool:
    add = m["sum.node"]
    fused = m.insert("add_rms_norm", [m["a"], m["b"], m["w"]], m.index(add), eps=m.node.attrs["eps"])
    m.replace([m.node.outputs[0], add.outputs[0]], fused.outputs, [m.node, add])
    return True


ADD_RMS_NORM = Rule(
    P("rms_norm", P("add", P(name="a"), P(name="b"), name="sum"), P(name="w", kind="param")), _add_rms_norm
)
"""rms_norm(add(a, b), w) -> add_rms_norm(a, b, w): one pass over the residual stream, exporting
the sum as a second output for its other users."""


def _merge_gate_up(m: Site) -> bool:
    g, u, act = m["g.node"], m["u.node"], m["act.node"]
    if _biased(g) or _biased(u) or not m.single_use(m["g"], m["u"], m["act"]):
        return False  # biased projections are not merged; a shared intermediate must stay
    if not _mergeable([g, u]):
        return False
    at = m.index()
    lin = _merged_linear(m, [g, u], m["x"], at, bias_slot=False)
    out = m.insert("swiglu", [lin.outputs[0]], at + 1)
    m.replace([m.node.outputs[0]], out.outputs, [m.node, g, u, act])
    return True


MERGE_GATE_UP = Rule(
    P(
        "mul",
        P("silu", P(LINEARS, P(name="x"), P(name="wg", kind="param"), name="g"), name="act"),
        P(LINEARS, P(name="x"), P(name="wu", kind="param"), name="u"),
    ),
    _merge_gate_up,
)
"""mul(silu(linear(x, Wg)), linear(x, Wu)) -> swiglu(linear(x, [Wg | Wu])) (also for linear_wq)."""


def _merge_projections(m: Site) -> bool:
    x = m["x"]
    nodes = [n for n in m.graph.nodes if n.op == m.node.op and n.inputs[0] is x and n.inputs[1].kind == "param"]
    if len(nodes) < 2 or nodes[0] is not m.node:
        return False  # a group is merged once, from its first member
    if len({_biased(n) for n in nodes}) > 1 or not _mergeable(nodes):
        return False
    at = m.index()
    lin = _merged_linear(m, nodes, x, at, bias_slot=True)
    parts = m.insert("split", [lin.outputs[0]], at + 1, sizes=tuple(n.inputs[1].type.shape[0] for n in nodes))
    m.replace([n.outputs[0] for n in nodes], parts.outputs, nodes)
    return True


MERGE_PROJECTIONS = Rule(P(LINEARS, P(name="x"), P(name="w", kind="param")), _merge_projections)
"""Horizontal fusion: linears reading the same input with parameter weights (Q/K/V) become one
linear over the concatenated weights plus a split."""


def _lm_head_confidence(m: Site) -> bool:
    lin = m["logits.node"]
    if not m.single_use(m["logits"]) or _biased(lin):
        return False
    fused = m.insert("lm_head_confidence", [m["h"], m["w"]], m.index(), **m.node.attrs)
    m.replace(m.node.outputs, fused.outputs, [m.node, lin])
    return True


LM_HEAD_CONFIDENCE = Rule(
    P("confidence", P("linear", P(name="h"), P(name="w", kind="param"), name="logits")), _lm_head_confidence
)
"""confidence(linear(h, W)) -> lm_head_confidence(h, W): the logits of the positions still masked
are reduced to (max probability, argmax) without building [positions x vocab]."""


def _fold_rope(m: Site) -> bool:
    rq, rk = m["q_rot.node"], m["k_rot.node"]
    if not m.single_use(m["q_rot"], m["k_rot"]) or rq.attrs != rk.attrs:
        return False
    norms = [m.producer(r.inputs[0]) for r in (rq, rk)]
    norms = [n if n is not None and n.op == "rms_norm" and m.single_use(n.outputs[0]) else None for n in norms]
    nq, nk = norms
    if (nq is None) != (nk is None) or (nq is not None and nq.attrs != nk.attrs):
        return False
    q, k = (nq.inputs[0], nk.inputs[0]) if nq else (rq.inputs[0], rk.inputs[0])
    weights = [nq.inputs[1], nk.inputs[1]] if nq else [None, None]
    attn = m.node
    caches = list(attn.inputs[5:7]) + [None] * (2 - len(attn.inputs[5:7]))
    eps = nq.attrs["eps"] if nq else 1e-6
    inputs = [q, k, *attn.inputs[2:5], m["pos"], *weights, *caches]
    fused = m.insert("rope_attention", inputs, m.index(), **attn.attrs, **rq.attrs, eps=eps)
    m.replace(attn.outputs, fused.outputs, [attn, rq, rk, nq, nk])
    return True


FOLD_ROPE_INTO_ATTENTION = Rule(
    P(
        "attention",
        P("rope", P(name="q"), P(name="pos"), name="q_rot"),
        P("rope", P(name="k"), P(name="pos"), name="k_rot"),
    ),
    _fold_rope,
)
"""attention(rope(rms_norm?(q)), rope(rms_norm?(k)), ...) -> rope_attention(q, k, ...): QK-norm
and RoPE run inside the attention kernel (legal when the folded values have no other user and q
and k share positions, rotary parameters and norm settings)."""

ROUTERS = ("router_softmax_topk", "router_sigmoid_grouped")


def _fold_routing(m: Site) -> bool:
    router, lin = m["w.node"], m["logits.node"]
    cast = m.producer(lin.inputs[0])
    if m["idx.node"] is not router or not m.single_use(m["w"], m["idx"], m["logits"], cast.outputs[0]):
        return False
    kind = "softmax" if router.op == "router_softmax_topk" else "sigmoid_grouped"
    bias = router.inputs[1] if kind == "sigmoid_grouped" else None
    inputs = [m["x"], m["wr"], bias, *m.node.inputs[3:5]]
    fused = m.insert("moe_routed", inputs, m.index(), router=kind, **router.attrs, **m.node.attrs)
    m.replace(m.node.outputs, fused.outputs, [m.node, router, lin, cast])
    return True


FOLD_ROUTING_INTO_MOE = Rule(
    P(
        "moe_experts",
        P(name="x"),
        P(ROUTERS, P("linear", P("cast", P(name="x")), P(name="wr", kind="param"), name="logits"), name="w"),
        P(ROUTERS, name="idx"),
    ),
    _fold_routing,
)
"""moe_experts(x, router(linear(cast(x), Wr)), ...) -> moe_routed(x, Wr, ...): routing and
expert grouping in one op (legal when the router's outputs feed only this MoE)."""


def _attention_block(m: Site) -> bool:
    attn, lin = m["attn.node"], m["qkv.node"]
    parts = m["sq.node"]
    if lin.op != "linear" or not (m["sk.node"] is parts is m["sv.node"]) or len(parts.outputs) != 3:
        return False
    if [m["sq"], m["sk"], m["sv"]] != parts.outputs or parts.inputs[0] is not m["qkv"]:
        return False  # q, k, v must be the split's pieces in order
    heads, kv = m["hq.node"].attrs["heads"], m["hk.node"].attrs["heads"]
    if m["hv.node"].attrs["heads"] != kv or not m.single_use(
        m["qkv"], m["sq"], m["sk"], m["sv"], m["hq"], m["hk"], m["hv"]
    ):
        return False
    if not m.single_use(m["attn"]):
        return False
    bias = _bias(lin)
    inputs = [m["x"], m["w"], bias, *attn.inputs[3:10]]
    fused = m.insert(
        "attention_block", inputs, m.index(attn), sizes=parts.attrs["sizes"], heads=heads, kv_heads=kv, **attn.attrs
    )
    m.replace(
        [m.node.outputs[0], *attn.outputs[1:]],
        fused.outputs,
        [m.node, attn, m["hq.node"], m["hk.node"], m["hv.node"], parts, lin],
    )
    return True


ATTENTION_BLOCK = Rule(
    P(
        "merge_heads",
        P(
            "rope_attention",
            P(
                "view_heads",
                P("split", P("linear", P(name="x"), P(name="w", kind="param"), name="qkv"), name="sq"),
                name="hq",
            ),
            P("view_heads", P("split", name="sk"), name="hk"),
            P("view_heads", P("split", name="sv"), name="hv"),
            name="attn",
        ),
    ),
    _attention_block,
)
"""merge_heads(rope_attention(view_heads(split(linear(x, Wqkv)))...)) -> attention_block(x, Wqkv, ...):
a layer's projection and attention in one kernel (legal when every intermediate has no other user)."""


def _projection(m: Site, v, *, bias_ok: bool):
    """The ``linear`` node producing ``v`` with a parameter weight, read only there; else None."""
    node = m.producer(v)
    if node is None or node.op != "linear" or node.inputs[1].kind != "param" or not m.single_use(v):
        return None
    return node if bias_ok or not _biased(node) else None


def _oriented(a, b, test):
    """(a, b) or (b, a), whichever puts a value passing ``test`` first (add is commutative)."""
    return next(((x, y) for x, y in ((a, b), (b, a)) if test(x)), None)


def _mlp_block(m: Site) -> bool:
    last = m.node

    def first_norm_sum(v) -> bool:
        node = m.producer(v)
        return node is not None and node.op == "add_rms_norm" and node.outputs[1] is v

    pair = _oriented(*last.inputs[:2], first_norm_sum)
    if pair is None:
        return False
    total, down = pair
    first = m.producer(total)
    if first.attrs != last.attrs or not m.single_use(total, first.outputs[0]):
        return False
    down_lin = _projection(m, down, bias_ok=False)
    act = m.producer(down_lin.inputs[0]) if down_lin else None
    if act is None or act.op != "swiglu" or not m.single_use(act.outputs[0]):
        return False
    gate_up = _projection(m, act.inputs[0], bias_ok=False)
    if gate_up is None or gate_up.inputs[0] is not first.outputs[0]:
        return False
    pair = _oriented(*first.inputs[:2], lambda v: _projection(m, v, bias_ok=True) is not None)
    if pair is None:
        return False
    out_proj, residual = m.producer(pair[0]), pair[1]
    inputs = [
        out_proj.inputs[0], out_proj.inputs[1], _bias(out_proj), residual, first.inputs[2],
        gate_up.inputs[1], down_lin.inputs[1], last.inputs[2],
    ]  # fmt: skip
    fused = m.insert("mlp_block", inputs, m.index(), **last.attrs)
    m.replace(last.outputs, fused.outputs, [last, down_lin, act, gate_up, first, out_proj])
    return True


MLP_BLOCK = Rule(P("add_rms_norm", P(name="a"), P(name="b"), P(name="w", kind="param")), _mlp_block)
"""add_rms_norm(s, linear(swiglu(linear(n, Wgu)), Wd)) with (n, s) = add_rms_norm(r, linear(a, Wo))
-> mlp_block(a, Wo, r, ...): the rest of a dense layer in one kernel (legal when the first norm's
outputs and every projection feed only this chain)."""

add_rms_norm = rules_pass(ADD_RMS_NORM)
merge_gate_up = rules_pass(MERGE_GATE_UP)
merge_projections = rules_pass(MERGE_PROJECTIONS)
lm_head_confidence = rules_pass(LM_HEAD_CONFIDENCE)
fold_rope_into_attention = rules_pass(FOLD_ROPE_INTO_ATTENTION)
fold_routing_into_moe = rules_pass(FOLD_ROUTING_INTO_MOE)
fuse_attention_block = rules_pass(ATTENTION_BLOCK)
fuse_mlp_block = rules_pass(MLP_BLOCK)


def concat_type(values) -> TensorType:
    first = values[0].type
    return TensorType((sum(v.type.shape[0] for v in values), *first.shape[1:]), first.dtype)


def concat_weights(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)
