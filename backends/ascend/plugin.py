"""Entry point of the ``ascend`` backend.

The probe never imports torch_npu into this process (torch_npu initialises once per process,
hardware.md §2.2): it checks that torch_npu is installed and that CANN's runtime libraries
can be found, and names what is missing.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
from pathlib import Path

import torch

from dinfer_rt.backend import Availability, Backend, Capabilities
from dinfer_rt.plugins import hookimpl

CANN_HOME_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


def find_cann_library(name: str = "hccl") -> str | None:
    """Path of lib<name>.so from CANN's env vars, LD_LIBRARY_PATH or the loader cache."""
    for var in CANN_HOME_VARS:
        home = os.environ.get(var)
        if home:
            for sub in ("lib64", "fwkacllib/lib64", "runtime/lib64"):
                p = Path(home) / sub / f"lib{name}.so"
                if p.is_file():
                    return str(p)
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if d and (Path(d) / f"lib{name}.so").is_file():
            return str(Path(d) / f"lib{name}.so")
    return ctypes.util.find_library(name)


class AscendBackend(Backend):
    name = "ascend"
    flavour = "910b"
    device_type = "npu"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    priority = 20

    def is_available(self) -> Availability:
        if importlib.util.find_spec("torch_npu") is None:
            return Availability(False, "torch_npu is not installed")
        if find_cann_library("hccl") is None:
            return Availability(
                False,
                "torch_npu is installed but cannot import without CANN: libhccl.so not found "
                "(source CANN's set_env.sh so ASCEND_HOME_PATH / LD_LIBRARY_PATH point to it)",
            )
        return Availability(True, "torch_npu and CANN found (devices are counted after selection)")

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=(torch.float32, torch.bfloat16, torch.float16), alignment_bytes=32)

    def kernels(self):
        """No torch_npu fused operators yet: every op runs through the reference fallback on NPU
        tensors. Importing torch_npu here (after selection, once) registers the ``npu`` device."""
        import torch_npu  # noqa: F401

        return {}

    def versions(self) -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            npu = version("torch_npu")
        except PackageNotFoundError:
            npu = "not installed"
        return {"torch": torch.__version__, "torch_npu": npu}


@hookimpl
def dinfer_rt_register_backends():
    return [AscendBackend]
