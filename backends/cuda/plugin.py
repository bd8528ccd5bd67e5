"""Entry point of the ``cuda`` backend (group ``dinfer_rt.backends``)."""

from __future__ import annotations

import torch

from dinfer_rt.backend import Availability, Backend, Capabilities
from dinfer_rt.plugins import hookimpl


class CudaBackend(Backend):
    name = "cuda"
    flavour = "nvidia"
    device_type = "cuda"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    priority = 30

    def is_available(self) -> Availability:
        if torch.version.hip is not None:
            return Availability(False, f"torch {torch.__version__} is a HIP build: use rocm_dcu")
        if torch.version.cuda is None:
            return Availability(False, f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)")
        if not torch.cuda.is_available():
            return Availability(False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
        return Availability(True, f"{torch.cuda.device_count()} CUDA device(s), CUDA {torch.version.cuda}")

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64), warp_size=32)

    def versions(self) -> dict[str, str]:
        v = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
        try:
            import triton

            v["triton"] = triton.__version__
        except ImportError:
            v["triton"] = "not installed"
        return v


@hookimpl
def dinfer_rt_register_backends():
    return [CudaBackend]
