"""The validation oracle as a backend of its own.

Every IR op runs its reference semantics (``ir/ops.py``) in plain torch, unfused (it declares no
kernels, so the fusion passes have nothing to fuse into), with no native code and no device
decision kernel: what ``dinfer-rt validate`` compares every backend against, ``cpu`` included.
Used in float64. Auto-detection never picks it (lowest priority); choose it by name.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dinfer_rt.backend import Availability, Backend, Capabilities
from dinfer_rt.executor import Kernel


class ReferenceBackend(Backend):
    name = "reference"
    flavour = "torch"
    priority = -100  # never the automatic choice: the oracle is slow on purpose

    def is_available(self) -> Availability:
        return Availability(True, f"torch {torch.__version__}: every op's reference semantics, unfused")

    def validate_choice(self) -> str | None:
        if self.flavour != type(self).flavour:
            return f"backend {self.name} has no flavour {self.flavour!r}; its flavour is {type(self).flavour!r}"
        return None

    def capabilities(self) -> Capabilities:
        dtypes = (torch.float64, torch.float32)
        return Capabilities(dtypes=dtypes, collectives="gloo", weight_formats=("int8", "fp8", "gptq4"))

    def kernels(self) -> Mapping[str, Kernel]:
        return {}  # every op from the shared references (kernel_table's fallback)
