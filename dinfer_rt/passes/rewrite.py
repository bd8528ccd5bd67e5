"""Graph surgery helpers shared by passes: rewire uses, remove and insert nodes."""

from __future__ import annotations

from dinfer_rt.ir import Graph, Node, Value


def replace_uses(graph: Graph, old: Value, new: Value) -> None:
    for node in graph.nodes:
        node.inputs = [new if v is old else v for v in node.inputs]
    for name, v in graph.outputs.items():
        if v is old:
            graph.outputs[name] = new


def new_node(graph: Graph, op: str, inputs: list[Value | None], at: int, **attrs) -> Node:
    """Build a node with ``graph.op`` (so its types are inferred) and move it to position ``at``."""
    graph.op(op, *inputs, **attrs)
    node = graph.nodes.pop()
    graph.nodes.insert(at, node)
    return node


def remove(graph: Graph, nodes: list[Node]) -> None:
    dead = {id(n) for n in nodes}
    graph.nodes = [n for n in graph.nodes if id(n) not in dead]


def use_counts(graph: Graph) -> dict[int, int]:
    counts: dict[int, int] = {}
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None:
                counts[id(v)] = counts.get(id(v), 0) + 1
    for v in graph.outputs.values():
        counts[id(v)] = counts.get(id(v), 0) + 1
    return counts
