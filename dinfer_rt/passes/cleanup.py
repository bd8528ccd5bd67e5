"""Dead-code and common-subexpression elimination."""

from __future__ import annotations

from dinfer_rt.ir import Graph, op_def
from dinfer_rt.passes.rewrite import remove, replace_uses, use_counts


def dead_code(graph: Graph, ctx) -> int:
    """Drop nodes none of whose outputs are used (ops that write in place are kept)."""
    removed = 0
    while True:
        uses = use_counts(graph)
        dead = [n for n in graph.nodes if not op_def(n.op).mutates and not any(uses.get(id(o)) for o in n.outputs)]
        if not dead:
            return removed
        remove(graph, dead)
        removed += len(dead)


def common_subexpressions(graph: Graph, ctx) -> int:
    """Merge nodes with the same op, inputs and attributes (ops that write in place excepted)."""
    seen: dict[tuple, list] = {}
    duplicates = []
    for node in graph.nodes:
        if op_def(node.op).mutates:
            continue
        key = (node.op, tuple(id(v) for v in node.inputs), repr(sorted(node.attrs.items())))
        if key in seen:
            for old, new in zip(node.outputs, seen[key]):
                replace_uses(graph, old, new)
            duplicates.append(node)
        else:
            seen[key] = node.outputs
    remove(graph, duplicates)
    return len(duplicates)
