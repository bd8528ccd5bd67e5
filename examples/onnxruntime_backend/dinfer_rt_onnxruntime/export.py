"""IR graph -> ONNX model (opset 18). One converter per IR op, written from each op's
reference semantics in ``dinfer_rt.ir.ops``; symbolic dims become ONNX ``dim_param``s."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from dinfer_rt.errors import BackendError
from dinfer_rt.ir import Graph, Value

OPSET = 18
ONNX_DTYPES = {
    torch.float32: TensorProto.FLOAT,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.bool: TensorProto.BOOL,
    torch.float64: TensorProto.DOUBLE,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
}
NEG_INF = np.array(-np.inf, dtype=np.float32)


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def tmp(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def const(self, value, dtype=np.int64, hint: str = "c") -> str:
        name = self.tmp(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def emit(self, op: str, inputs: list[str], n_out: int = 1, **attrs):
        outs = [self.tmp(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def slice_last(self, x: str, start: int, end: int) -> str:
        return self.emit("Slice", [x, self.const([start]), self.const([end]), self.const([-1])])


def _embedding(b, ins, node):
    return [b.emit("Gather", [ins[1], ins[0]], axis=0)]


def _rms_norm(b, ins, node):
    x, w = ins
    ms = b.emit("ReduceMean", [b.emit("Mul", [x, x]), b.const([-1])], keepdims=1)
    inv = b.emit("Reciprocal", [b.emit("Sqrt", [b.emit("Add", [ms, b.const(node.attrs["eps"], np.float32)])])])
    return [b.emit("Mul", [w, b.emit("Mul", [x, inv])])]


def _linear(b, ins, node):
    y = b.emit("MatMul", [ins[0], b.emit("Transpose", [ins[1]], perm=[1, 0])])
    if len(ins) == 3 and ins[2]:
        y = b.emit("Add", [y, ins[2]])
    return [y]


def _silu(b, ins, node):
    return [b.emit("Mul", [ins[0], b.emit("Sigmoid", [ins[0]])])]


def _cast(b, ins, node):
    return [b.emit("Cast", [ins[0]], to=ONNX_DTYPES[node.attrs["dtype"]])]


def _view_heads(b, ins, node):
    rank = node.inputs[0].type.rank
    return [b.emit("Reshape", [ins[0], b.const([0] * (rank - 1) + [node.attrs["heads"], -1])])]


def _merge_heads(b, ins, node):
    rank = node.inputs[0].type.rank
    return [b.emit("Reshape", [ins[0], b.const([0] * (rank - 2) + [-1])])]


def _split(b, ins, node):
    sizes = list(node.attrs["sizes"])
    return b.emit("Split", [ins[0], b.const(sizes)], n_out=len(sizes), axis=-1)


def _rope(b, ins, node):
    x, pos = ins
    rd, theta = node.attrs["rotary_dim"], node.attrs["theta"]
    d = node.inputs[0].type.shape[-1]
    inv = (theta ** (-np.arange(0, rd, 2, dtype=np.float32) / rd)).astype(np.float32)
    ang = b.emit(
        "Mul",
        [b.emit("Unsqueeze", [b.emit("Cast", [pos], to=TensorProto.FLOAT), b.const([-1])]), b.const(inv, np.float32)],
    )
    ang = b.emit("Unsqueeze", [b.emit("Concat", [ang, ang], axis=-1), b.const([2])])
    cos, sin = b.emit("Cos", [ang]), b.emit("Sin", [ang])
    half = rd // 2
    rot = b.emit("Concat", [b.emit("Neg", [b.slice_last(x, half, rd)]), b.slice_last(x, 0, half)], axis=-1)
    out = b.emit("Add", [b.emit("Mul", [b.slice_last(x, 0, rd), cos]), b.emit("Mul", [rot, sin])])
    if rd < d:
        out = b.emit("Concat", [out, b.slice_last(x, rd, d)], axis=-1)
    return [out]


def _splice(b, cache: str, fresh: str, index: str, per_row: bool = False) -> str:
    """cache[:, index] = fresh, functionally (ScatterND along the sequence axis); ``per_row``:
    ``index`` is [B, T] (each row its own slots), scattered at (row, index) pairs."""
    if per_row:
        rows = b.emit(
            "Range", [b.const(0), b.emit("Squeeze", [b.emit("Shape", [index], end=1), b.const([0])]), b.const(1)]
        )
        rows = b.emit("Expand", [b.emit("Unsqueeze", [rows, b.const([1])]), b.emit("Shape", [index])])
        pairs = b.emit("Concat", [b.emit("Unsqueeze", [t, b.const([-1])]) for t in (rows, index)], axis=-1)
        return b.emit("ScatterND", [cache, pairs, fresh])
    perm = [1, 0, 2, 3]
    data, upd = b.emit("Transpose", [cache], perm=perm), b.emit("Transpose", [fresh], perm=perm)
    idx = b.emit("Unsqueeze", [index, b.const([1])])
    return b.emit("Transpose", [b.emit("ScatterND", [data, idx, upd])], perm=perm)


def _attention(b, ins, node):
    q, k, v, key_valid, token_index = ins[:5]
    h, kv = node.inputs[0].type.shape[2], node.inputs[1].type.shape[2]
    hd = node.inputs[0].type.shape[3]
    outs = []
    per_row = node.inputs[4].type.rank == 2
    if len(ins) == 7:
        keys, values = _splice(b, ins[5], k, token_index, per_row), _splice(b, ins[6], v, token_index, per_row)
        s = b.emit("Squeeze", [b.emit("Slice", [b.emit("Shape", [ins[5]]), b.const([1]), b.const([2])]), b.const([0])])
        key_index = b.emit("Range", [b.const(0), s, b.const(1)])
        outs = [keys, values]
    else:
        keys, values, key_index = k, v, token_index
    g = h // kv
    if g > 1:

        def repeat(t):
            tiled = b.emit("Tile", [b.emit("Unsqueeze", [t, b.const([3])]), b.const([1, 1, 1, g, 1])])
            return b.emit("Reshape", [tiled, b.const([0, 0, h, hd])])

        keys, values = repeat(keys), repeat(values)
    qh = b.emit("Transpose", [q], perm=[0, 2, 1, 3])
    kh = b.emit("Transpose", [keys], perm=[0, 2, 3, 1])
    vh = b.emit("Transpose", [values], perm=[0, 2, 1, 3])
    scores = b.emit("Mul", [b.emit("MatMul", [qh, kh]), b.const(node.attrs["scale"], np.float32)])
    allowed = b.emit("Unsqueeze", [key_valid, b.const([1, 2])])
    if node.attrs.get("block_size"):
        size = b.const(node.attrs["block_size"])
        kb, qb = b.emit("Div", [key_index, size]), b.emit("Div", [token_index, size])
        if per_row:  # [B, T] queries (and, uncached, [B, T] keys): a [B, 1, T, S] rule
            kb = b.emit("Unsqueeze", [kb, b.const([1] if len(ins) != 7 else [0, 1])])
            causal = b.emit("LessOrEqual", [kb, b.emit("Unsqueeze", [qb, b.const([2])])])
            causal = b.emit("Unsqueeze", [causal, b.const([1])])
        else:
            causal = b.emit(
                "LessOrEqual", [b.emit("Unsqueeze", [kb, b.const([0])]), b.emit("Unsqueeze", [qb, b.const([1])])]
            )
            causal = b.emit("Unsqueeze", [causal, b.const([0, 1])])
        allowed = b.emit("And", [allowed, causal])
    seen = b.emit("ReduceMax", [b.emit("Cast", [allowed], to=TensorProto.FLOAT), b.const([-1])], keepdims=1)
    allowed = b.emit("Or", [allowed, b.emit("Not", [b.emit("Cast", [seen], to=TensorProto.BOOL)])])
    probs = b.emit("Softmax", [b.emit("Where", [allowed, scores, b.const(NEG_INF, np.float32)])], axis=-1)
    out = b.emit("Transpose", [b.emit("MatMul", [probs, vh])], perm=[0, 2, 1, 3])
    return [out, *outs]


def _kv_gather(b, ins, node):
    """pool[table] -> [B, NBT * P, KV, D], then its first S positions (S from key_valid)."""
    k_pool, v_pool, table, key_valid = ins
    kv, hd = node.inputs[0].type.shape[2:]
    s = b.emit("Shape", [key_valid], start=1, end=2)
    outs = []
    for pool in (k_pool, v_pool):
        flat = b.emit("Reshape", [b.emit("Gather", [pool, table], axis=0), b.const([0, -1, kv, hd])])
        outs.append(b.emit("Slice", [flat, b.const([0]), s, b.const([1])]))
    return outs


def _kv_scatter(b, ins, node):
    """pool[table[b, p // P], p % P] = cache[b, p] for the slots p of token_index ([T] or [B, T])."""
    k_pool, v_pool, table, token_index, k_cache, v_cache = ins
    slots = token_index
    if node.inputs[3].type.rank == 1:  # the same slots in every row
        shape = b.emit("Concat", [b.emit("Shape", [table], end=1), b.emit("Shape", [token_index])], axis=0)
        slots = b.emit("Expand", [b.emit("Unsqueeze", [token_index, b.const([0])]), shape])
    rows = b.emit("Range", [b.const(0), b.emit("Squeeze", [b.emit("Shape", [slots], end=1), b.const([0])]), b.const(1)])
    rows = b.emit("Expand", [b.emit("Unsqueeze", [rows, b.const([1])]), b.emit("Shape", [slots])])
    p = b.emit("Shape", [k_pool], start=1, end=2)

    def pairs(x: str, y: str) -> str:
        return b.emit("Concat", [b.emit("Unsqueeze", [t, b.const([-1])]) for t in (x, y)], axis=-1)

    table64 = b.emit("Cast", [table], to=TensorProto.INT64)
    blocks = b.emit("GatherND", [table64, pairs(rows, b.emit("Div", [slots, p]))])
    where = pairs(blocks, b.emit("Mod", [slots, p]))
    return [
        b.emit("ScatterND", [pool, where, b.emit("GatherND", [cache, pairs(rows, slots)])])
        for pool, cache in ((k_pool, k_cache), (v_pool, v_cache))
    ]


def _topk(b, x: str, k: int):
    return b.emit("TopK", [x, b.const([k])], n_out=2, axis=-1)


def _renorm(b, w: str) -> str:
    return b.emit("Div", [w, b.emit("ReduceSum", [w, b.const([-1])], keepdims=1)])


def _router_softmax_topk(b, ins, node):
    w, idx = _topk(b, b.emit("Softmax", [ins[0]], axis=-1), node.attrs["k"])
    return [_renorm(b, w) if node.attrs["renormalize"] else w, idx]


def _router_sigmoid_grouped(b, ins, node):
    a = node.attrs
    e = node.inputs[0].type.shape[-1]
    per = e // a["n_group"]
    s = b.emit("Sigmoid", [ins[0]])
    biased = b.emit("Add", [s, ins[1]])
    grouped = b.emit("Reshape", [biased, b.const([0, 0, a["n_group"], per])])
    top2, _ = _topk(b, grouped, min(2, per))
    _, keep = _topk(b, b.emit("ReduceSum", [top2, b.const([-1])], keepdims=0), a["topk_group"])
    onehot = b.emit("OneHot", [keep, b.const(a["n_group"]), b.const([0.0, 1.0], np.float32)], axis=-1)
    group_mask = b.emit("ReduceMax", [onehot, b.const([-2])], keepdims=0)
    tiled = b.emit("Tile", [b.emit("Unsqueeze", [group_mask, b.const([-1])]), b.const([1, 1, 1, per])])
    expert_mask = b.emit("Cast", [b.emit("Reshape", [tiled, b.const([0, 0, e])])], to=TensorProto.BOOL)
    _, idx = _topk(b, b.emit("Where", [expert_mask, biased, b.const(NEG_INF, np.float32)]), a["k"])
    w = b.emit("GatherElements", [s, idx], axis=-1)
    if a["renormalize"]:
        w = _renorm(b, w)
    return [b.emit("Mul", [w, b.const(a["scale"], np.float32)]), idx]


def _moe_experts(b, ins, node):
    x, w, idx, gate_up, down = ins
    e, two_i, _ = node.inputs[3].type.shape
    inter = two_i // 2
    gu = b.emit("Einsum", [x, gate_up], equation="bth,eih->btei")
    a, u = b.slice_last(gu, 0, inter), b.slice_last(gu, inter, two_i)
    hidden = b.emit("Mul", [b.emit("Mul", [a, b.emit("Sigmoid", [a])]), u])
    y = b.emit("Einsum", [hidden, down], equation="btei,ehi->bteh")
    bt = b.emit("Slice", [b.emit("Shape", [idx]), b.const([0]), b.const([2])])
    zeros = b.emit(
        "ConstantOfShape",
        [b.emit("Concat", [bt, b.const([e])], axis=0)],
        value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0]),
    )
    dense = b.emit("ScatterElements", [zeros, idx, w], axis=-1)
    return [b.emit("Einsum", [y, dense], equation="bteh,bte->bth")]


