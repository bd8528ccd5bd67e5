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


def concat_type(values) -> TensorType:
    first = values[0].type
    return TensorType((sum(v.type.shape[0] for v in values), *first.shape[1:]), first.dtype)


def concat_weights(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)
