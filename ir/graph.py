"""SSA graphs: values defined once, nodes in program order, verified and printable."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dinfer_rt.ir.ops import OpTypeError, op_def
from dinfer_rt.ir.types import TensorType


class IRError(ValueError):
    """A graph breaks an IR invariant (SSA, types, arity, undefined values)."""


@dataclass(eq=False)
class Value:
    """An SSA value: a graph input, a parameter (weight), or one output of a node."""

    name: str
    type: TensorType
    kind: str = "node"  # "input" | "param" | "node"

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list[Value | None]
    attrs: dict[str, Any]
    outputs: list[Value]

    def __str__(self) -> str:
        outs = ", ".join(f"%{o.name}: {o.type}" for o in self.outputs)
        args = ", ".join("_" if v is None else f"%{v.name}" for v in self.inputs)
        attrs = "".join(f", {k}={_fmt(v)}" for k, v in sorted(self.attrs.items()))
        return f"{outs} = {self.op}({args}{attrs})"


def _fmt(v: Any) -> str:
    s = str(v)
    return s.removeprefix("torch.")


@dataclass(eq=False)
class Graph:
    """A model forward as a list of nodes; ``outputs`` maps result names to values."""

    name: str
    inputs: list[Value] = field(default_factory=list)
    params: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: dict[str, Value] = field(default_factory=dict)
    _counter: int = 0

    # -- building ---------------------------------------------------------------------------
    def input(self, name: str, type: TensorType) -> Value:
        v = Value(name, type, "input")
        self.inputs.append(v)
        return v

    def param(self, name: str, type: TensorType) -> Value:
        v = Value(name, type, "param")
        self.params.append(v)
        return v

    def op(self, name: str, *inputs: Value | None, n_out: int | None = None, **attrs: Any) -> Any:
        """Append a node; returns its output value (or a tuple when it has several)."""
        opd = op_def(name)
        types = [None if v is None else v.type for v in inputs]
        try:
            out_types = opd.infer(types, attrs)
        except OpTypeError as e:
            raise IRError(f"node {len(self.nodes)} ({name}): {e}") from None
        outs = []
        for t in out_types:
            outs.append(Value(str(self._counter), t))
            self._counter += 1
        self.nodes.append(Node(name, list(inputs), dict(attrs), outs))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def output(self, name: str, value: Value) -> None:
        self.outputs[name] = value

    # -- checking ---------------------------------------------------------------------------
    def verify(self) -> Graph:
        """Check SSA (defined once, before use), arity, re-inferred types and outputs."""
        defined: set[int] = set()
        names: set[str] = set()

        def define(v: Value, where: str) -> None:
            if id(v) in defined or v.name in names:
                raise IRError(f"{where}: value %{v.name} defined twice (graph {self.name} is not SSA)")
            defined.add(id(v))
            names.add(v.name)

        for v in self.inputs + self.params:
            define(v, f"{v.kind} {v.name}")
        for i, node in enumerate(self.nodes):
            where = f"node {i} ({node.op})"
            try:
                opd = op_def(node.op)
            except OpTypeError as e:
                raise IRError(f"{where}: {e}") from None
            if not opd.min_inputs <= len(node.inputs) <= opd.max_inputs:
                raise IRError(f"{where}: takes {opd.min_inputs}..{opd.max_inputs} inputs, got {len(node.inputs)}")
            for v in node.inputs:
                if v is not None and id(v) not in defined:
                    raise IRError(f"{where}: uses %{v.name} before it is defined")
            try:
                want = opd.infer([None if v is None else v.type for v in node.inputs], node.attrs)
            except OpTypeError as e:
                raise IRError(f"{where}: {e}") from None
            got = [o.type for o in node.outputs]
            if want != got:
                raise IRError(
                    f"{where}: output types {[str(t) for t in got]} but the op infers {[str(t) for t in want]}"
                )
            for o in node.outputs:
                define(o, where)
        for name, v in self.outputs.items():
            if id(v) not in defined:
                raise IRError(f"output {name!r}: %{v.name} is not defined in graph {self.name}")
        return self

    # -- reading ----------------------------------------------------------------------------
    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __str__(self) -> str:
        lines = [f"graph {self.name}("]
        lines += [f"    %{v.name}: {v.type}," for v in self.inputs]
        lines.append(f") params {len(self.params)} {{")
        lines += [f"    param %{v.name}: {v.type}" for v in self.params]
        lines += [f"  {n}" for n in self.nodes]
        outs = ", ".join(f"{k}=%{v.name}" for k, v in self.outputs.items())
        lines.append(f"  return {outs}")
        lines.append("}")
        return "\n".join(lines)
