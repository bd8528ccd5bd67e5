"""Entry point of the ``rocm_dcu`` backend: Hygon DCUs (DTK) and AMD Instinct GPUs through HIP.

Chosen as ``DINFER_BACKEND=rocm_dcu[:hygon|:amd[:gfxNNN]]``. The probe (``is_available``) reads
``torch.version.hip`` only; the flavour and arch are identified after selection from the device
properties (see ``detect.py``), unless the choice names them. Kernels are the shared Triton
library's; this folder owns the capability records and wave64 tuning rows (``tuning.py``).
``DINFER_INTERPRET=1`` runs the kernels with this arch's tuning under Triton's interpreter.
"""

from __future__ import annotations

import shutil

import torch

from dinfer_rt.backend import Availability, Capabilities
from dinfer_rt.backends.rocm_dcu import detect, tuning
from dinfer_rt.backends.triton.backend import TritonBackend, interpreting, triton_installed, triton_version
from dinfer_rt.backends.triton.launch import INTERPRETER_PARALLELISM
from dinfer_rt.envs import shown
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


class RocmDcuBackend(TritonBackend):
    name = "rocm_dcu"
    flavour = "auto"
    priority = 25
    identified_by = "not identified yet"
    _identified = False

    def is_available(self) -> Availability:
        if not triton_installed():
            return Availability(False, "triton is not installed (on DCU: the DTK build of Triton)")
        if interpreting():
            return Availability(True, "DINFER_INTERPRET=1: Triton kernels run on CPU tensors with wave64 tuning")
        if torch.version.hip is None:
            return Availability(False, f"torch {torch.__version__} is not a HIP/DTK build (torch.version.hip is None)")
        if not torch.cuda.is_available():
            return Availability(False, f"HIP {torch.version.hip} build of torch sees no DCU/GPU")
        return Availability(True, f"{torch.cuda.device_count()} HIP device(s), HIP {torch.version.hip}")

    def validate_choice(self) -> str | None:
        if self.flavour not in ("auto", "hygon", "amd"):
            return f"rocm_dcu flavour {shown(self.flavour)} is not one of hygon, amd"
        if self.arch is not None:
            if self.arch not in tuning.ARCHS:
                return f"rocm_dcu arch {shown(self.arch)} has no tuning row; known: {', '.join(tuning.ARCHS)}"
            vendor = tuning.ARCHS[self.arch].vendor
            if self.flavour not in ("auto", vendor) and self.arch != "gfx906":  # gfx906: Z100 and MI50 alike
                return f"rocm_dcu arch {self.arch} is a {vendor} arch, not {self.flavour}"
        return None

    def identify(self) -> None:
        """Fill in flavour and arch: from the choice, else the device (after selection only)."""
        if self._identified:
            return
        self._identified = True
        if self.arch is not None:
            if self.flavour == "auto":
                self.flavour = tuning.ARCHS[self.arch].vendor
            self.identified_by = f"chosen: {self.flavour}:{self.arch}"
            return
        if interpreting() or not torch.cuda.is_available():
            self.flavour = "amd" if self.flavour == "auto" else self.flavour
            self.arch = tuning.DEFAULT_ARCH[self.flavour]
            self.identified_by = f"no device: {self.flavour}'s default arch {self.arch}"
            return
        props = torch.cuda.get_device_properties(0)
        ident = detect.identify(props.name, getattr(props, "gcnArchName", ""), shutil.which)
        self.flavour = ident.flavour if self.flavour == "auto" else self.flavour
        self.arch, self.identified_by = ident.arch, ident.how

    def capabilities(self) -> Capabilities:
        self.identify()
        rec = tuning.record(self.arch)
        dtypes = (torch.float32, torch.bfloat16, torch.float16) if rec.bf16 else (torch.float32, torch.float16)
        extra = {
            "arch": rec.arch,
            "products": rec.products,
            "lds_bytes": rec.lds_bytes,
            "matrix_dtypes": rec.matrix_dtypes,
            "confirmed": rec.confirmed,
            "identified_by": self.identified_by,
        }
        formats = ("int8", "fp8", "gptq4") if "fp8" in rec.matrix_dtypes else ("int8", "gptq4")
        return Capabilities(dtypes=dtypes, warp_size=64, collectives="nccl (RCCL)", extra=extra, weight_formats=formats)

    def tuning(self) -> dict:
        """The arch's wave64 row; under the interpreter, with its rows/heads per program raised
        (tile shapes, hence numerics, stay the arch's)."""
        self.identify()
        row = tuning.TUNING[self.arch]
        return {**row, **INTERPRETER_PARALLELISM} if interpreting() else row

    def versions(self) -> dict[str, str]:
        tools = ",".join(t for t in ("hy-smi", "rocm-smi") if shutil.which(t)) or "none"
        return {"torch": torch.__version__, "hip": str(torch.version.hip), "triton": triton_version(), "smi": tools}


@hookimpl
def dinfer_rt_register_backends():
    return [RocmDcuBackend]


@hookimpl
def dinfer_rt_compile_targets():
    from dinfer_rt.backends.rocm_dcu.aot import targets

    return targets()
