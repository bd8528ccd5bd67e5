"""The backend object: a :class:`~dinfer_rt.platform.Platform` plus what runs on it.

A backend owns its kernel table (IR op -> callable), its pass policy (which fusions pay, the
reordering priority) and its launch configuration. What plugins add to a backend (kernels,
passes, launch overrides) is gathered once, when the backend is selected, and handed to it as
:class:`Contributions`; nothing here calls a hook, and the hot path never does.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from dinfer_rt.errors import BackendError
from dinfer_rt.executor import Executable, Kernel
from dinfer_rt.ir import OPS, Graph
from dinfer_rt.platform import Availability, Capabilities, Platform

__all__ = ["Availability", "Backend", "Capabilities", "Contributions", "Platform", "kernel_table_problem"]


def closest_ops(name: str) -> str:
    """The IR op names closest to ``name`` (difflib), for an error about an unknown op."""
    close = difflib.get_close_matches(name, OPS, n=3, cutoff=0.6)
    if close:
        return "closest IR ops: " + ", ".join(close)
    return "no IR op has a close name; the ops are dinfer_rt.ir.OPS"


def kernel_table_problem(table: object) -> str | None:
    """Why ``table`` is not a kernel table ``{ir_op: callable}`` (its first fault), or None.
    Checked once where a table is collected (selection, compile), never per op at run time."""
    if not isinstance(table, Mapping):
        return f"returned {type(table).__name__}, expected a dict {{ir_op: kernel}}"
    for op, kernel in table.items():
        if op not in OPS:
            return f"names unknown IR op {op!r} ({closest_ops(str(op))})"
        if not callable(kernel):
            return f"maps IR op {op!r} to {type(kernel).__name__} {kernel!r:.40}, which is not callable"
    return None


@dataclass(frozen=True)
class Contributions:
    """Plugin additions for one backend. ``kernels``: (plugin, {op: kernel}) in the order they
    apply (a later entry overrides an earlier one); ``passes`` run after the shared pipeline;
    ``launch``: kernel -> launch parameters overriding the backend's own table; ``faults``: the
    plugin failures (``dinfer_rt.plugins.PluginFailure``) met while gathering them, whose
    contributions were dropped (``validate`` fails the backend on them)."""

    kernels: tuple[tuple[str, Mapping[str, Kernel]], ...] = ()
    passes: tuple = ()
    launch: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    faults: tuple = ()


class Backend(Platform):
    """Base class for backends. Override :meth:`kernels` (and the pass policy where the
    defaults do not fit); the platform part is inherited from :class:`Platform`."""

    contributions: Contributions = Contributions()

    # ---------------------------------------------------------------- kernel table
    def kernels(self) -> Mapping[str, Kernel]:
        """IR op name -> kernel callable with the op's reference signature (none by default:
        every op then takes the declared fallback)."""
        return {}

    def fallback_kernels(self) -> Mapping[str, Kernel]:
        """Declared fallback for ops without a native kernel: the op's reference torch
        implementation, run on this backend's device. Every use is counted and shown."""
        return {name: op.reference for name, op in OPS.items()}

    def kernel_table(self) -> dict[str, tuple[Kernel, str]]:
        """IR op -> (kernel, source): native kernels, then plugin contributions, else the fallback."""
        table = {op: (k, "fallback:reference") for op, k in self._checked("fallback_kernels").items()}
        table.update({op: (k, "native") for op, k in self._checked("kernels").items()})
        for plugin, kernels in self.contributions.kernels:
            table.update({op: (k, f"plugin:{plugin}") for op, k in kernels.items()})
        return table

    def _checked(self, method: str) -> Mapping[str, Kernel]:
        """``self.<method>()``, refused with a :class:`BackendError` naming the backend, the
        method and the fault when it is not ``{ir_op: callable}`` (a misspelt op would otherwise
        quietly fall back, a non-callable fail inside the generated code at the first forward)."""
        table = getattr(self, method)()
        if (why := kernel_table_problem(table)) is not None:
            cls = type(self)
            raise BackendError(f"backend {self.name!r} ({cls.__module__}.{cls.__qualname__}): {method}() {why}")
        return table

    def commit_kernel(self) -> Callable | None:
        """A device-side commit selection ``(conf, masked, quota, x0, x_block, *, rule, threshold)``
        -> commit mask (rules "threshold", "top_k"; writes ``x_block`` in place), or None: the
        scheduler then decides on the host."""
        return None

    def edit_kernel(self) -> Callable | None:
        """A device-side step of the editing rule ``joint_threshold`` (``(conf, token, masked,
        editable, x_block, *, threshold, edit_threshold)`` -> (commit, edit) masks, writing
        ``x_block`` in place; semantics: ``backends/reference/backend.py`` ``commit_edit``), or
        None: the rule then decides from the logits in torch."""
        return None

    # ---------------------------------------------------------------- pass policy
    def passes(self) -> list:
        """This backend's pass pipeline: the shared default plus plugin-contributed passes.
        Fusion passes whose fused op has no native kernel here are dropped by the manager."""
        from dinfer_rt.passes import default_pipeline

        return default_pipeline() + list(self.contributions.passes)

    def wants_fusion(self, pass_name: str) -> bool:
        """Cost decision, kept apart from legality: whether a fusion this backend has a kernel
        for is worth applying. Default: fuse whenever a native kernel exists."""
        return True

    def reorder_priority(self) -> Callable | None:
        """Priority for the reordering pass (``(node, remaining_uses, bindings) -> float``, higher
        runs first), e.g. to overlap copies; ``None`` uses the shared memory-min priority."""
        return None

    def optimize(
        self, graph: Graph, weights: dict[str, torch.Tensor], disabled: tuple[str, ...] = ()
    ) -> tuple[Graph, dict[str, int]]:
        """Run the pipeline on ``graph`` (minus the ``disabled`` passes, on top of
        ``DINFER_DISABLE_PASSES``); merged weights are added to ``weights`` once."""
        from dinfer_rt.passes import PassManager

        native = {op for op, (_, src) in self.kernel_table().items() if not src.startswith("fallback")}
        passes = [p for p in self.passes() if not p.needs_ops or self.wants_fusion(p.name)]
        manager = PassManager(passes, native, priority=self.reorder_priority(), disabled=disabled)
        return manager.run(graph, weights)

    # ---------------------------------------------------------------- launch configuration
    def default_launch_config(self, kernel: str) -> dict:
        """This backend's own launch/tuning table entry for ``kernel`` on ``self.arch``."""
        return {}

    def launch_config(self, kernel: str) -> dict:
        """Launch parameters for ``kernel``: the backend's table, overridden by plugin
        contributions (a vendor tunes a shipped kernel for a new arch without forking)."""
        return {**self.default_launch_config(kernel), **self.contributions.launch.get(kernel, {})}

    # ---------------------------------------------------------------- execution
    def replays_graphs(self) -> bool:
        """Whether compiled forwards replay captured device graphs (bound to their inputs'
        addresses): the scheduler then keeps its KV caches for the next call of the same shape
        instead of freeing them (``Model.cache_pool``)."""
        return False

    def compile(self, graph: Graph, weights: Mapping[str, torch.Tensor]) -> Executable:
        table = self.kernel_table()
        return Executable(
            graph,
            {op: k for op, (k, _) in table.items()},
            weights,
            backend=self.name,
            sources={op: src for op, (_, src) in table.items()},
        )
