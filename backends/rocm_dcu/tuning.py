"""Capability records and tuning rows per AMD-family architecture, kept as data.

Every arch here runs 64-wide wavefronts: a Triton "warp" is 64 lanes, so NVIDIA's warp counts
halve for the same tile. Hygon arch ids come from issues and PRs, not vendor documentation
(docs/backends/rocm_dcu.md): the gfx928/gfx936 records are marked unconfirmed. The tuning rows use the
shared launch functions in ``dinfer_rt.backends.triton.launch``; no kernel needs a structurally
different wave64 variant so far (the tiles differ, the source does not).
"""

from __future__ import annotations

from dataclasses import dataclass

from dinfer_rt.backends.triton.launch import GPU_DEFAULTS


@dataclass(frozen=True)
class ArchRecord:
    arch: str
    vendor: str  # "hygon" or "amd"
    products: str
    lds_bytes: int  # local data share per workgroup
    matrix_dtypes: tuple[str, ...]  # dtypes the matrix cores (MFMA) take; () = none (dot via FMA)
    bf16: bool  # offer bfloat16 models (else fp16 is the 16-bit type)
    upstream_triton: bool  # upstream Triton's HIP backend compiles for it (else DTK's Triton)
    confirmed: bool = True


ARCHS: dict[str, ArchRecord] = {
    "gfx906": ArchRecord("gfx906", "hygon", "Hygon Z100/Z100L (also AMD MI50/MI60)", 65536, (), False, True),
    "gfx928": ArchRecord("gfx928", "hygon", "Hygon K100_AI / K500SM_AI", 65536, ("fp16", "bf16"), True, False, False),
    "gfx936": ArchRecord("gfx936", "hygon", "Hygon BW1000 / BW1100", 65536, ("fp16", "bf16"), True, False, False),
    "gfx90a": ArchRecord("gfx90a", "amd", "AMD Instinct MI210/MI250(X)", 65536, ("fp16", "bf16"), True, True),
    "gfx942": ArchRecord(
        "gfx942", "amd", "AMD Instinct MI300X/MI300A/MI325X", 65536, ("fp16", "bf16", "fp8"), True, True
    ),
}
DEFAULT_ARCH = {"hygon": "gfx936", "amd": "gfx942"}
COMPILABLE = tuple(a for a, r in ARCHS.items() if r.upstream_triton)
DTK_ONLY = tuple(a for a, r in ARCHS.items() if not r.upstream_triton)

_WAVE64 = dict(
    GPU_DEFAULTS,
    warps_per_4k=4,  # 4 x 64 lanes per 4096 columns: 16 elements per lane, as on NVIDIA
    max_warps=8,
    attn_m=64,
    attn_n=16,  # head_dim 128 on gfx942: 64-key tiles need 451 VGPRs, 32-key tiles spill 77 SGPRs, 16: none
    attn_warps=4,  # 8 waves spill there
    gemm_m=16,  # 32 rows spill 9 VGPRs in the LM-head kernel on gfx942
    gemm_n=64,
    gemm_k=32,
    gemm_warps=4,
)
TUNING: dict[str, dict] = {
    # no MFMA (FMA dots): 16x16 attention tiles on 4 waves are the largest without spills
    "gfx906": dict(_WAVE64, attn_m=16),
    "gfx928": dict(_WAVE64),
    "gfx936": dict(_WAVE64),
    "gfx90a": dict(_WAVE64),
    "gfx942": dict(_WAVE64),
}


def record(arch: str) -> ArchRecord:
    return ARCHS[arch]


def dtype_name(arch: str) -> str:
    """The 16-bit type kernels are built for on ``arch``."""
    return "bf16" if ARCHS[arch].bf16 else "fp16"
