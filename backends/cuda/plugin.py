"""Entry point of the ``cuda`` backend (group ``dinfer_rt.backends``).

``DINFER_INTERPRET=1`` runs the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``:
how every kernel is checked on machines without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Mapping

import torch

from dinfer_rt import envs
from dinfer_rt.backend import Availability, Backend, Capabilities
from dinfer_rt.executor import Kernel
from dinfer_rt.plugins import hookimpl


def interpreting() -> bool:
    return envs.flag(envs.DINFER_INTERPRET)


def triton_kernels(backend: Backend, tuning: dict) -> Mapping[str, Kernel]:
    """The shared Triton kernels for one tuning row (cuda and rocm_dcu), or none without triton.
    In interpreter mode, checks that triton was imported after TRITON_INTERPRET=1 was set.
    With DINFER_AUTOTUNE=1 an on-disk autotuner keyed by arch and versions is attached."""
    if importlib.util.find_spec("triton") is None:
        return {}
    if interpreting():
        os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when the kernels module is imported
        # numpy warns about NaN in padding lanes (-inf - -inf) that the kernels never store
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        import triton.language as tl

        if type(tl.sum).__name__ != "InterpretedFunction":
            from dinfer_rt.errors import BackendError

            raise BackendError(
                f"{backend.name}: DINFER_INTERPRET=1 but triton was imported before TRITON_INTERPRET=1 was set; "
                "set DINFER_INTERPRET=1 (or TRITON_INTERPRET=1) in the environment before starting Python"
            )
    from dinfer_rt.backends.cuda.ops import make_kernels

    tuner = None
    if envs.flag(envs.DINFER_AUTOTUNE):
        from dinfer_rt.backends.cuda.autotune import Autotuner

        sync = (lambda: None) if interpreting() else torch.cuda.synchronize
        from dinfer_rt import __version__

        versions = {**backend.versions(), "dinfer_rt": __version__}
        tuner = Autotuner(backend.arch or "unknown", versions, sync=sync)
    return make_kernels(tuning, interpreting(), backend.launch_config, tuner)


def triton_commit():
    """The Triton commit selection kernel's wrapper, or None without triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    from dinfer_rt.backends.cuda.ops import commit

    return commit


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


class CudaBackend(Backend):
    name = "cuda"
    flavour = "nvidia"
    device_type = "cuda"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    priority = 30

    def __init__(self) -> None:
        if interpreting():
            self.device_type, self.arch = "cpu", "interpret"

    def is_available(self) -> Availability:
        if importlib.util.find_spec("triton") is None:
            return Availability(False, "triton is not installed (pip install 'dinfer-rt[triton]')")
        if interpreting():
            return Availability(True, "DINFER_INTERPRET=1: Triton kernels run on CPU tensors (TRITON_INTERPRET=1)")
        if torch.version.hip is not None:
            return Availability(False, f"torch {torch.__version__} is a HIP build: use rocm_dcu")
        if torch.version.cuda is None:
            return Availability(False, f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)")
        if not torch.cuda.is_available():
            return Availability(False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
        return Availability(True, f"{torch.cuda.device_count()} CUDA device(s), CUDA {torch.version.cuda}")

    def capabilities(self) -> Capabilities:
        # no float64: the kernels accumulate in fp32, so they could not honour it
        return Capabilities(dtypes=(torch.float32, torch.bfloat16, torch.float16), warp_size=32)

    def kernels(self) -> Mapping[str, Kernel]:
        if self.arch is None and not interpreting() and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            self.arch = f"sm_{major}{minor}"
        return triton_kernels(self, self.tuning())

    def compile(self, graph, weights):
        """With DINFER_GRAPHS=1 on a GPU, forwards replay captured CUDA graphs per shape."""
        exe = super().compile(graph, weights)
        if envs.flag(envs.DINFER_GRAPHS) and not interpreting():
            from dinfer_rt.backends.cuda.graphs import GraphedExecutable

            return GraphedExecutable(exe)
        return exe

    def commit_kernel(self):
        return triton_commit()

    def tuning(self) -> dict:
        """This arch's tuning row (unknown archs get the sm_90 row)."""
        from dinfer_rt.backends.cuda.launch import table

        return table(self.arch)

    def default_launch_config(self, kernel: str) -> dict:
        from dinfer_rt.backends.cuda.launch import default_config

        return default_config(kernel, self.tuning())

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": triton_version()}


@hookimpl
def dinfer_rt_register_backends():
    return [CudaBackend]
