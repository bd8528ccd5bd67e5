"""A small structural matcher over the IR: patterns with named captures.

``P("rms_norm", P("add", P(name="a"), P(name="b"), name="sum"), P(name="w"))`` matches a
value produced by ``rms_norm`` whose first input was produced by ``add``; captures map
names to values (``"sum"``) and, with the suffix ``.node``, to the producing node.
"""

from __future__ import annotations

from dinfer_rt.ir import Graph, Node, Value


class P:
    """A pattern node: ``op`` (None: wildcard; a tuple: any of these ops), argument patterns, an
    optional capture name, and for wildcards an optional value kind (``"param"``, ``"input"``,
    ``"node"``). Argument patterns are matched against the first inputs; more inputs may follow."""

    __slots__ = ("op", "args", "name", "kind")

    def __init__(
        self, op: str | tuple[str, ...] | None = None, *args: P, name: str | None = None, kind: str | None = None
    ) -> None:
        self.op, self.args, self.name, self.kind = op, args, name, kind

    def roots(self) -> tuple[str, ...]:
        """The ops a node must have for this pattern to match its first output."""
        return (self.op,) if isinstance(self.op, str) else tuple(self.op or ())


def producers(graph: Graph) -> dict[int, Node]:
    return {id(o): n for n in graph.nodes for o in n.outputs}


def match(p: P, v: Value | None, prod: dict[int, Node], caps: dict[str, object] | None = None) -> dict | None:
    """Captures if ``p`` matches value ``v`` (consistently: a name bound twice must be the same value)."""
    caps = {} if caps is None else caps
    if v is None:
        return None
    if p.name is not None:
        if p.name in caps and caps[p.name] is not v:
            return None
        caps[p.name] = v
    if p.op is None:
        return caps if p.kind is None or v.kind == p.kind else None
    node = prod.get(id(v))
    if node is None or node.op not in p.roots() or len(p.args) > len(node.inputs):
        return None
    if p.name is not None:
        caps[p.name + ".node"] = node
    for sub, inp in zip(p.args, node.inputs):
        if match(sub, inp, prod, caps) is None:
            return None
    return caps
