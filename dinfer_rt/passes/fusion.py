"""Fusion rules: pattern + legality + replacement. Whether a legal fusion pays is the
backend's decision: a rule runs only when the backend has a kernel for its fused op.

Rules that merge weights (gate/up, Q/K/V) add a derived parameter whose tensor is built
once, at load time, by :class:`~dinfer_rt.passes.manager.PassContext`.
"""

from __future__ import annotations

import torch

from dinfer_rt.ir import Graph, Node, TensorType
from dinfer_rt.passes.pattern import P, match, producers
from dinfer_rt.passes.rewrite import new_node, remove, replace_uses, use_counts


def add_rms_norm(graph: Graph, ctx) -> int:
    """rms_norm(add(a, b), w) -> add_rms_norm(a, b, w): one pass over the residual stream,
    exporting the sum as a second output for its other users."""
    pat = P("rms_norm", P("add", P(name="a"), P(name="b"), name="sum"), P(name="w", kind="param"), name="out")
    count = 0
    for node in list(graph.nodes):
        if node.op != "rms_norm":
            continue
        caps = match(pat, node.outputs[0], producers(graph))
        if caps is None:
            continue
        add: Node = caps["sum.node"]
        at = graph.nodes.index(add)
        fused = new_node(graph, "add_rms_norm", [caps["a"], caps["b"], caps["w"]], at, eps=node.attrs["eps"])
        replace_uses(graph, node.outputs[0], fused.outputs[0])
        replace_uses(graph, add.outputs[0], fused.outputs[1])
        remove(graph, [node, add])
        count += 1
    return count


def merge_gate_up(graph: Graph, ctx) -> int:
    """mul(silu(linear(x, Wg)), linear(x, Wu)) -> swiglu(linear(x, [Wg | Wu]))."""
    pat = P(
        "mul",
        P("silu", P("linear", P(name="x"), P(name="wg", kind="param"), name="g"), name="act"),
        P("linear", P(name="x"), P(name="wu", kind="param"), name="u"),
        name="out",
    )
    count = 0
    for node in list(graph.nodes):
        if node.op != "mul":
            continue
        caps = match(pat, node.outputs[0], producers(graph))
        if caps is None:
            continue
        g, u, act = caps["g.node"], caps["u.node"], caps["act.node"]
        uses = use_counts(graph)
        if any(len(n.inputs) > 2 and n.inputs[2] is not None for n in (g, u)):
            continue  # biased projections: not merged
        if any(uses[id(v)] != 1 for v in (caps["g"], caps["u"], caps["act"])):
            continue  # an intermediate with another user must stay materialised
        wg, wu = caps["wg"], caps["wu"]
        if wg.type.dtype != wu.type.dtype or wg.type.shape[1:] != wu.type.shape[1:]:
            continue
        merged = ctx.derive_concat(graph, [wg, wu])
        at = graph.nodes.index(node)
        lin = new_node(graph, "linear", [caps["x"], merged], at)
        out = new_node(graph, "swiglu", [lin.outputs[0]], at + 1)
        replace_uses(graph, node.outputs[0], out.outputs[0])
        remove(graph, [node, g, u, act])
        count += 1
    return count


def merge_projections(graph: Graph, ctx) -> int:
    """Horizontal fusion: linears reading the same input with parameter weights (Q/K/V) become
    one linear over the concatenated weights plus a split."""
    groups: dict[int, list[Node]] = {}
    for node in graph.nodes:
        if node.op == "linear" and node.inputs[1].kind == "param":
            groups.setdefault(id(node.inputs[0]), []).append(node)
    count = 0
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        biased = [len(n.inputs) > 2 and n.inputs[2] is not None for n in nodes]
        ws = [n.inputs[1] for n in nodes]
        if len(set(biased)) > 1 or len({(w.type.dtype, w.type.shape[1:]) for w in ws}) > 1:
            continue
        merged = ctx.derive_concat(graph, ws)
        bias = ctx.derive_concat(graph, [n.inputs[2] for n in nodes]) if biased[0] else None
        at = graph.nodes.index(nodes[0])
        lin = new_node(graph, "linear", [nodes[0].inputs[0], merged, bias], at)
        parts = new_node(graph, "split", [lin.outputs[0]], at + 1, sizes=tuple(w.type.shape[0] for w in ws))
        for old, new in zip(nodes, parts.outputs):
            replace_uses(graph, old.outputs[0], new)
        remove(graph, nodes)
        count += 1
    return count


