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
