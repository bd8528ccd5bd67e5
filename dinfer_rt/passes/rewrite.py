"""The rewrite engine every fusion and folding pass runs on: rules (pattern -> rewrite
function) driven to a fixpoint over the graph, plus the graph surgery a rewrite needs.

A rule's pattern is matched against the first output of every node whose op is the pattern's
root; on a match its rewrite function gets a :class:`Site` (the graph, the node, the captures,
use counts and surgery helpers) and returns True if it changed the graph, False if the match
was not legal after all. Sweeps repeat until one makes no rewrite.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dinfer_rt.ir import Graph, Node, Value
from dinfer_rt.passes.pattern import P, match, producers


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


@dataclass
class Site:
    """One match of a rule: what its rewrite function reads and the surgery it may do."""

    graph: Graph
    node: Node
    caps: dict
    ctx: object  # the PassContext (weights for derived parameters)
    _prod: dict[int, Node]
    _uses: dict[int, int]

    def __getitem__(self, name: str):
        return self.caps[name]

    def uses(self, v: Value) -> int:
        return self._uses.get(id(v), 0)

    def single_use(self, *values: Value) -> bool:
        """Whether each value is read once (an intermediate with other users must stay)."""
        return all(self.uses(v) == 1 for v in values)

    def producer(self, v: Value | None) -> Node | None:
        return None if v is None else self._prod.get(id(v))

    def index(self, node: Node | None = None) -> int:
        return self.graph.nodes.index(node or self.node)

    def insert(self, op: str, inputs: list[Value | None], at: int, **attrs) -> Node:
        return new_node(self.graph, op, inputs, at, **attrs)

    def replace(self, old: list[Value], new: list[Value], dead: list[Node | None]) -> None:
        """Point every use of ``old[i]`` at ``new[i]`` and drop the ``dead`` nodes."""
        for o, n in zip(old, new):
            replace_uses(self.graph, o, n)
        remove(self.graph, [d for d in dead if d is not None])


@dataclass(frozen=True)
class Rule:
    pattern: P
    rewrite: Callable[[Site], bool]


def rewrite_to_fixpoint(graph: Graph, ctx, rules: list[Rule], max_sweeps: int = 100) -> int:
    """Apply ``rules`` until a sweep over the graph makes no rewrite; return how many it made."""
    total = 0
    for _ in range(max_sweeps):
        made = 0
        for node in list(graph.nodes):
            if not any(n is node for n in graph.nodes):
                continue  # removed by an earlier rewrite in this sweep
            for rule in rules:
                if node.op not in rule.pattern.roots():
                    continue
                prod = producers(graph)
                caps = match(rule.pattern, node.outputs[0], prod)
                if caps is not None and rule.rewrite(Site(graph, node, caps, ctx, prod, use_counts(graph))):
                    made += 1
                    break
        total += made
        if not made:
            return total
    raise RuntimeError(f"rewrite rules did not reach a fixpoint in {max_sweeps} sweeps on graph {graph.name}")


def rules_pass(*rules: Rule) -> Callable[[Graph, object], int]:
    """A pass function (``(graph, ctx) -> rewrites``) that drives ``rules`` to a fixpoint."""

    def run(graph: Graph, ctx) -> int:
        return rewrite_to_fixpoint(graph, ctx, list(rules))

    return run
