"""Launch configuration for the ``cuda`` Triton kernels, kept apart from the kernel source;
plugins override entries through the ``dinfer_rt_launch_config`` hook."""

from __future__ import annotations

import triton

# rows per program (the interpreter runs one Python step per program, so it wants big tiles),
# warps per 4096 columns, and the column block of elementwise kernels.
ARCH_TABLE = {
    "sm_80": {"rows": 1, "warps_per_4k": 8, "elementwise_block": 1024},
    "sm_90": {"rows": 1, "warps_per_4k": 8, "elementwise_block": 1024},
    "interpret": {"rows": 256, "warps_per_4k": 1, "elementwise_block": 2048},
}


def table(arch: str | None) -> dict:
    return ARCH_TABLE.get(arch or "sm_90", ARCH_TABLE["sm_90"])


def row_config(n_cols: int, arch: str | None) -> dict:
    """A block covering a whole row (norms reduce over it) and warps that grow with it."""
    t = table(arch)
    block = triton.next_power_of_2(n_cols)
    rows = max(1, min(t["rows"], 2**20 // block))  # a tile must stay under Triton's 2**20 elements
    return {"ROWS": rows, "BLOCK": block, "num_warps": max(1, min(16, t["warps_per_4k"] * block // 4096))}


def default_config(kernel: str, arch: str | None) -> dict:
    t = table(arch)
    if kernel == "swiglu":  # a tile must stay under Triton's 2**20 elements
        return {"ROWS": min(t["rows"], 2**20 // t["elementwise_block"]), "BLOCK": t["elementwise_block"]}
    if kernel == "rope":
        return {"ROWS": max(t["rows"], 4) if arch == "interpret" else 4}
    return {}
