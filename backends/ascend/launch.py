"""Launch rules for the shared Triton kernels on Ascend (triton-ascend), as checkable data.

The op torch_npu has no fused operator for, logits -> confidence, runs the shared
``confidence_kernel`` (and the commit decisions the shared ``commit_kernel``) under the Ascend
porting rules (docs/backends/ascend.md): a persistent grid equal to the physical vector-core
count (no ``tl.dot``, so vector cores), each program striding over rows; the vocabulary
streamed in sub-blocks sized to fit the unified buffer; block sizes that keep vector accesses
32-byte aligned; the launch dimension under 65535. Under ``TRITON_INTERPRET=1`` the kernels run
on CPU tensors (how they are tested here)."""

from __future__ import annotations

import triton

UB_BYTES = 192 * 1024  # unified buffer per core ("1572864 bits available")
MAX_CORE_DIM = 65535
ALIGN_BYTES = 32
# fp32 tiles of one vocabulary sub-block alive at once (logits, exp, masks, shifted copy), plus
# the input tile; half the UB is left for double buffering.
LIVE_FP32_TILES = 4


def launch_config(vocab: int, elem_bytes: int, vector_cores: int, n_rows: int = 1) -> dict:
    """grid = the vector-core count (capped at coreDim 65535). BLOCK_V = the largest power of two
    whose working set fits half the UB (the other half double-buffers), no larger than the
    vocabulary needs, its input tile a multiple of 32 bytes; ROWS = rows per step, as many as
    the rows per core need while the [ROWS, BLOCK_V] tile still fits."""
    budget = UB_BYTES // 2
    block = triton.next_power_of_2(max(vocab, 1))
    while block > 1 and working_set_bytes(block, elem_bytes) > budget:
        block //= 2
    block = max(block, ALIGN_BYTES // elem_bytes)  # a sub-block never smaller than one aligned access
    grid = min(vector_cores, MAX_CORE_DIM)
    rows = triton.next_power_of_2(max(1, -(-n_rows // grid)))
    while rows > 1 and working_set_bytes(block, elem_bytes, rows) > budget:
        rows //= 2
    return {"grid": grid, "BLOCK_V": block, "ROWS": rows}


def working_set_bytes(block_v: int, elem_bytes: int, rows: int = 1) -> int:
    return rows * block_v * (elem_bytes + 4 * LIVE_FP32_TILES)


def commit_launch(vector_cores: int) -> dict:
    """The shared commit kernel on Ascend: persistent over rows, int8 tiles 32-byte aligned."""
    return {"programs": min(vector_cores, MAX_CORE_DIM), "min_block": ALIGN_BYTES}
