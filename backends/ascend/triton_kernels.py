"""triton-ascend kernel for the op torch_npu has no fused operator for: logits -> confidence
(score and argmax over the vocabulary without a probability tensor). Written to the Ascend
porting rules (hardware.md §3): a persistent grid equal to the physical vector-core count (no
``tl.dot``, so vector cores), each program striding over rows; the vocabulary streamed in
sub-blocks sized to fit the unified buffer; block sizes that keep vector accesses 32-byte
aligned; the launch dimension under 65535. ``launch_config`` holds those rules as checkable
data. Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (how it is tested here)."""

from __future__ import annotations

import triton
import triton.language as tl

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


@triton.jit
def confidence_kernel(
    logits_ptr,
    score_ptr,
    token_ptr,
    n_rows,
    vocab,
    banned,
    KIND: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Program p handles row blocks p, p + grid, ... of ROWS rows; each row's vocabulary streams
    in BLOCK_V sub-blocks with an online softmax (running max m, Z = sum exp(z - m),
    S = sum exp(z - m)(z - m) for entropy, top-2 logits and argmax).
    KIND: 0 max probability, 1 margin, 2 negative entropy."""
    neg = float("-inf")
    nprog = tl.num_programs(0)
    for r0 in range(tl.program_id(0) * ROWS, n_rows, nprog * ROWS):
        rows = r0 + tl.arange(0, ROWS)
        rmask = rows < n_rows
        m = tl.full((ROWS,), neg, tl.float32)
        z_sum = tl.zeros((ROWS,), tl.float32)
        s_sum = tl.zeros((ROWS,), tl.float32)
        top1 = tl.full((ROWS,), neg, tl.float32)
        top2 = tl.full((ROWS,), neg, tl.float32)
        best = tl.zeros((ROWS,), tl.int32)
        for v0 in range(0, vocab, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = ((cols < vocab) & (cols != banned))[None, :] & rmask[:, None]
            z = tl.load(logits_ptr + rows[:, None] * vocab + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            z = tl.where(ok, z, neg)
            cmax = tl.max(z, axis=1)
            carg = tl.min(tl.where(z == cmax[:, None], cols[None, :], vocab + BLOCK_V), axis=1)
            csecond = tl.max(tl.where(cols[None, :] == carg[:, None], neg, z), axis=1)
            new_m = tl.maximum(m, cmax)
            ref = tl.where(new_m == neg, 0.0, new_m)
            rescale = tl.where(m == neg, 0.0, tl.exp(m - ref))
            e = tl.where(ok, tl.exp(z - ref[:, None]), 0.0)
            if KIND == 2:
                shift = tl.where(m == neg, 0.0, m - ref)
                s_sum = rescale * (s_sum + shift * z_sum) + tl.sum(tl.where(ok, e * (z - ref[:, None]), 0.0), axis=1)
            z_sum = z_sum * rescale + tl.sum(e, axis=1)
            top2 = tl.maximum(tl.minimum(top1, cmax), tl.maximum(top2, csecond))
            best = tl.where(cmax > top1, carg, best)
            top1 = tl.maximum(top1, cmax)
            m = new_m
        ref = tl.where(m == neg, 0.0, m)
        p1 = tl.exp(top1 - ref) / z_sum
        if KIND == 0:
            score = p1
        elif KIND == 1:
            score = p1 - tl.exp(top2 - ref) / z_sum
        else:
            score = s_sum / z_sum - tl.log(z_sum)
        tl.store(score_ptr + rows, score, mask=rmask)
        tl.store(token_ptr + rows, best.to(tl.int64), mask=rmask)


@triton.jit
def commit_kernel(
    conf_ptr,
    masked_ptr,
    quota_ptr,
    x0_ptr,
    x_ptr,
    commit_ptr,
    n_rows,
    n_slots,
    x_stride,
    threshold,
    TOP_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Commit decisions on the NPU, persistent over rows (grid = vector cores): TOP_K commits the
    quota best masked slots (ties to the lower index), else slots >= threshold plus the best
    masked one; committed slots take their candidate in ``x`` in place. The [BLOCK_L, BLOCK_L]
    rank tile stays far below the UB for block lengths up to 256."""
    neg = float("-inf")
    j = tl.arange(0, BLOCK_L)
    inb = j < n_slots
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        masked = (tl.load(masked_ptr + row * n_slots + j, mask=inb, other=0) != 0) & inb
        conf = tl.where(masked, tl.load(conf_ptr + row * n_slots + j, mask=inb, other=0.0), neg)
        ahead = (conf[None, :] > conf[:, None]) | ((conf[None, :] == conf[:, None]) & (j[None, :] < j[:, None]))
        rank = tl.sum((ahead & masked[None, :]).to(tl.int32), axis=1)
        if TOP_K:
            quota = tl.minimum(tl.maximum(tl.load(quota_ptr + row).to(tl.int32), 1), tl.sum(masked.to(tl.int32), 0))
            commit = masked & (rank < quota)
        else:
            commit = masked & ((conf >= threshold) | (rank == 0))
        old = tl.load(x_ptr + row * x_stride + j, mask=inb, other=0)
        x0 = tl.load(x0_ptr + row * n_slots + j, mask=inb, other=0)
        tl.store(x_ptr + row * x_stride + j, tl.where(commit, x0, old), mask=inb)
        tl.store(commit_ptr + row * n_slots + j, commit.to(tl.int8), mask=inb)


def commit(conf, masked, quota, x0, x_block, *, rule: str, vector_cores: int, threshold: float = 0.9):
    """Host wrapper of ``commit_kernel`` (rules "top_k" / "threshold"); returns the commit mask."""
    import torch

    if rule not in ("top_k", "threshold"):
        raise ValueError(f"ascend commit: unknown rule {rule!r} (top_k, threshold)")
    b, n = conf.shape
    out = torch.empty((b, n), dtype=torch.int8, device=conf.device)
    grid = (min(vector_cores, MAX_CORE_DIM),)
    block = max(ALIGN_BYTES, triton.next_power_of_2(n))  # int8 mask tile: 32-byte aligned
    commit_kernel[grid](
        conf.float().contiguous(),
        masked.contiguous(),
        quota.contiguous(),
        x0.contiguous(),
        x_block,
        out,
        b,
        n,
        x_block.stride(0),
        float(threshold),
        TOP_K=rule == "top_k",
        BLOCK_L=block,
    )
    return out.bool()
