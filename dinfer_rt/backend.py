"""The typed backend object: what a plugin registers and what the hot path calls.

Hooks only find and register backends; a resolved :class:`Backend` then compiles
graphs into :class:`~dinfer_rt.executor.Executable` programs that run without any
plugin machinery in the loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dinfer_rt.executor import Executable, Kernel
from dinfer_rt.ir import OPS, Graph


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Capabilities:
    dtypes: tuple[torch.dtype, ...]
    warp_size: int | None = None
    alignment_bytes: int = 16
    memory_bytes: int | None = None
    extra: dict[str, object] = field(default_factory=dict)


class Backend:
    """Base class for backends. Subclasses set the class attributes and override the methods.

    ``is_available`` must be cheap and must never initialise a device runtime.
    """

    name: str = "?"
    flavour: str = "default"
    arch: str | None = None
    device_type: str = "cpu"
    visible_devices_env: str | None = None
    priority: int = 0  # auto-detect picks the available backend with the highest priority

    def is_available(self) -> Availability:
        return Availability(True, "ok")

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=(torch.float32,))

    def commit_kernel(self):
        """A device-side commit selection ``(conf, masked, quota, x0, x_block, *, rule, threshold)``
        -> commit mask (rules "threshold", "top_k"; writes ``x_block`` in place), or None: the
        scheduler then decides on the host."""
        return None

    def validate_choice(self) -> str | None:
        """Why the flavour/arch named in the choice (``name:flavour:arch``) is invalid, or None."""
        return None

    def kernels(self) -> Mapping[str, Kernel]:
        """IR op name -> kernel callable with the op's reference signature (none by default:
        compiling a graph then fails naming the first op without a kernel)."""
        return {}

    def fallback_kernels(self) -> Mapping[str, Kernel]:
        """Declared fallback for ops without a native kernel: the op's reference torch
        implementation, run on this backend's device. Every use is counted and shown."""
        return {name: op.reference for name, op in OPS.items()}

    def kernel_table(self) -> dict[str, tuple[Kernel, str]]:
        """IR op -> (kernel, source): native kernels, then plugin-registered ones, else the fallback."""
        from dinfer_rt.plugins import plugin_kernels

        table = {op: (k, "fallback:reference") for op, k in self.fallback_kernels().items()}
        table.update({op: (k, "native") for op, k in self.kernels().items()})
        for plugin, kernels in plugin_kernels(self.name):
            table.update({op: (k, f"plugin:{plugin}") for op, k in kernels.items()})
        return table

    def passes(self) -> list:
        """This backend's pass pipeline: the shared default plus passes plugins register for it.
        Fusion passes whose fused op has no native kernel here are dropped by the manager."""
        from dinfer_rt.passes import default_pipeline
        from dinfer_rt.plugins import plugin_passes

        return default_pipeline() + plugin_passes(self.name)

    def wants_fusion(self, pass_name: str) -> bool:
        """Cost decision, kept apart from legality: whether a fusion this backend has a kernel
        for is worth applying. Default: fuse whenever a native kernel exists."""
        return True

    def schedule_priority(self):
        """Priority for the reordering pass (``(node, remaining_uses, bindings) -> float``, higher
        runs first), e.g. to overlap copies; ``None`` uses the shared memory-min priority."""
        return None

    def optimize(self, graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, int]]:
        """Run the pipeline on ``graph``; merged weights are added to ``weights`` once."""
        from dinfer_rt.passes import PassManager

        native = {op for op, (_, src) in self.kernel_table().items() if not src.startswith("fallback")}
        passes = [p for p in self.passes() if not p.needs_ops or self.wants_fusion(p.name)]
        return PassManager(passes, native, priority=self.schedule_priority()).run(graph, weights)

    def default_launch_config(self, kernel: str) -> dict:
        """This backend's own launch/tuning table entry for ``kernel`` on ``self.arch``."""
        return {}

    def launch_config(self, kernel: str) -> dict:
        """Launch parameters for ``kernel``: the backend's table, overridden by plugin hooks
        (a vendor tunes a shipped kernel for a new arch without forking the backend)."""
        from dinfer_rt.plugins import plugin_launch_config

        return {**self.default_launch_config(kernel), **plugin_launch_config(self.name, kernel, self.arch)}

    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def compile(self, graph: Graph, weights: Mapping[str, torch.Tensor]) -> Executable:
        table = self.kernel_table()
        return Executable(
            graph,
            {op: k for op, (k, _) in table.items()},
            weights,
            backend=self.name,
            sources={op: src for op, (_, src) in table.items()},
        )

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def describe(self) -> str:
        arch = f":{self.arch}" if self.arch else ""
        return f"{self.name}:{self.flavour}{arch}"
