"""Triton kernel source shared by every Triton backend (cuda, rocm_dcu, ascend through
triton-ascend). Launch configuration lives in ``launch.py`` and the device folders' tuning rows;
kernels that must run differently on a chip take that as a launch parameter, not a copy: the
confidence and commit kernels stride over rows (``for row in range(pid, n, num_programs)``), so
a grid of one program per row (GPUs) and a persistent grid of one program per vector core
(Ascend) run the same source.

Each row-wise program handles ROWS rows as a 2-D tile (one row per program on a GPU is ROWS=1;
the interpreter wants large tiles, since it runs one Python step per program). Numerics follow
the IR ops: statistics and rotations in fp32, outputs in the input dtype. Under
``TRITON_INTERPRET=1`` (``DINFER_INTERPRET=1``) the kernels run on CPU tensors.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's interpreter rounds fp32 -> bf16 wrongly (it truncates by default and its "rtne" mode
# does not carry), so under it _narrow rounds bf16 with integer ops; on a GPU it is one cvt.rn.
_SOFT_BF16 = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _narrow(x, dtype: tl.constexpr):
    """fp32 -> ``dtype``, rounding to nearest even (the GPU's conversion, the reference's too)."""
    if _SOFT_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # round half to even on the 16 dropped bits
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 -> ``dtype`` -> fp32: the rounding a low-precision intermediate gets in the reference.

    All arithmetic here runs on fp32 values: loads are widened first and stores narrow through
    ``_narrow``. That is what the GPU does for 16-bit math anyway, and the only form Triton's
    interpreter gets right for bfloat16 (it computes on bf16's raw uint16 bits otherwise)."""
    return _narrow(x, dtype).to(tl.float32)


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
    tl.store(y_ptr + offs, _narrow(_round(y, w.dtype) * w.to(tl.float32)[None, :], w.dtype), mask=m)


@triton.jit
def add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    offs, m, c, cm = _tile(n_rows, n_cols, ROWS, BLOCK)
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    s = _round(x.to(tl.float32) + tl.load(r_ptr + offs, mask=m, other=0.0).to(tl.float32), x.dtype)
    tl.store(s_ptr + offs, _narrow(s, x.dtype), mask=m)
    y = s * tl.rsqrt(tl.sum(s * s, axis=1) / n_cols + eps)[:, None]
    w = tl.load(w_ptr + c, mask=cm, other=0.0)
    tl.store(y_ptr + offs, _narrow(_round(y, w.dtype) * w.to(tl.float32)[None, :], w.dtype), mask=m)


