"""CPU reference backend: the reference implementations of the IR ops are its kernels.

It defines the truth other backends are validated against; with ``dtype=float64`` it is
the validation oracle.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dinfer_rt.backend import Availability, Backend, Capabilities
from dinfer_rt.backends.cpu.kernels import lm_head_confidence_chunked
from dinfer_rt.executor import Kernel
from dinfer_rt.ir import OPS


class CpuBackend(Backend):
    name = "cpu"
    flavour = "reference"  # device_type: "cpu", the Platform default
    priority = 0

    def is_available(self) -> Availability:
        return Availability(True, f"torch {torch.__version__} on the CPU, {torch.get_num_threads()} threads")

    def validate_choice(self) -> str | None:
        """The cpu backend has one flavour (subclasses: their own class default)."""
        own = type(self).flavour
        if self.flavour != own:
            return f"backend {self.name} has no flavour {self.flavour!r}; its flavour is {own!r}"
        return None

    def capabilities(self) -> Capabilities:
        dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        return Capabilities(dtypes=dtypes, collectives="gloo")

    def kernels(self) -> Mapping[str, Kernel]:
        kernels = {name: op.reference for name, op in OPS.items()}
        # The one fused op whose point is memory: never build [positions x vocab] probabilities.
        kernels["lm_head_confidence"] = lm_head_confidence_chunked
        return kernels