def _index_tokens(b, ins, node):
    return [b.emit("Gather", [ins[0], ins[1]], axis=1)]


def _confidence(b, ins, node):
    vocab = node.inputs[0].type.shape[-1]
    ban = np.zeros(vocab, dtype=np.float32)
    ban[node.attrs["banned"]] = -np.inf
    z = b.emit("Add", [ins[0], b.const(ban, np.float32)])
    probs = b.emit("Softmax", [z], axis=-1)
    token = b.emit("ArgMax", [probs], axis=-1, keepdims=0)
    kind = node.attrs.get("kind", "max")
    if kind == "max":
        return [b.emit("ReduceMax", [probs, b.const([-1])], keepdims=0), token]
    if kind == "margin":
        top2, _ = _topk(b, probs, 2)
        first, second = b.slice_last(top2, 0, 1), b.slice_last(top2, 1, 2)
        return [b.emit("Squeeze", [b.emit("Sub", [first, second]), b.const([-1])]), token]
    plogp = b.emit("Mul", [probs, b.emit("LogSoftmax", [z], axis=-1)])
    safe = b.emit("Where", [b.emit("Greater", [probs, b.const(0.0, np.float32)]), plogp, b.const(0.0, np.float32)])
    return [b.emit("ReduceSum", [safe, b.const([-1])], keepdims=0), token]