def lm_head_confidence(graph: Graph, ctx) -> int:
    """confidence(linear(h, W)) -> lm_head_confidence(h, W): the logits of the positions still
    masked are reduced to (max probability, argmax) without building [positions x vocab]."""
    pat = P("confidence", P("linear", P(name="h"), P(name="w", kind="param"), name="logits"), name="out")
    count = 0
    for node in list(graph.nodes):
        if node.op != "confidence":
            continue
        caps = match(pat, node.outputs[0], producers(graph))
        if caps is None or use_counts(graph)[id(caps["logits"])] != 1:
            continue
        lin = caps["logits.node"]
        if len(lin.inputs) > 2 and lin.inputs[2] is not None:
            continue
        at = graph.nodes.index(node)
        fused = new_node(graph, "lm_head_confidence", [caps["h"], caps["w"]], at, **node.attrs)
        for old, new in zip(node.outputs, fused.outputs):
            replace_uses(graph, old, new)
        remove(graph, [node, lin])
        count += 1
    return count


def fold_rope_into_attention(graph: Graph, ctx) -> int:
    """attention(rope(rms_norm?(q)), rope(rms_norm?(k)), ...) -> rope_attention(q, k, ...): QK-norm
    and RoPE run inside the attention kernel (legal when the folded values have no other user and
    q and k share positions and rotary parameters)."""
    prod = producers(graph)
    count = 0
    for node in list(graph.nodes):
        if node.op != "attention":
            continue
        uses = use_counts(graph)
        parts = []
        for v in node.inputs[:2]:
            r = prod.get(id(v))
            if r is None or r.op != "rope" or uses[id(v)] != 1:
                break
            n = prod.get(id(r.inputs[0]))
            normed = n is not None and n.op == "rms_norm" and uses[id(r.inputs[0])] == 1
            parts.append((r, n if normed else None))
        if len(parts) != 2:
            continue
        (rq, nq), (rk, nk) = parts
        if rq.inputs[1] is not rk.inputs[1] or rq.attrs != rk.attrs or (nq is None) != (nk is None):
            continue
        if nq is not None and nq.attrs != nk.attrs:
            continue
        q = nq.inputs[0] if nq else rq.inputs[0]
        k = nk.inputs[0] if nk else rk.inputs[0]
        norms = [nq.inputs[1], nk.inputs[1]] if nq else [None, None]
        caches = list(node.inputs[5:7]) + [None] * (2 - len(node.inputs[5:7]))
        at = graph.nodes.index(node)
        eps = nq.attrs["eps"] if nq else 1e-6
        fused = new_node(
            graph,
            "rope_attention",
            [q, k, *node.inputs[2:5], rq.inputs[1], *norms, *caches],
            at,
            **node.attrs,
            **rq.attrs,
            eps=eps,
        )
        for old, new in zip(node.outputs, fused.outputs):
            replace_uses(graph, old, new)
        remove(graph, [node, rq, rk] + [n for n in (nq, nk) if n is not None])
        prod = producers(graph)
        count += 1
    return count


def fold_routing_into_moe(graph: Graph, ctx) -> int:
    """moe_experts(x, router(linear(cast(x), Wr)), ...) -> moe_routed(x, Wr, ...): routing and
    expert grouping in one op (legal when the router's outputs feed only this MoE)."""
    prod = producers(graph)
    count = 0
    for node in list(graph.nodes):
        if node.op != "moe_experts":
            continue
        x, w, idx = node.inputs[:3]
        router = prod.get(id(w))
        if (
            router is None
            or router.op not in ("router_softmax_topk", "router_sigmoid_grouped")
            or prod.get(id(idx)) is not router
        ):
            continue
        caps = match(P("linear", P("cast", P(name="x")), P(name="wr", kind="param")), router.inputs[0], prod)
        uses = use_counts(graph)
        if caps is None or caps["x"] is not x or uses[id(w)] != 1 or uses[id(idx)] != 1:
            continue
        lin = prod[id(router.inputs[0])]
        cast = prod[id(lin.inputs[0])]
        if uses[id(lin.outputs[0])] != 1 or uses[id(cast.outputs[0])] != 1:
            continue
        kind = "softmax" if router.op == "router_softmax_topk" else "sigmoid_grouped"
        bias = router.inputs[1] if kind == "sigmoid_grouped" else None
        at = graph.nodes.index(node)
        fused = new_node(graph, "moe_routed", [x, caps["wr"], bias, *node.inputs[3:5]], at, router=kind, **router.attrs)
        replace_uses(graph, node.outputs[0], fused.outputs[0])
        remove(graph, [node, router, lin, cast])
        prod = producers(graph)
        count += 1
    return count


def concat_type(values) -> TensorType:
    first = values[0].type
    return TensorType((sum(v.type.shape[0] for v in values), *first.shape[1:]), first.dtype)


def concat_weights(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)
