"""CPU kernels that differ from the IR's reference semantics in how, not what, they compute.

- the fused LM head + confidence, whose point is memory: it never builds the [positions x
  vocab] probabilities (reference: ``ir.ops.lm_head_confidence``, softmax over full logits);
- RMSNorm through torch's fused kernel, and attention / rope-attention that compute the rotary
  angles and the mask once per forward instead of once per layer (the reference's cost on small
  models: about a fifth of a forward of the embedded model). Same formulas, so the same values;
  the conformance suite checks each against the reference in float64;
- with ``native.c`` built (``native.py``): float32 RMSNorm, add + RMSNorm and attention (QK-norm,
  rotary, K/V cache write, at batch-1 sizes the whole op) in one native call each, where torch
  needs 7 to 15 small ops; other dtypes and layouts take the torch kernels here;
- the weight-only quantised linear with its per-channel scale applied to the output instead of
  the weight: one pass over [out, in] fewer (torch's ``_weight_int8pack_mm`` was measured 12x
  slower than this on the AVX2 CPU here, docs/quantization.md);
- float32 linears of 8-128 rows and at least 2M multiply-adds (the LM head, layers left
  unfused) through native.c's transposed-input GEMM, which reads the weight where it lies and
  beat torch's MKL sgemm 1.4-2.8x at decoding-step sizes here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dinfer_rt.backends.cpu.native import NativeKernels
from dinfer_rt.ir.ops import OpTypeError, attention_mask, splice_kv
from dinfer_rt.ir.ops import swiglu as swiglu_reference

Linear = Callable[..., torch.Tensor]


def lm_head_confidence_chunked(
    h: torch.Tensor,
    weight: torch.Tensor,
    *,
    banned: int,
    kind: str = "max",
    chunk: int = 8192,
    linear: Linear = F.linear,
):
    """Online-softmax kernel for ``lm_head_confidence``: one vocabulary chunk of logits at a time,
    tracking the running max m, Z = sum exp(z - m), the top-2 logits with the argmax, and
    (for entropy) S = sum exp(z - m) * (z - m), since sum p log p = S / Z - log Z. ``linear``
    computes each chunk's logits (the native one on the CPU backend)."""
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    if weight.shape[0] <= chunk:  # one chunk: the full softmax is as small as the running state
        return _confidence_one_chunk(linear(h, weight).to(acc), banned, kind)
    shape = h.shape[:-1]
    neg = torch.full(shape, float("-inf"), dtype=acc, device=h.device)
    m, top1, top2 = neg.clone(), neg.clone(), neg.clone()
    z_sum = torch.zeros(shape, dtype=acc, device=h.device)
    s_sum = torch.zeros(shape, dtype=acc, device=h.device)
    best = torch.zeros(shape, dtype=torch.int64, device=h.device)

    def finite(t):
        return torch.where(torch.isfinite(t), t, torch.zeros_like(t))

    for lo in range(0, weight.shape[0], chunk):
        z = linear(h, weight[lo : lo + chunk]).to(acc)
        if lo <= banned < lo + z.shape[-1]:
            z[..., banned - lo] = float("-inf")
        c2 = z.topk(min(2, z.shape[-1]), dim=-1)
        cmax, carg = c2.values[..., 0], c2.indices[..., 0]
        csecond = c2.values[..., 1] if z.shape[-1] > 1 else torch.full_like(cmax, float("-inf"))
        new_m = torch.maximum(m, cmax)
        ref = finite(new_m)
        rescale = torch.where(torch.isfinite(m), torch.exp(m - ref), torch.zeros_like(ref))
        e = torch.exp(z - ref[..., None])
        if kind == "entropy":  # S = sum exp(z - ref) * (z - ref), carried across a change of ref
            shift = torch.where(torch.isfinite(m), m - ref, torch.zeros_like(ref))
            s_sum = rescale * (s_sum + shift * z_sum) + (e * finite(z - ref[..., None])).sum(-1)
        z_sum = z_sum * rescale + e.sum(-1)
        top2 = torch.maximum(torch.minimum(top1, cmax), torch.maximum(top2, csecond))
        best = torch.where(cmax > top1, carg + lo, best)
        top1 = torch.maximum(top1, cmax)
        m = new_m
    ref = finite(m)
    p1 = torch.exp(top1 - ref) / z_sum
    if kind == "max":
        return p1, best
    if kind == "margin":
        return p1 - torch.exp(top2 - ref) / z_sum, best
    if kind == "entropy":  # sum p log p = sum p (z - ref - log Z) = S / Z - log Z, no cancellation
        return s_sum / z_sum - torch.log(z_sum), best
    raise OpTypeError(f"lm_head_confidence: unknown kind {kind!r} (max, margin, entropy)")