CONVERTERS = {
    "embedding": _embedding,
    "rms_norm": _rms_norm,
    "linear": _linear,
    "silu": _silu,
    "cast": _cast,
    "add": lambda b, ins, n: [b.emit("Add", ins)],
    "mul": lambda b, ins, n: [b.emit("Mul", ins)],
    "view_heads": _view_heads,
    "merge_heads": _merge_heads,
    "split": _split,
    "rope": _rope,
    "attention": _attention,
    "kv_gather": _kv_gather,
    "kv_scatter": _kv_scatter,
    "router_softmax_topk": _router_softmax_topk,
    "router_sigmoid_grouped": _router_sigmoid_grouped,
    "moe_experts": _moe_experts,
    "index_tokens": _index_tokens,
    "confidence": _confidence,
}

OUTPUT_SUFFIX = "__new"
"""Graph outputs that share a graph input's name (the KV caches) get this suffix in ONNX."""


def _value_info(name: str, v: Value) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, ONNX_DTYPES[v.type.dtype], list(v.type.shape))


def export(graph: Graph, weights: Mapping[str, torch.Tensor]) -> onnx.ModelProto:
    """Build and check an ONNX model computing ``graph`` with ``weights`` as initializers."""
    b = _Builder()
    names: dict[int, str] = {}
    for v in graph.inputs:
        names[id(v)] = v.name
    for p in graph.params:
        names[id(p)] = f"param:{p.name}"
        b.inits.append(numpy_helper.from_array(weights[p.name].detach().cpu().numpy(), names[id(p)]))
    for i, node in enumerate(graph.nodes):
        conv = CONVERTERS.get(node.op)
        if conv is None:
            raise BackendError(f"onnxruntime: no ONNX converter for IR op {node.op!r} (node {i})")
        outs = conv(b, ["" if v is None else names[id(v)] for v in node.inputs], node)
        for v, name in zip(node.outputs, outs):
            names[id(v)] = name
    input_names = {v.name for v in graph.inputs}
    outputs = []
    for name, v in graph.outputs.items():
        out_name = name + OUTPUT_SUFFIX if name in input_names else name
        b.nodes.append(helper.make_node("Identity", [names[id(v)]], [out_name]))
        outputs.append(_value_info(out_name, v))
    g = helper.make_graph(b.nodes, graph.name, [_value_info(v.name, v) for v in graph.inputs], outputs, b.inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="dinfer-rt")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