@triton.jit
def swiglu_kernel(h_ptr, y_ptr, n_rows, inter, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (r < n_rows)[:, None] & (c < inter)[None, :]
    gate = tl.load(h_ptr + r[:, None] * 2 * inter + c[None, :], mask=m, other=0.0)
    up = tl.load(h_ptr + r[:, None] * 2 * inter + inter + c[None, :], mask=m, other=0.0)
    g = gate.to(tl.float32)
    y = _round(g / (1.0 + tl.exp(-g)), gate.dtype) * up.to(tl.float32)
    tl.store(y_ptr + r[:, None] * inter + c[None, :], _narrow(y, gate.dtype), mask=m)


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
    tl.store(y_ptr + base + j[None, :], _narrow(a * cos - b * sin, x1.dtype), mask=m)
    tl.store(y_ptr + base + half + j[None, :], _narrow(b * cos + a * sin, x1.dtype), mask=m)
    if REST > 0:
        k = tl.arange(0, REST)
        km = rm[:, None] & (k < head_dim - 2 * half)[None, :]
        rest = tl.load(x_ptr + base + 2 * half + k[None, :], mask=km, other=0.0)
        tl.store(y_ptr + base + 2 * half + k[None, :], rest, mask=km)


@triton.jit
def _confidence_start(ROWS: tl.constexpr):
    """Running state of the online softmax over the vocabulary: max m, Z = sum exp(z - m),
    S = sum exp(z - m)(z - m) (entropy), the top-2 logits and the argmax."""
    neg = tl.full((ROWS,), float("-inf"), tl.float32)
    zero = tl.zeros((ROWS,), tl.float32)
    return neg, zero, zero, neg, neg, tl.zeros((ROWS,), tl.int64)


@triton.jit
def _confidence_step(z, cols, m, z_sum, s_sum, top1, top2, best, KIND: tl.constexpr):
    """Fold one vocabulary chunk of logits ``z`` [R, C] (excluded entries -inf) at columns
    ``cols`` [C] into the running state (ties go to the lowest column)."""
    neg = float("-inf")
    cmax = tl.max(z, axis=1)
    carg = tl.min(tl.where(z == cmax[:, None], cols[None, :], 2147483647), axis=1).to(tl.int64)
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
    return new_m, z_sum, s_sum, top1, top2, best


@triton.jit
def _confidence_score(m, z_sum, s_sum, top1, top2, KIND: tl.constexpr):
    """KIND 0: max probability, 1: margin (top-1 minus top-2 probability), 2: negative entropy
    (sum p log p = S / Z - log Z, without cancellation)."""
    ref = tl.where(m == float("-inf"), 0.0, m)
    p1 = tl.exp(top1 - ref) / z_sum
    if KIND == 0:
        score = p1
    elif KIND == 1:
        score = p1 - tl.exp(top2 - ref) / z_sum
    else:
        score = s_sum / z_sum - tl.log(z_sum)
    return score


@triton.jit
def _confidence_store(score_ptr, token_ptr, rows, rmask, m, z_sum, s_sum, top1, top2, best, KIND: tl.constexpr):
    tl.store(score_ptr + rows, _confidence_score(m, z_sum, s_sum, top1, top2, KIND), mask=rmask)
    tl.store(token_ptr + rows, best, mask=rmask)


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
    DOT_F32: tl.constexpr,
):
    """Fused LM head + confidence for BLOCK_M rows: logits are built one [BLOCK_M, BLOCK_V] chunk
    at a time (never the [rows x vocab] tensor) and folded into the online confidence state.
    DOT_F32 widens the tiles before the dot (interpreter only; see ``_round``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    m, z_sum, s_sum, top1, top2, best = _confidence_start(BLOCK_M)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        vmask = cols < vocab
        acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < hidden
            h = tl.load(h_ptr + rows[:, None] * hidden + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + cols[None, :] * hidden + ks[:, None], mask=vmask[None, :] & kmask[:, None], other=0.0)
            if DOT_F32:  # the interpreter (see _round); exact: 16-bit products are exact in fp32
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(h, w, input_precision="ieee")  # "ieee": fp32 stays fp32 (no silent TF32); 16-bit ignores it
        z = tl.where(vmask[None, :] & (cols[None, :] != banned), acc, float("-inf"))
        m, z_sum, s_sum, top1, top2, best = _confidence_step(z, cols, m, z_sum, s_sum, top1, top2, best, KIND)
    _confidence_store(score_ptr, token_ptr, rows, rmask, m, z_sum, s_sum, top1, top2, best, KIND)


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
    """Logits -> confidence without a probability tensor (no ``tl.dot``: on Ascend this runs on
    the vector cores). Program p handles row blocks p, p + grid, ... of ROWS rows, each row's
    vocabulary streamed in BLOCK_V sub-blocks through the online confidence state."""
    nprog = tl.num_programs(0)
    for r0 in range(tl.program_id(0) * ROWS, n_rows, nprog * ROWS):
        rows = r0 + tl.arange(0, ROWS)
        rmask = rows < n_rows
        m, z_sum, s_sum, top1, top2, best = _confidence_start(ROWS)
        for v0 in range(0, vocab, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = ((cols < vocab) & (cols != banned))[None, :] & rmask[:, None]
            z = tl.load(logits_ptr + rows[:, None] * vocab + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            state = _confidence_step(tl.where(ok, z, float("-inf")), cols, m, z_sum, s_sum, top1, top2, best, KIND)
            m, z_sum, s_sum, top1, top2, best = state
        _confidence_store(score_ptr, token_ptr, rows, rmask, m, z_sum, s_sum, top1, top2, best, KIND)


@triton.jit
def attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    key_valid_ptr,
    first_block_ptr,
    q_pos_ptr,
    k_pos_ptr,
    n_q,
    n_k,
    heads,
    groups,
    head_dim,
    scale,
    block_size,
    k_stride_b,
    k_stride_s,
    q_pos_stride_b,
    k_pos_stride_b,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    keys_per_split,
    n_rows,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_CAUSAL: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Flash-style attention for one batch row, HEADS query heads and BLOCK_M queries: keys stream
    through in BLOCK_N tiles with an online softmax (fp32 running max, denominator, numerator),
    never a [T, S] score matrix. GQA reads kv head = head // groups. Masks: ``key_valid`` [B, S]
    (padding) and, with BLOCK_CAUSAL, key block <= query block on absolute positions. A query
    that may see no key attends to every key (the reference's rule against NaN): ``first_block``
    [B] is the lowest block holding a valid key (huge when none), so such rows are known up front
    and the sweep stays single. P is rounded to V's dtype before P @ V, as tensor cores take it.
    q/o are contiguous [B, T, H, D]; k/v are [B, S, KV, D] with the given batch/sequence strides,
    so a KV cache is read in place. Query / key positions are [T] / [S] (stride 0) or per row
    [B, T] / [B, S] (continuous batching: each row its own query window).

    HEADS > 1 (the interpreter's setting) stacks HEADS heads along both tile axes and masks the
    cross-head blocks: one program then does HEADS heads' work per Python step. GPU rows use 1.

    SPLIT (split keys, flash-decoding): program axis 2 takes keys [split * keys_per_split, ...)
    only and stores its unnormalised partial state (running max, denominator, numerator in fp32)
    to ``part_*`` [splits, n_rows(, D)] for ``attention_combine_kernel``: a few queries over a long
    cache (batch 1, one block) then fill the device instead of one program per head."""
    neg = float("-inf")
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    head_blocks = tl.cdiv(heads, HEADS)
    b, hb = bh // head_blocks, bh % head_blocks
    r = tl.arange(0, HEADS * BLOCK_M)
    h_q = hb * HEADS + r // BLOCK_M
    rows = pid_m * BLOCK_M + r % BLOCK_M
    d = tl.arange(0, BLOCK_D)
    rmask, dmask = (rows < n_q) & (h_q < heads), d < head_dim
    io = (b * n_q + rows[:, None]) * heads * head_dim + h_q[:, None] * head_dim + d[None, :]
    iomask = rmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + io, mask=iomask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = tl.load(q_pos_ptr + b * q_pos_stride_b + rows, mask=rmask, other=0)
    q_block = q_pos.to(tl.int32) // block_size  # 32-bit: cheap division
    blind = tl.load(first_block_ptr + b) > q_block.to(tl.int64)  # rows that see every key
    c = tl.arange(0, HEADS * BLOCK_N)
    h_k = hb * HEADS + c // BLOCK_N
    same_head = (r // BLOCK_M)[:, None] == (c // BLOCK_N)[None, :]
    kv_col = b * k_stride_b + (h_k // groups) * head_dim
    m_i = tl.full((HEADS * BLOCK_M,), neg, tl.float32)
    l_i = tl.zeros((HEADS * BLOCK_M,), tl.float32)
    acc = tl.zeros((HEADS * BLOCK_M, BLOCK_D), tl.float32)
    if SPLIT:
        k_lo = tl.program_id(2) * keys_per_split
        k_hi = tl.minimum(n_k, k_lo + keys_per_split)
    else:
        k_lo, k_hi = 0, n_k
    for n0 in range(k_lo, k_hi, BLOCK_N):
        cols = n0 + c % BLOCK_N
        cmask = (cols < k_hi) & (h_k < heads)
        kv_off = kv_col[:, None] + cols[:, None] * k_stride_s + d[None, :]
        kv_mask = cmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        allowed = (tl.load(key_valid_ptr + b * n_k + cols, mask=cmask, other=0) != 0)[None, :]
        if BLOCK_CAUSAL:
            k_block = tl.load(k_pos_ptr + b * k_pos_stride_b + cols, mask=cmask, other=0).to(tl.int32) // block_size
            allowed = allowed & (k_block[None, :] <= q_block[:, None])
        s = tl.where((allowed | blind[:, None]) & cmask[None, :] & same_head, s, neg)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        ref = tl.where(m_new == neg, 0.0, m_new)
        alpha = tl.where(m_i == neg, 0.0, tl.exp(m_i - ref))
        p = tl.exp(s - ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = _narrow(p, v.dtype)
        if DOT_F32:
            pv, v = pv.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
        m_i = m_new
    if SPLIT:
        part = tl.program_id(2) * n_rows + (b * n_q + rows) * heads + h_q  # [splits, B, T, H]
        tl.store(part_m_ptr + part, m_i, mask=rmask)
        tl.store(part_l_ptr + part, l_i, mask=rmask)
        tl.store(part_acc_ptr + part[:, None] * head_dim + d[None, :], acc, mask=iomask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + io, _narrow(out, o_ptr.dtype.element_ty), mask=iomask)


@triton.jit
def attention_combine_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    o_ptr,
    n_rows,
    head_dim,
    splits,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merges ``attention_kernel``'s SPLIT partial states: each split's numerator and denominator
    rescaled to the rows' overall max (a split that saw no allowed key has max -inf and weighs 0),
    then numerator / denominator in the output's dtype. Rows are (batch, query, head) of the
    contiguous [B, T, H, D] output."""
    neg = float("-inf")
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    rm = r < n_rows
    mask = rm[:, None] & (d < head_dim)[None, :]
    m = tl.full((ROWS,), neg, tl.float32)
    for i in range(splits):  # a loop, not unrolled: unrolled, the loads in flight spilled
        m = tl.maximum(m, tl.load(part_m_ptr + i * n_rows + r, mask=rm, other=neg))
    ref = tl.where(m == neg, 0.0, m)
    den = tl.zeros((ROWS,), tl.float32)
    num = tl.zeros((ROWS, BLOCK_D), tl.float32)
    for i in range(splits):
        m_i = tl.load(part_m_ptr + i * n_rows + r, mask=rm, other=neg)
        w = tl.where(m_i == neg, 0.0, tl.exp(m_i - ref))
        den += w * tl.load(part_l_ptr + i * n_rows + r, mask=rm, other=0.0)
        a = tl.load(part_acc_ptr + (i * n_rows + r[:, None]) * head_dim + d[None, :], mask=mask, other=0.0)
        num += w[:, None] * a
    out = num / tl.where(den == 0.0, 1.0, den)[:, None]
    tl.store(o_ptr + r[:, None] * head_dim + d[None, :], _narrow(out, o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _take_top(score, cols, K: tl.constexpr, KP: tl.constexpr):
    """The K best entries of each row of ``score`` [R, E] (ties: lowest index), by K rounds of
    max + argmax: returns their column indices [R, KP] (slots >= K hold 0) and the row's
    mask of chosen columns [R, E]."""
    neg = float("-inf")
    slots = tl.arange(0, KP)
    picked = tl.zeros((score.shape[0], KP), tl.int32)
    chosen = score != score  # all False, right shape
    for j in tl.static_range(K):
        best = tl.max(score, axis=1)
        arg = tl.min(tl.where(score == best[:, None], cols[None, :], score.shape[1]), axis=1)
        picked = tl.where(slots[None, :] == j, arg[:, None], picked)
        hit = cols[None, :] == arg[:, None]
        chosen = chosen | hit
        score = tl.where(hit, neg, score)
    return picked, chosen


@triton.jit
def router_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    idx_ptr,
    n_rows,
    n_experts,
    scale,
    SIGMOID: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    GROUPS: tl.constexpr,
    GP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """MoE routing for ROWS tokens from fp32 router logits [N, E]. Softmax: top-k of the softmax
    (LLaDA-MoE). SIGMOID (LLaDA2): sigmoid scores, selection on score + bias restricted to the
    TOPK_GROUP groups with the best top-2 sums, weights = the unbiased scores; then optional
    renormalisation and ``scale``. Writes weights [N, K] fp32 and expert ids [N, K] int64."""
    neg = float("-inf")
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, BLOCK_E)
    rm, em = r < n_rows, e < n_experts
    z = tl.load(logits_ptr + r[:, None] * n_experts + e[None, :], mask=rm[:, None] & em[None, :], other=neg)
    if SIGMOID:
        s = tl.where(em[None, :], 1.0 / (1.0 + tl.exp(-z)), 0.0)
        sel = tl.where(em[None, :], s + tl.load(bias_ptr + e, mask=em, other=0.0)[None, :], neg)
        if GROUPS > 1:
            per = n_experts // GROUPS
            grp = e // per
            gids = tl.arange(0, GP)  # GROUPS padded to a power of two
            gscore = tl.full((ROWS, GP), neg, tl.float32)
            for g in tl.static_range(GROUPS):  # sum of the top-2 biased scores of group g
                in_g = (grp == g)[None, :] & em[None, :]
                v = tl.where(in_g, sel, neg)
                top = tl.max(v, axis=1)
                first = tl.min(tl.where(v == top[:, None], e[None, :], BLOCK_E), axis=1)
                second = tl.max(tl.where(e[None, :] == first[:, None], neg, v), axis=1)
                total = top + tl.where(per > 1, second, 0.0)
                gscore = tl.where(gids[None, :] == g, total[:, None], gscore)
            _, keep = _take_top(gscore, gids, TOPK_GROUP, GP)
            kept = tl.zeros((ROWS, BLOCK_E), tl.int32) > 0
            for g in tl.static_range(GROUPS):
                on = tl.sum(tl.where(gids[None, :] == g, keep.to(tl.int32), 0), axis=1) > 0
                kept = kept | (on[:, None] & (grp == g)[None, :])
            sel = tl.where(kept, sel, neg)
        idx, chosen = _take_top(sel, e, K, KP)
        weights = s
    else:
        m = tl.max(z, axis=1)
        p = tl.exp(z - m[:, None])
        weights = p / tl.sum(p, axis=1)[:, None]
        idx, chosen = _take_top(tl.where(em[None, :], weights, neg), e, K, KP)
    slots = tl.arange(0, KP)
    w = tl.zeros((ROWS, KP), tl.float32)
    for j in tl.static_range(K):  # gather weights[row, idx[row, j]]
        idx_j = tl.sum(tl.where(slots[None, :] == j, idx, 0), axis=1)
        pick = tl.sum(tl.where(e[None, :] == idx_j[:, None], weights, 0.0), axis=1)
        w = tl.where(slots[None, :] == j, pick[:, None], w)
    if RENORMALIZE:
        w = w / tl.sum(w, axis=1)[:, None]
    if SIGMOID:
        w = w * scale
    out = r[:, None] * K + slots[None, :]
    om = rm[:, None] & (slots < K)[None, :]
    tl.store(w_ptr + out, w, mask=om)
    tl.store(idx_ptr + out, idx.to(tl.int64), mask=om)


@triton.jit
def moe_gate_up_kernel(
    x_ptr,
    wgu_ptr,
    h_ptr,
    tok_ptr,
    tile_expert_ptr,
    hidden,
    inter,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Grouped gate/up GEMM with the SwiGLU epilogue. Rows are expert-sorted token slots padded so
    that every BLOCK_M tile belongs to one expert (``tile_expert``, -1: empty tile); ``tok`` maps
    a row to its token (-1: padding). h[row] = silu(x W_gate^T) * (x W_up^T) with the reference's
    dtype roundings, for columns pid(1) * BLOCK_N ..."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:  # padding, or slots another rank's experts compute (expert parallelism)
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = tl.load(tok_ptr + rows)
    rmask = tok >= 0  # rows of an empty tile (expert -1) are all padding
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < inter
    w_base = wgu_ptr + tl.maximum(expert, 0).to(tl.int64) * 2 * inter * hidden
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        km = ks < hidden
        x = tl.load(
            x_ptr + tok[:, None].to(tl.int64) * hidden + ks[None, :], mask=rmask[:, None] & km[None, :], other=0.0
        )
        wmask = km[:, None] & cmask[None, :]
        wg = tl.load(w_base + cols[None, :] * hidden + ks[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (inter + cols[None, :]) * hidden + ks[:, None], mask=wmask, other=0.0)
        if DOT_F32:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g += tl.dot(x, wg, input_precision="ieee")
        acc_u += tl.dot(x, wu, input_precision="ieee")
    dtype = h_ptr.dtype.element_ty
    g, u = _round(acc_g, dtype), _round(acc_u, dtype)
    h = _round(g / (1.0 + tl.exp(-g)), dtype) * u
    tl.store(h_ptr + rows[:, None] * inter + cols[None, :], _narrow(h, dtype), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def moe_down_kernel(
    h_ptr,
    wd_ptr,
    y_ptr,
    tok_ptr,
    row_weight_ptr,
    tile_expert_ptr,
    inter,
    hidden,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Grouped down GEMM: y[row] = round(h[row] W_down[e]^T) * routing weight, in fp32 (the
    reference accumulates experts in fp32; the finalize step sums each token's rows)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = tl.load(tok_ptr + rows) >= 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    w_base = wd_ptr + tl.maximum(expert, 0).to(tl.int64) * hidden * inter
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        km = ks < inter
        h = tl.load(h_ptr + rows[:, None] * inter + ks[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * inter + ks[:, None], mask=km[:, None] & cmask[None, :], other=0.0)
        if DOT_F32:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(h, w, input_precision="ieee")
    wt = tl.load(row_weight_ptr + rows, mask=rmask, other=0.0)
    y = _round(acc, h_ptr.dtype.element_ty) * wt[:, None]
    tl.store(y_ptr + rows[:, None] * hidden + cols[None, :], y, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _dequant_dot(acc, x, w, dtype: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + x @ round(w): the dequantised fp32 tile ``w`` rounded to the activations' dtype, as
    the reference dequantises the whole weight. ``DOT_F32`` (fp32 activations, the interpreter):
    an IEEE fp32 dot; else both tiles stay 16-bit for the tensor cores: products of 16-bit
    values are exact in fp32, so only the summation order differs from the fp32 dot."""
    if DOT_F32:
        return acc + tl.dot(x.to(tl.float32), _round(w, dtype), input_precision="ieee")
    return tl.dot(x, _narrow(w, dtype), acc)


@triton.jit
def linear_wq_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Weight-only dequant GEMM: y = x (q * s)^T (+ b) for x [M, K], q [N, K] int8 (or fp8 e4m3
    bytes, ``FP8``: passed as uint8 and bitcast, which the interpreter also takes), per-row
    scale s [N]. Each weight tile is dequantised in registers and rounded to x's dtype, as the
    reference dequantises the whole weight (``_dequant_dot``); fp32 accumulation, output in x's
    dtype."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm, cm = rows < M, cols < N
    dtype = y_ptr.dtype.element_ty
    scale = _round(tl.load(s_ptr + cols, mask=cm, other=0.0).to(tl.float32), dtype)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        km = ks < K
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        q = tl.load(q_ptr + cols[None, :] * K + ks[:, None], mask=km[:, None] & cm[None, :], other=0)
        if FP8:
            q = q.to(tl.float8e4nv, bitcast=True)
        w = q.to(tl.float32) * scale[None, :]
        acc = _dequant_dot(acc, x, w, dtype, DOT_F32)
    if HAS_BIAS:
        acc = _round(acc, dtype) + tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], _narrow(acc, dtype), mask=rm[:, None] & cm[None, :])


@triton.jit
def linear_gptq_kernel(
    x_ptr,
    qw_ptr,
    qz_ptr,
    s_ptr,
    g_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    zero_offset,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """GPTQ 4-bit dequant GEMM: y = x W^T with W[n, k] = (q[k, n] - (z[g[k], n] + zero_offset)) *
    s[g[k], n]; q packed eight per int32 along K (``qweight`` [K/8, N]), z along N (``qzeros``
    [G, N/8]), g = ``g_idx`` [K] (act-order permutes it). Tiles are dequantised in registers and
    rounded to x's dtype, as the reference dequantises the whole weight; fp32 accumulation."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm, cm = rows < M, cols < N
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        km = ks < K
        wm = km[:, None] & cm[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        word = tl.load(qw_ptr + (ks // 8)[:, None] * N + cols[None, :], mask=wm, other=0)
        q = (word >> ((ks % 8) * 4)[:, None]) & 0xF
        grp = tl.load(g_ptr + ks, mask=km, other=0)
        zword = tl.load(qz_ptr + grp[:, None] * (N // 8) + (cols // 8)[None, :], mask=wm, other=0)
        z = ((zword >> ((cols % 8) * 4)[None, :]) & 0xF) + zero_offset
        sc = _round(tl.load(s_ptr + grp[:, None] * N + cols[None, :], mask=wm, other=0.0).to(tl.float32), dtype)
        w = (q - z).to(tl.float32) * sc
        acc = _dequant_dot(acc, x, w, dtype, DOT_F32)
    if HAS_BIAS:
        acc = _round(acc, dtype) + tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], _narrow(acc, dtype), mask=rm[:, None] & cm[None, :])


@triton.jit
def _commit_row(row, conf, masked, quota, x0, x, out, n_slots, x_stride, threshold, TOP_K, BLOCK_L):
    """One row's commit decisions (see ``commit_kernel``)."""
    conf, masked, x0, out = conf + row * n_slots, masked + row * n_slots, x0 + row * n_slots, out + row * n_slots
    quota, x = quota + row, x + row * x_stride
    j = tl.arange(0, BLOCK_L)
    inb = j < n_slots
    is_masked = (tl.load(masked + j, mask=inb, other=0) != 0) & inb
    c = tl.where(is_masked, tl.load(conf + j, mask=inb, other=0.0), float("-inf"))
    ahead = (c[None, :] > c[:, None]) | ((c[None, :] == c[:, None]) & (j[None, :] < j[:, None]))
    rank = tl.sum((ahead & is_masked[None, :]).to(tl.int32), axis=1)
    if TOP_K:
        k = tl.minimum(tl.maximum(tl.load(quota).to(tl.int32), 1), tl.sum(is_masked.to(tl.int32), 0))
        commit = is_masked & (rank < k)
    else:
        commit = is_masked & ((c >= threshold) | (rank == 0))
    tl.store(x + j, tl.where(commit, tl.load(x0 + j, mask=inb, other=0), tl.load(x + j, mask=inb, other=0)), mask=inb)
    tl.store(out + j, commit.to(tl.int8), mask=inb)


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
    PERSISTENT: tl.constexpr,
):
    """Commit decisions for the rows of a block, on the device. PERSISTENT (Ascend's vector
    cores): program p takes rows p, p + grid, ...; otherwise (GPUs) one program per row.
    TOP_K commits the quota best masked slots (rank = slots with a higher score, ties to the
    lower index; the low_confidence rule); otherwise masked slots with confidence >= threshold
    plus the best masked slot (the threshold rule's at-least-one). Committed slots take their
    candidate token in ``x`` in place. The [BLOCK_L, BLOCK_L] rank tile is small for the block
    lengths diffusion decoding uses (<= 256)."""
    ptrs = (conf_ptr, masked_ptr, quota_ptr, x0_ptr, x_ptr, commit_ptr)
    if PERSISTENT:
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            _commit_row(row, *ptrs, n_slots, x_stride, threshold, TOP_K, BLOCK_L)
    else:  # GPUs: one row per program, no loop (a runtime-bounded one spills SGPRs on HIP)
        _commit_row(tl.program_id(0), *ptrs, n_slots, x_stride, threshold, TOP_K, BLOCK_L)


@triton.jit
def _commit_edit_row(
    row, conf, token, masked, editable, x, commit, edit, n_slots, x_stride, threshold, edit_threshold, BLOCK_L
):
    """One row's joint_threshold decisions (see ``commit_edit_kernel``)."""
    conf, token, masked, editable = (
        conf + row * n_slots,
        token + row * n_slots,
        masked + row * n_slots,
        editable + row * n_slots,
    )
    commit, edit, x = commit + row * n_slots, edit + row * n_slots, x + row * x_stride
    j = tl.arange(0, BLOCK_L)
    inb = j < n_slots
    is_masked = (tl.load(masked + j, mask=inb, other=0) != 0) & inb
    can_edit = (tl.load(editable + j, mask=inb, other=0) != 0) & inb & ~is_masked
    p = tl.load(conf + j, mask=inb, other=0.0)
    t = tl.load(token + j, mask=inb, other=0)
    cur = tl.load(x + j, mask=inb, other=0)
    c = tl.where(is_masked, p, float("-inf"))
    ahead = (c[None, :] > c[:, None]) | ((c[None, :] == c[:, None]) & (j[None, :] < j[:, None]))
    rank = tl.sum((ahead & is_masked[None, :]).to(tl.int32), axis=1)
    m2t = is_masked & ((p > threshold) | (rank == 0))
    t2t = can_edit & (t != cur) & (p > edit_threshold)
    tl.store(x + j, tl.where(m2t | t2t, t, cur), mask=inb)
    tl.store(commit + j, m2t.to(tl.int8), mask=inb)
    tl.store(edit + j, t2t.to(tl.int8), mask=inb)


@triton.jit
def commit_edit_kernel(
    conf_ptr,
    token_ptr,
    masked_ptr,
    editable_ptr,
    x_ptr,
    commit_ptr,
    edit_ptr,
    n_rows,
    n_slots,
    x_stride,
    threshold,
    edit_threshold,
    BLOCK_L: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    """One step of the editing rule joint_threshold (greedy, no penalty) for the rows of a block,
    on the device: mask-to-token commits at masked slots whose probability is > ``threshold``,
    plus the row's best masked slot (rank 0: ties to the lower index) when none passes, and
    token-to-token edits at ``editable`` slots whose argmax differs from the current token with
    probability > ``edit_threshold``. Both write the argmax into ``x`` in place. PERSISTENT
    (Ascend's vector cores): program p takes rows p, p + grid, ...; else one program per row."""
    ptrs = (conf_ptr, token_ptr, masked_ptr, editable_ptr, x_ptr, commit_ptr, edit_ptr)
    if PERSISTENT:
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            _commit_edit_row(row, *ptrs, n_slots, x_stride, threshold, edit_threshold, BLOCK_L)
    else:
        _commit_edit_row(tl.program_id(0), *ptrs, n_slots, x_stride, threshold, edit_threshold, BLOCK_L)
