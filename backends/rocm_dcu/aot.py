"""Ahead-of-time HIP builds of the shared Triton kernels with this backend's tuning rows:
``dinfer-rt kernels compile --target rocm_dcu:gfx942`` (also gfx90a, gfx906) reports VGPR/SGPR
use, spills and LDS per kernel from the AMDGCN metadata. Upstream Triton's HIP backend does
this without a device; gfx928/gfx936 (Hygon) need the DTK build of Triton: asking for them
explains that instead of failing deep inside the compiler."""

from __future__ import annotations

import re

from dinfer_rt.backends.rocm_dcu import tuning
from dinfer_rt.backends.triton.aot import compile_each
from dinfer_rt.errors import BackendError


def _meta(asm: str, key: str) -> int | None:
    m = re.search(rf"^\s*\.{key}:\s+(\d+)", asm, re.MULTILINE)
    return int(m.group(1)) if m else None


def compile_hip(arch: str) -> list[dict]:
    target = f"rocm_dcu:{arch}"
    if arch in tuning.DTK_ONLY:
        rec = tuning.record(arch)
        raise BackendError(
            f"{target} ({rec.products}) is not an upstream Triton target: compile it with Hygon's DTK build "
            f"of Triton on a DTK machine (ROCM_PATH=/opt/dtk); upstream Triton here compiles "
            f"{', '.join(tuning.COMPILABLE)}"
        )
    from triton.backends.compiler import GPUTarget

    def resources(name: str, compiled) -> dict:
        asm = compiled.asm["amdgcn"]
        return {
            "registers": _meta(asm, "vgpr_count"),
            "sgprs": _meta(asm, "sgpr_count"),
            "spill_stores": _meta(asm, "vgpr_spill_count"),  # VGPRs spilled to scratch memory
            "spill_loads": None,  # the AMDGCN metadata counts spilled registers, not loads
            "sgpr_spills": _meta(asm, "sgpr_spill_count"),  # SGPRs spilled (into VGPR lanes)
            "lds_bytes": _meta(asm, "group_segment_fixed_size"),
            "shared_bytes": compiled.metadata.shared,
        }

    return compile_each(target, tuning.TUNING[arch], tuning.dtype_name(arch), GPUTarget("hip", arch, 64), resources)


def targets() -> dict:
    """Every rocm_dcu arch with a tuning row (DTK-only ones explain where to compile them)."""
    return {f"rocm_dcu:{arch}": (lambda arch=arch: compile_hip(arch)) for arch in tuning.ARCHS}
