"""Triton kernel source for the ``cuda`` backend (launch configuration lives in ``launch.py``).

Each program handles ROWS rows as a 2-D tile (one row per program on a GPU is ROWS=1; the
interpreter wants large tiles, since it runs one Python step per program). Numerics follow
the IR ops: statistics and rotations in fp32, outputs in the input dtype. Under
``TRITON_INTERPRET=1`` (``DINFER_INTERPRET=1``) the kernels run on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    cm = c < n_cols
    return r[:, None] * n_cols + c[None, :], (r < n_rows)[:, None] & cm[None, :], c, cm


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    offs, m, c, cm = _tile(n_rows, n_cols, ROWS, BLOCK)
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)[:, None]
    w = tl.load(w_ptr + c, mask=cm, other=0.0)
    tl.store(y_ptr + offs, y.to(w.dtype) * w[None, :], mask=m)


@triton.jit
def add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    offs, m, c, cm = _tile(n_rows, n_cols, ROWS, BLOCK)
    s = tl.load(x_ptr + offs, mask=m, other=0.0) + tl.load(r_ptr + offs, mask=m, other=0.0)
    tl.store(s_ptr + offs, s, mask=m)
    f = s.to(tl.float32)
    y = f * tl.rsqrt(tl.sum(f * f, axis=1) / n_cols + eps)[:, None]
    w = tl.load(w_ptr + c, mask=cm, other=0.0)
    tl.store(y_ptr + offs, y.to(w.dtype) * w[None, :], mask=m)


@triton.jit
def swiglu_kernel(h_ptr, y_ptr, n_rows, inter, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (r < n_rows)[:, None] & (c < inter)[None, :]
    gate = tl.load(h_ptr + r[:, None] * 2 * inter + c[None, :], mask=m, other=0.0)
    up = tl.load(h_ptr + r[:, None] * 2 * inter + inter + c[None, :], mask=m, other=0.0)
    g = gate.to(tl.float32)
    tl.store(y_ptr + r[:, None] * inter + c[None, :], (g / (1.0 + tl.exp(-g))).to(gate.dtype) * up, mask=m)


@triton.jit
def rope_kernel(
    x_ptr,
    pos_ptr,
    inv_ptr,
    y_ptr,
    n_rows,
    heads,
    head_dim,
    half,
    ROWS: tl.constexpr,
    HALF: tl.constexpr,
    REST: tl.constexpr,
):
    """Rows are (token, head) pairs: rotate the leading 2 * half dims (pairs j, j + half) by fp32
    angles pos * inv_freq and copy the remaining head_dim - 2 * half dims."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = r < n_rows
    j = tl.arange(0, HALF)
    m = rm[:, None] & (j < half)[None, :]
    pos = tl.load(pos_ptr + r // heads, mask=rm, other=0).to(tl.float32)
    ang = pos[:, None] * tl.load(inv_ptr + j, mask=j < half, other=0.0)[None, :]
    cos, sin = tl.cos(ang), tl.sin(ang)
    base = r[:, None] * head_dim
    x1 = tl.load(x_ptr + base + j[None, :], mask=m, other=0.0)
    x2 = tl.load(x_ptr + base + half + j[None, :], mask=m, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(y_ptr + base + j[None, :], (a * cos - b * sin).to(x1.dtype), mask=m)
    tl.store(y_ptr + base + half + j[None, :], (b * cos + a * sin).to(x1.dtype), mask=m)
    if REST > 0:
        k = tl.arange(0, REST)
        km = rm[:, None] & (k < head_dim - 2 * half)[None, :]
        rest = tl.load(x_ptr + base + 2 * half + k[None, :], mask=km, other=0.0)
        tl.store(y_ptr + base + 2 * half + k[None, :], rest, mask=km)


@triton.jit
def lm_head_confidence_kernel(
    h_ptr,
    w_ptr,
    score_ptr,
    token_ptr,
    n_rows,
    hidden,
    vocab,
    banned,
    KIND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fused LM head + confidence for BLOCK_M rows: logits are built one [BLOCK_M, BLOCK_V] chunk
    at a time (never the [rows x vocab] tensor) with an online softmax carrying the running max m,
    Z = sum exp(z - m), the top-2 logits with the argmax and, for entropy, S = sum exp(z - m)(z - m).
    KIND: 0 = max probability, 1 = margin (top-1 minus top-2 probability), 2 = negative entropy."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    neg = float("-inf")
    m = tl.full((BLOCK_M,), neg, tl.float32)
    top1 = tl.full((BLOCK_M,), neg, tl.float32)
    top2 = tl.full((BLOCK_M,), neg, tl.float32)
    z_sum = tl.zeros((BLOCK_M,), tl.float32)
    s_sum = tl.zeros((BLOCK_M,), tl.float32)
    best = tl.zeros((BLOCK_M,), tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        vmask = cols < vocab
        acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < hidden
            h = tl.load(h_ptr + rows[:, None] * hidden + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + cols[None, :] * hidden + ks[:, None], mask=vmask[None, :] & kmask[:, None], other=0.0)
            acc += tl.dot(h, w, input_precision=PRECISION)  # "ieee" for fp32: no silent TF32
        z = tl.where(vmask[None, :] & (cols[None, :] != banned), acc, neg)
        cmax = tl.max(z, axis=1)
        carg = tl.argmax(z, axis=1).to(tl.int64) + v0
        csecond = tl.max(tl.where(cols[None, :] == carg[:, None], neg, z), axis=1)
        new_m = tl.maximum(m, cmax)
        ref = tl.where(new_m == neg, 0.0, new_m)
        rescale = tl.where(m == neg, 0.0, tl.exp(m - ref))
        e = tl.exp(z - ref[:, None])
        if KIND == 2:
            shift = tl.where(m == neg, 0.0, m - ref)
            d = tl.where(z == neg, 0.0, z - ref[:, None])
            s_sum = rescale * (s_sum + shift * z_sum) + tl.sum(e * d, axis=1)
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
    tl.store(token_ptr + rows, best, mask=rmask)
