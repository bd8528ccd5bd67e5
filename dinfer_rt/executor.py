"""Turn a verified graph plus a kernel table into straight-line Python: the hot path.

Every backend reuses it: no dict lookups, no plugin calls, no type checks per op. The step
list (kernel, input slots, output slots, attributes, slots last used here) is compiled once
into the source of one function, ``s7 = k3(s2, w5, eps=c0)`` per node with a ``del`` after each
value's last use (as torch.fx does for its graph modules), so peak memory still follows the
graph's liveness and a forward pays one Python call per kernel and nothing else. The same
steps can be interpreted (``mode="interpreted"``): the reference the generated code is tested
against, and a fallback for debugging (``DINFER_EXECUTOR=interpreted``).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dinfer_rt import envs
from dinfer_rt.errors import BackendError, DinferError
from dinfer_rt.ir import Graph

MODES = ("generated", "interpreted")

Kernel = Callable[..., Any]


@dataclass(frozen=True)
class Step:
    kernel: Kernel
    inputs: tuple[int, ...]  # slot per input; -1 for an absent optional input
    outputs: tuple[int, ...]
    attrs: dict[str, Any]
    free: tuple[int, ...]  # slots whose last use is this step


class Executable:
    """A graph bound to kernels and weights; call with the graph inputs by name."""

    def __init__(
        self,
        graph: Graph,
        kernels: Mapping[str, Kernel],
        weights: Mapping[str, torch.Tensor],
        backend: str = "?",
        sources: Mapping[str, str] | None = None,
        mode: str | None = None,
    ) -> None:
        mode = mode or envs.get(envs.DINFER_EXECUTOR) or "generated"
        if mode not in MODES:
            raise DinferError(f"executor mode {mode!r} unknown (DINFER_EXECUTOR): use one of {', '.join(MODES)}")
        self.graph, self.backend, self.mode = graph, backend, mode
        sources = sources or {}
        # Ops served by a declared fallback rather than a native kernel, counted per op.
        self.fallbacks = Counter(n.op for n in graph.nodes if sources.get(n.op, "native").startswith("fallback"))
        slot: dict[int, int] = {}

        def slot_of(v) -> int:
            return slot.setdefault(id(v), len(slot))

        self.input_slots = [(v.name, v.type, slot_of(v)) for v in graph.inputs]
        self._seen: list[tuple | None] = [None] * len(self.input_slots)  # check_inputs' last matched inputs
        base: dict[int, torch.Tensor] = {}
        for p in graph.params:
            if p.name not in weights:
                raise BackendError(f"{backend}: no weight for graph parameter {p.name!r}")
            t = weights[p.name]
            if not p.type.matches(t):
                raise BackendError(f"{backend}: weight {p.name!r} is {t.dtype} {list(t.shape)}, graph expects {p.type}")
            base[slot_of(p)] = t
        keep = {id(v) for v in graph.outputs.values()} | {id(p) for p in graph.params}
        last_use: dict[int, int] = {}
        for i, node in enumerate(graph.nodes):
            for v in node.inputs:
                if v is not None and id(v) not in keep:
                    last_use[id(v)] = i
        steps = []
        for i, node in enumerate(graph.nodes):
            if node.op not in kernels:
                raise BackendError(f"{backend}: no kernel for IR op {node.op!r}")
            kernel = kernels[node.op]
            if not callable(kernel):  # once per graph here, not a TypeError inside the generated code
                src = sources.get(node.op, "native")
                raise BackendError(
                    f"{backend}: kernel for IR op {node.op!r} ({src}) is {type(kernel).__name__} {kernel!r:.40}, "
                    "which is not callable"
                )
            ins = tuple(-1 if v is None else slot_of(v) for v in node.inputs)
            outs = tuple(slot_of(o) for o in node.outputs)
            free = tuple(
                slot[id(v)]
                for v in {id(v): v for v in node.inputs if v is not None}.values()
                if last_use.get(id(v)) == i and v.kind == "node"
            )
            steps.append(Step(kernel, ins, outs, dict(node.attrs), free))
        self.steps = steps
        self._sources = dict(sources)
        self.n_slots = len(slot)
        self.base = [base.get(i) for i in range(self.n_slots)]
        self.output_slots = [(name, slot_of(v)) for name, v in graph.outputs.items()]
        self.input_names = [name for name, _, _ in self.input_slots]
        self.output_names = [name for name, _ in self.output_slots]
        self.source, self._program = self._generate()
        self.run = self._program if mode == "generated" else self._interpret

    def _generate(self) -> tuple[str, Callable[..., tuple]]:
        """The straight-line function for the steps: its source and the compiled function."""
        ns: dict[str, Any] = {}
        consts: dict[int, str] = {}

        def const(value: Any) -> str:
            if value is None or isinstance(value, (bool, int, str)):
                return repr(value)
            name = consts.setdefault(id(value), f"c{len(consts)}")
            ns[name] = value
            return name

        def val(i: int) -> str:
            if i < 0:
                return "None"
            if self.base[i] is not None:
                ns[f"w{i}"] = self.base[i]  # a weight: a constant of the function
                return f"w{i}"
            return f"s{i}"

        args = ", ".join(f"s{s}" for _, _, s in self.input_slots)
        lines = [f"def program({args}):"]
        self._line_step: dict[int, int] = {}  # a line of the program -> its step (a fault names the node)
        for n, st in enumerate(self.steps):
            ns[f"k{n}"] = st.kernel
            call = ", ".join([val(i) for i in st.inputs] + [f"{k}={const(v)}" for k, v in st.attrs.items()])
            outs = ", ".join(f"s{o}" for o in st.outputs)
            lines.append(f"    {outs} = k{n}({call})")
            self._line_step[len(lines)] = n
            if st.free:
                lines.append("    del " + ", ".join(f"s{f}" for f in st.free))
        rets = ", ".join(val(s) for _, s in self.output_slots)
        lines.append(f"    return ({rets},)")
        source = "\n".join(lines) + "\n"
        self._filename = f"<dinfer-rt {self.backend} {self.graph.name}>"
        code = compile(source, self._filename, "exec")
        exec(code, ns)  # noqa: S102 (our own generated source, built from the graph above)
        return source, ns["program"]

    @staticmethod
    def annotate(graph: Graph, sources: Mapping[str, str], backend: str) -> str:
        """The graph text with each node's kernel source (``native``, ``plugin:X``, ``fallback:...``)
        and a count of fallbacks: what ``dinfer-rt ir --backend X`` prints."""
        lines = str(graph).splitlines()
        first = next(i for i, line in enumerate(lines) if line.startswith("  %"))
        fallbacks: Counter[str] = Counter()
        for i, node in enumerate(graph.nodes):
            src = sources.get(node.op, "missing")
            lines[first + i] += f"    # {src}"
            if src.startswith("fallback"):
                fallbacks[node.op] += 1
        summary = ", ".join(f"{op} x{c}" for op, c in sorted(fallbacks.items())) or "none"
        return "\n".join(lines) + f"\n# backend {backend}: {sum(fallbacks.values())} fallback node(s): {summary}"

    def check_inputs(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Every input present with its declared dtype and rank, symbolic dims bound consistently.
        An input that is the very tensor of the last call, same shape, dtype and device (the KV
        caches, every step), is not matched again: its dims from then are bound instead (cheaper,
        same verdict)."""
        bindings: dict[str, int] = {}
        seen = self._seen
        for i, (name, typ, _) in enumerate(self.input_slots):
            t = inputs.get(name)
            if t is None:
                raise DinferError(f"{self.graph.name}: missing input {name!r} ({typ})")
            last = seen[i]
            if last is not None and last[0]() is t and last[1] == (t.shape, t.dtype, t.device):
                ok = all(bindings.setdefault(sym, got) == got for sym, got in last[2])
            else:
                ok = typ.matches(t, bindings)
                dims = [(d, g) for d, g in zip(typ.shape, t.shape) if isinstance(d, str)]
                # a weak reference: the check never keeps an input alive
                seen[i] = (weakref.ref(t), (t.shape, t.dtype, t.device), dims) if ok else None
            if not ok:
                raise DinferError(
                    f"{self.graph.name}: input {name!r} is {t.dtype} {list(t.shape)}, expected {typ} with {bindings}"
                )

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.check_inputs(inputs)
        try:
            outs = self.run(*[inputs[name] for name in self.input_names])
        except DinferError:
            raise
        except Exception as e:  # a kernel raised: name its node and op (the program has no source file)
            step = self._failed_step(e)
            if step is None:
                raise
            if isinstance(e, RuntimeError):  # torch's own (OOM, a lost peer's collective): callers catch the type
                e.add_note(self._fault(step, e))
                raise
            raise BackendError(self._fault(step, e)) from e  # a porter's kernel: wrong signature, types, ...
        return dict(zip(self.output_names, outs))

    def _failed_step(self, e: BaseException) -> int | None:
        """The step whose kernel call raised ``e`` (the innermost program frame of its traceback)."""
        if self.mode != "generated":
            return getattr(e, "_dinfer_step", None)
        tb, step = e.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == self._filename:
                step = self._line_step.get(tb.tb_lineno, step)
            tb = tb.tb_next
        return step

    def _fault(self, step: int, e: BaseException) -> str:
        node = self.graph.nodes[step]
        kernel = self.steps[step].kernel
        name = getattr(kernel, "__qualname__", type(kernel).__name__)
        return (
            f"{self.backend}: the kernel for IR op {node.op!r} ({self._sources.get(node.op, 'native')}: {name}) "
            f"raised {type(e).__name__}: {e} (graph {self.graph.name}, node {step} of {len(self.graph.nodes)}, "
            f"{len([v for v in node.inputs if v is not None])} inputs, attrs {dict(node.attrs)})"
        )

    def _interpret(self, *args: torch.Tensor) -> tuple:
        """The steps run one by one from the slot list: what the generated code must equal."""
        env: list[Any] = list(self.base)
        for (_, _, s), t in zip(self.input_slots, args):
            env[s] = t
        for n, st in enumerate(self.steps):
            try:
                result = st.kernel(*(None if i < 0 else env[i] for i in st.inputs), **st.attrs)
            except Exception as e:
                e._dinfer_step = n  # which step, for __call__'s message
                raise
            if len(st.outputs) == 1:
                env[st.outputs[0]] = result
            else:
                for s, r in zip(st.outputs, result):
                    env[s] = r
            for s in st.free:
                env[s] = None
        return tuple(env[s] for _, s in self.output_slots)