LOGITS_BUDGET = 1 << 20
"""Logit elements (4 MB in float32) the CPU head may hold at once: its chunk widens to
``LOGITS_BUDGET // rows`` columns, so a decoding step's head with a mid-size vocabulary (134M
checkpoint: 32 rows x 32000) is one chunk, a handful of ops instead of ~12 per chunk, and a big
one (LLaDA-8B: 32 rows x 126464) still never builds its [positions x vocab] logits."""


def lm_head_confidence_budgeted(
    h: torch.Tensor,
    weight: torch.Tensor,
    *,
    banned: int,
    kind: str = "max",
    chunk: int = 8192,
    linear: Linear = F.linear,
):
    """``lm_head_confidence_chunked`` with the chunk widened to the logits budget."""
    rows = max(1, h.numel() // max(1, h.shape[-1]))
    wide = max(chunk, LOGITS_BUDGET // rows)
    return lm_head_confidence_chunked(h, weight, banned=banned, kind=kind, chunk=wide, linear=linear)


def _confidence_one_chunk(z: torch.Tensor, banned: int, kind: str):
    """The statistics of one vocabulary chunk directly (a handful of kernels, not the running
    online-softmax state): what small-vocabulary models pay per step."""
    if 0 <= banned < z.shape[-1]:
        z[..., banned] = float("-inf")
    if kind == "max":
        p1, best = z.softmax(-1).max(-1)
        return p1, best
    if kind == "margin":
        top = z.softmax(-1).topk(min(2, z.shape[-1]), dim=-1)
        second = top.values[..., 1] if z.shape[-1] > 1 else torch.zeros_like(top.values[..., 0])
        return top.values[..., 0] - second, top.indices[..., 0]
    if kind == "entropy":
        logp = z.log_softmax(-1)
        neg_entropy = (logp.exp() * logp).nan_to_num(0.0).sum(-1)  # 0 * -inf (the banned token) -> 0
        return neg_entropy, z.argmax(-1)
    raise OpTypeError(f"lm_head_confidence: unknown kind {kind!r} (max, margin, entropy)")


# ---------------------------------------------------------------- per-forward memos
#
# Every layer of a forward gets the same ``positions`` and ``key_valid`` tensors; the reference
# recomputes the rotary angles (arange, pow, cos, sin, cat: twice per layer) and the attention
# mask from them each time. These kernels compute them once per forward and reuse them while the
# same tensor object, unmodified (``_version``), comes back. They hold a reference to the tensor,
# so its id cannot be reused by another while it is remembered.


class _Memo:
    """The value derived from one tensor (and a key), kept while that same tensor comes back."""

    def __init__(self) -> None:
        self._src: tuple = ()
        self._value = None

    def get(self, tensors: tuple[torch.Tensor, ...], key: tuple, build):
        n = len(tensors)
        src = (*tensors, *(t._version for t in tensors), key)
        old = self._src
        if len(old) == len(src) and all(a is b for a, b in zip(old, tensors)) and old[n:] == src[n:]:
            return self._value
        self._src, self._value = src, build()
        return self._value


class RotaryTables:
    """cos and signed sin rows indexed by position, built once per (theta, rotary_dim, dtype,
    device) and grown on demand; the rows of one forward's positions are gathered once for all
    its layers. The sin row carries the rotation's sign ([-sin | sin]), so a rotation is
    ``x * cos + roll(x, half) * sin``: three kernels instead of the reference's six."""

    def __init__(self) -> None:
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._memo = _Memo()
        self._whole = _Memo()

    def _table(self, key: tuple, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < need:
            theta, rotary_dim, acc, device = key
            n = max(need, 2 * table[0].shape[0] if table is not None else 256)
            # The reference's formula on positions 0..n-1: identical values at every position.
            inv = theta ** (-torch.arange(0, rotary_dim, 2, dtype=acc, device=device) / rotary_dim)
            ang = torch.arange(n, device=device).to(acc)[:, None] * inv
            table = self._tables[key] = (torch.cat((ang, ang), -1).cos(), torch.cat((-ang.sin(), ang.sin()), -1))
        return table

    def angles(self, positions: torch.Tensor, rotary_dim: int, theta: float, acc: torch.dtype):
        """cos and signed sin [B, T, 1, rotary_dim] for ``positions`` [B, T]."""

        def build():
            need = int(positions.max()) + 1 if positions.numel() else 1
            cos, sin = self._table((theta, rotary_dim, acc, positions.device), need)
            return cos[positions][:, :, None, :], sin[positions][:, :, None, :]

        return self._memo.get((positions,), (theta, rotary_dim, acc), build)

    def tables(self, positions: torch.Tensor, rotary_dim: int, theta: float, acc: torch.dtype):
        """The whole cos and signed sin tables [P, rotary_dim], P > every one of ``positions``:
        what the native kernel indexes by position itself."""

        def build():
            need = int(positions.max()) + 1 if positions.numel() else 1
            if positions.numel() and int(positions.min()) < 0:
                raise OpTypeError("rope_attention: positions must be >= 0")
            return self._table((theta, rotary_dim, acc, positions.device), need)

        return self._whole.get((positions,), (theta, rotary_dim, acc), build)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """``ir.ops.rope`` given the angles: half-split rotation of the leading ``rotary_dim`` dims
    (``[x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin]``)."""
    acc = cos.dtype
    rot = x.to(acc) if rotary_dim == x.shape[-1] else x[..., :rotary_dim].to(acc)
    rotated = torch.addcmul(rot * cos, rot.roll(rotary_dim // 2, dims=-1), signed_sin)
    if rotary_dim == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """``ir.ops.rms_norm`` through torch's fused kernel (same formula, one pass)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = F.rms_norm(x.to(acc), (x.shape[-1],), eps=eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float):
    s = x + residual
    return rms_norm(s, weight, eps=eps), s


class AttentionKernels:
    """``attention`` and ``rope_attention`` with the per-forward memos: rotary rows from
    :class:`RotaryTables`, and no mask at all when every key is valid and there is no block rule
    (SDPA's unmasked path is the fast one)."""

    def __init__(self, native: NativeKernels | None = None) -> None:
        self.rotary = RotaryTables()
        self._mask = _Memo()
        self._slots = _Memo()
        self.native = native  # rotary + K/V layout in one native call (float32), else torch ops

    def mask(self, key_valid, token_index, n_keys: int, cached: bool, block_size: int | None):
        """``ir.ops.attention_mask`` for this forward, or None where it would allow everything."""

        def build():
            if block_size is None and bool(key_valid.all()):
                return None
            key_index = torch.arange(n_keys, device=key_valid.device) if cached else token_index
            return attention_mask(key_valid, token_index, key_index, block_size)

        return self._mask.get((key_valid, token_index), (n_keys, cached, block_size), build)

    def attention(
        self,
        q,
        k,
        v,
        key_valid,
        token_index,
        k_cache=None,
        v_cache=None,
        *,
        scale: float,
        block_size: int | None = None,
    ):
        keys, values, _ = splice_kv(k, v, token_index, k_cache, v_cache)
        mask = self.mask(key_valid, token_index, keys.shape[1], k_cache is not None, block_size)
        qh, kh, vh = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        gqa = q.shape[2] != keys.shape[2]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa).transpose(1, 2)
        if k_cache is not None:
            return out, k_cache, v_cache
        return out

    def rope_attention(
        self,
        q,
        k,
        v,
        key_valid,
        token_index,
        positions,
        q_norm,
        k_norm,
        k_cache,
        v_cache,
        *,
        scale: float,
        block_size: int | None,
        theta: float,
        rotary_dim: int,
        eps: float,
    ):
        if self.native is not None and q.dtype == torch.float32:
            args = (q, k, v, key_valid, token_index, positions, q_norm, k_norm, k_cache, v_cache)
            out = self._rope_attention_native(*args, scale, block_size, theta, rotary_dim, eps)
            if out is not None:
                return out
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps=eps), rms_norm(k, k_norm, eps=eps)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        cos, sin = self.rotary.angles(positions, rotary_dim, theta, acc)
        q, k = rotate(q, cos, sin, rotary_dim), rotate(k, cos, sin, rotary_dim)
        return self.attention(q, k, v, key_valid, token_index, k_cache, v_cache, scale=scale, block_size=block_size)

    def _rope_attention_native(
        self, q, k, v, key_valid, token_index, positions, q_norm, k_norm, k_cache, v_cache,
        scale, block_size, theta, rotary_dim, eps,
    ):  # fmt: skip
        """QK-norm, rotary, the K/V cache write and (for few tokens without a block rule) the
        attention itself in one native call, else SDPA after it; None when the layout is not one
        the native kernels read (the torch path runs instead)."""
        b, t = q.shape[:2]
        if tuple(positions.shape) != (b, t):
            return None
        cached = k_cache is not None
        if cached:
            if tuple(token_index.shape) not in ((t,), (b, t)):
                return None
            self._check_slots(token_index, k_cache.shape[1])
        cos, sin = self.rotary.tables(positions, rotary_dim, theta, torch.float32)
        if block_size is None:  # few tokens: the whole op in one native call
            out = self.native.rope_attention(
                q, k, v, positions, cos, sin, q_norm, k_norm, eps, token_index, k_cache, v_cache, key_valid, scale
            )
            if out is not None:
                return (out, k_cache, v_cache) if cached else out
        done = self.native.rope_qkv(q, k, v, positions, cos, sin, q_norm, k_norm, eps, token_index, k_cache, v_cache)
        if done is None:
            return None
        qh, kh, vh = done
        if cached:
            kh, vh = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        mask = self.mask(key_valid, token_index, kh.shape[2], cached, block_size)
        gqa = qh.shape[1] != kh.shape[1]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa).transpose(1, 2)
        return (out, k_cache, v_cache) if cached else out

    def _check_slots(self, token_index: torch.Tensor, slots: int) -> None:
        """The cache slots a forward writes lie in [0, slots): checked once per forward (the
        native write has no bounds check of its own)."""

        def build():
            if token_index.numel() and not 0 <= int(token_index.min()) <= int(token_index.max()) < slots:
                raise IndexError(f"attention: token_index holds slots outside [0, {slots}) of the K/V cache")
            return True

        self._slots.get((token_index,), (slots,), build)


class NativeRowKernels:
    """``rms_norm`` / ``add_rms_norm`` / ``swiglu`` through the native row kernels for float32,
    contiguous inputs; the torch kernels for anything else."""

    def __init__(self, native: NativeKernels) -> None:
        self.native = native

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
        out = self.native.rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps=eps) if out is None else out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float):
        out = self.native.add_rms_norm(x, residual, weight, eps)
        return add_rms_norm(x, residual, weight, eps=eps) if out is None else out

    def swiglu(self, h: torch.Tensor) -> torch.Tensor:
        out = self.native.swiglu(h)
        return swiglu_reference(h) if out is None else out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self.native.linear(x, weight, bias)
        return F.linear(x, weight, bias) if out is None else out

    def lm_head_confidence(
        self, h: torch.Tensor, weight: torch.Tensor, *, banned: int, kind: str = "max", chunk: int = 8192
    ):
        """The native small-vocabulary head where it applies (one call: at batch 1 the torch head
        is five kernels), else ``lm_head_confidence_budgeted`` (same attributes) with its logits
        through ``linear``."""
        out = self.native.lm_head_confidence(h, weight, banned, kind)
        if out is not None:
            return out
        return lm_head_confidence_budgeted(h, weight, banned=banned, kind=kind, chunk=chunk, linear=self.linear)


class LayerBlockKernels:
    """``attention_block`` / ``mlp_block``: a dense decoder layer in two native calls (float32,
    contiguous, no block-causal rule, attention within the native core's limits), the matmuls in
    native.c's panel GEMM (packed weights) or torch's own BLAS; anything else is composed from
    this backend's other kernels (same values). Shares the attention kernels' per-forward memos
    (rotary tables, slot checks)."""

    def __init__(self, attn: AttentionKernels, rows: NativeRowKernels) -> None:
        self.attn, self.rows, self.native = attn, rows, rows.native

    def attention_block(
        self, x, w_qkv, b_qkv, key_valid, token_index, positions, q_norm, k_norm, k_cache, v_cache, *,
        sizes, heads, kv_heads, scale, block_size, theta, rotary_dim, eps,
    ):  # fmt: skip
        cached = k_cache is not None
        if block_size is None and x.dtype == torch.float32 and tuple(positions.shape) == tuple(x.shape[:2]):
            if cached:
                self.attn._check_slots(token_index, k_cache.shape[1])
            cos, sin = self.attn.rotary.tables(positions, rotary_dim, theta, torch.float32)
            out = self.native.attention_block(
                x, w_qkv, b_qkv, key_valid, token_index, positions, q_norm, k_norm, k_cache, v_cache, cos, sin,
                heads=heads, kv_heads=kv_heads, scale=scale, rotary_dim=rotary_dim, eps=eps,
            )  # fmt: skip
            if out is not None:
                return (out, k_cache, v_cache) if cached else out
        qkv = self.native.projection(x, w_qkv, b_qkv) if x.dtype == torch.float32 else None
        q, k, v = (F.linear(x, w_qkv, b_qkv) if qkv is None else qkv).split(list(sizes), dim=-1)
        q, k, v = q.unflatten(-1, (heads, -1)), k.unflatten(-1, (kv_heads, -1)), v.unflatten(-1, (kv_heads, -1))
        out = self.attn.rope_attention(
            q, k, v, key_valid, token_index, positions, q_norm, k_norm, k_cache, v_cache,
            scale=scale, block_size=block_size, theta=theta, rotary_dim=rotary_dim, eps=eps,
        )  # fmt: skip
        return (out[0].flatten(-2), out[1], out[2]) if cached else out.flatten(-2)

    def mlp_block(self, attn, w_o, b_o, residual, w_norm, w_gate_up, w_down, w_out_norm, *, eps):
        out = self.native.mlp_block(attn, w_o, b_o, residual, w_norm, w_gate_up, w_down, w_out_norm, eps)
        if out is not None:
            return out
        normed, total = self.rows.add_rms_norm(residual, F.linear(attn, w_o, b_o), w_norm, eps=eps)
        down = F.linear(self.rows.swiglu(F.linear(normed, w_gate_up)), w_down)
        return self.rows.add_rms_norm(total, down, w_out_norm, eps=eps)


def linear_wq(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """x (q)^T * s (+ b): ``ir.ops.linear_wq`` with the scale moved past the matmul (the same
    product; rounding differs at the dtype's last bit)."""
    y = F.linear(x, qweight.to(x.dtype)) * scale.to(x.dtype)
    return y + bias if bias is not None else y
