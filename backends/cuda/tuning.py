"""NVIDIA tuning rows for the shared Triton kernels, per compute capability (plain data).

Unknown archs get the sm_90 row. ``interpret`` is the row Triton's interpreter runs with on the
CPU: same tile shapes (hence numerics), more rows and heads per program.
"""

from __future__ import annotations

from dinfer_rt.backends.triton.launch import GPU_DEFAULTS, INTERPRETER_PARALLELISM

ARCH_TABLE = {
    "sm_80": dict(GPU_DEFAULTS, attn_warps=8),  # 4 warps spill 204 B in attention (ptxas, head_dim 128)
    "sm_90": dict(GPU_DEFAULTS, attn_warps=8),
    "interpret": dict(
        GPU_DEFAULTS,
        warps_per_4k=1,
        elementwise_block=2048,
        attn_warps=1,
        gemm_warps=1,
        attn_split_below=0,  # one program per step is the interpreter's cost: never split keys
        **INTERPRETER_PARALLELISM,
    ),
}
AOT_TARGETS = {"sm_80": 80, "sm_90": 90}  # compute capability per ahead-of-time target


def table(arch: str | None) -> dict:
    return ARCH_TABLE.get(arch or "sm_90", ARCH_TABLE["sm_90"])
