"""Entry point of the ``cuda`` backend (group ``dinfer_rt.backends``): NVIDIA GPUs through the
shared Triton kernels. This folder holds only what is NVIDIA's: the probe, capabilities, tuning
rows (``tuning.py``) and ptxas-based AOT builds (``aot.py``)."""

from __future__ import annotations

import re

import torch

from dinfer_rt.backend import Availability, Capabilities
from dinfer_rt.backends.triton.backend import TritonBackend, interpreting, triton_installed, triton_version
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


class CudaBackend(TritonBackend):
    name = "cuda"
    flavour = "nvidia"
    priority = 30

    def __init__(self) -> None:
        super().__init__()
        if interpreting():
            self.arch = "interpret"

    def validate_choice(self) -> str | None:
        """One flavour; an arch with a tuning row, or any ``sm_NN`` compute capability (an untuned
        one gets the sm_90 row, as documented: :meth:`identify` writes such an arch back to
        ``DINFER_BACKEND`` for child processes, which must accept it)."""
        from dinfer_rt.backends.cuda.tuning import ARCH_TABLE

        if bad := self.choice_problem((type(self).flavour,), (self.arch,) if self.arch else ()):  # the flavour
            return bad
        if self.arch is None or self.arch in ARCH_TABLE or re.fullmatch(r"sm_\d{2,3}", self.arch):
            return None
        return f"{self.choice_problem((self.flavour,), tuple(ARCH_TABLE))} (or an sm_NN compute capability)"

    def is_available(self) -> Availability:
        if not triton_installed():
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

    def identify(self) -> None:
        if self.arch is None and not interpreting() and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            self.arch = f"sm_{major}{minor}"

    def capabilities(self) -> Capabilities:
        # no float64: the kernels accumulate in fp32, so they could not honour it
        dtypes = (torch.float32, torch.bfloat16, torch.float16)
        return Capabilities(dtypes=dtypes, warp_size=32, collectives="nccl", weight_formats=self.weight_formats())

    def weight_formats(self) -> tuple[str, ...]:
        """int8 and GPTQ everywhere; fp8 e4m3 from Ada / Hopper (sm_89+), and under the interpreter."""
        arch = self.arch or "sm_90"
        fp8 = arch == "interpret" or (arch.removeprefix("sm_").isdigit() and int(arch.removeprefix("sm_")) >= 89)
        return ("int8", "fp8", "gptq4") if fp8 else ("int8", "gptq4")

    def tuning(self) -> dict:
        """This arch's tuning row (unknown archs get the sm_90 row)."""
        from dinfer_rt.backends.cuda.tuning import table

        return table(self.arch)

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": triton_version()}


@hookimpl
def dinfer_rt_register_backends():
    return [CudaBackend]


@hookimpl
def dinfer_rt_compile_targets():
    from dinfer_rt.backends.cuda.aot import targets

    return targets()
