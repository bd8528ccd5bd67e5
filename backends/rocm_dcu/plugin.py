"""Entry point of the ``rocm_dcu`` backend. Detection follows hardware.md §5.4: the HIP build
is recognised by ``torch.version.hip`` (an attribute read), the vendor by ``hy-smi`` (Hygon)
versus ``rocm-smi`` (AMD); device properties are read only after selection."""

from __future__ import annotations

import shutil

import torch

from dinfer_rt.backend import Availability, Backend, Capabilities
from dinfer_rt.plugins import hookimpl


class RocmDcuBackend(Backend):
    name = "rocm_dcu"
    flavour = "hygon" if shutil.which("hy-smi") else "amd"
    device_type = "cuda"  # HIP builds of torch use the cuda device type
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    priority = 25

    def is_available(self) -> Availability:
        if torch.version.hip is None:
            return Availability(False, f"torch {torch.__version__} is not a HIP/ROCm build (torch.version.hip is None)")
        if not torch.cuda.is_available():
            return Availability(False, f"HIP {torch.version.hip} build sees no DCU/GPU device")
        return Availability(True, f"{torch.cuda.device_count()} HIP device(s), HIP {torch.version.hip}")

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64), warp_size=64)

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "hip": str(torch.version.hip)}


@hookimpl
def dinfer_rt_register_backends():
    return [RocmDcuBackend]
