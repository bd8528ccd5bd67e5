"""Launch configuration for the shared Triton kernels, kept apart from the kernel source.

A *tuning row* is plain data per architecture, owned by the device folder (``cuda/tuning.py``
for NVIDIA, ``rocm_dcu/tuning.py`` for 64-wide wavefronts). The functions here turn a row and a
problem size into launch parameters; plugins override entries through the
``dinfer_rt_launch_config`` hook.
"""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (n >= 1), as ``triton.next_power_of_2``: this module is
    imported by every Triton device plugin's tuning rows when plugins are discovered, and importing
    triton there loaded its compiler into CPU-only processes (whose exit then printed nanobind's
    leak warnings)."""
    return 1 << max(n - 1, 0).bit_length()


# Row keys: rows: rows per program for row-wise kernels (the interpreter runs one Python step per
# program, so it wants big tiles); warps_per_4k: warps per 4096 columns; max_warps; elementwise_block:
# column block; attn_*: flash-attention tiles, warps and heads per program; gemm_*: tiles of the LM-head
# and grouped MoE GEMMs; router_elems: elements per routing tile.
# How much one program covers under the interpreter, which runs one Python step per program:
# more rows / heads per program, same tile shapes otherwise. GPU rows keep 1 row / 1 head.
INTERPRETER_PARALLELISM = {"rows": 2048, "attn_heads": 8, "router_elems": 2**16}

# The base row every GPU-family tuning row starts from (NVIDIA warps of 32 lanes).
GPU_DEFAULTS = {
    "rows": 1,
    "warps_per_4k": 8,
    "max_warps": 16,
    "elementwise_block": 1024,
    "attn_m": 64,
    "attn_n": 64,
    "attn_warps": 4,
    "attn_heads": 1,
    "gemm_m": 16,
    "gemm_n": 64,
    "gemm_k": 32,
    "gemm_warps": 4,
    "router_elems": 512,  # router tile (rows x padded experts): top-k keeps several copies live
    # split-key attention (flash-decoding) when a launch has fewer programs than this (an H200 has
    # 132 multiprocessors; the LLaDA-8B block step at batch 1 launches 32), each split >= 128 keys
    "attn_split_below": 128,
    "attn_split_keys": 128,
    "attn_max_splits": 16,
    "attn_combine_rows": 16,
    # dequant GEMM tiles (linear_wq / linear_gptq): long K tiles stream the weight; measured on an
    # H200, 32 rows x 4096 -> 4096 int8: 16x32x128 / 4 warps 0.036-0.038 ms (fastest of 36 tiles in
    # two runs), the bf16 cuBLAS GEMM 0.026-0.036
    "dequant_n": 32,
    "dequant_k": 128,
}

# What DINFER_AUTOTUNE=1 tries on top of a row's defaults (timed once per shape bucket, cached).
AUTOTUNE_SPACE = {
    "attention": [{"BLOCK_N": n, "num_warps": w} for n in (16, 32, 64) for w in (4, 8)],
}


def row_config(n_cols: int, t: dict) -> dict:
    """A block covering a whole row (norms reduce over it) and warps that grow with it."""
    block = next_power_of_2(n_cols)
    rows = max(1, min(t["rows"], 2**20 // block))  # a tile must stay under Triton's 2**20 elements
    return {"ROWS": rows, "BLOCK": block, "num_warps": max(1, min(t["max_warps"], t["warps_per_4k"] * block // 4096))}


def attention_config(n_queries: int, head_dim: int, t: dict) -> dict:
    """Query/key tiles (at least 16: tl.dot's minimum); the head dim is padded to a power of two."""
    return {
        "BLOCK_M": max(16, min(t["attn_m"], next_power_of_2(n_queries))),
        "BLOCK_N": t["attn_n"],
        "BLOCK_D": max(16, next_power_of_2(head_dim)),
        "HEADS": t["attn_heads"],
        "num_warps": t["attn_warps"],
    }


def default_config(kernel: str, t: dict) -> dict:
    """Size-independent launch parameters of ``kernel`` from tuning row ``t``."""
    if kernel == "swiglu":  # a tile must stay under Triton's 2**20 elements
        return {"ROWS": min(t["rows"], 2**20 // t["elementwise_block"]), "BLOCK": t["elementwise_block"]}
    if kernel == "rope":
        return {"ROWS": max(t["rows"], 4)}
    if kernel == "router":
        return {"ROWS": max(t["rows"], 16) if t["rows"] > 1 else 16}
    if kernel in ("linear_wq", "linear_gptq"):
        # the interpreter runs one Python step per program and K tile: big tiles there (GPU rows keep 1 row)
        if t["rows"] == 1:
            n, k = t.get("dequant_n", t["gemm_n"]), t.get("dequant_k", t["gemm_k"])  # a plugin's row may lack them
            return {"BLOCK_M": t["gemm_m"], "BLOCK_N": n, "BLOCK_K": k, "num_warps": 4}
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": t["gemm_k"], "num_warps": t["gemm_warps"]}
    if kernel in ("lm_head_confidence", "moe"):
        head = {"BLOCK_V": t["gemm_n"]} if kernel == "lm_head_confidence" else {"BLOCK_N": t["gemm_n"]}
        return {"BLOCK_M": t["gemm_m"], "BLOCK_K": t["gemm_k"], "num_warps": t["gemm_warps"], **head}
    return {}
