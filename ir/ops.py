"""The op set: shape/dtype inference and the reference semantics of every IR op.

The reference implementations are plain torch and define the truth every backend is
checked against (the validation oracle runs them in float64). They are vectorised:
no per-element Python. Ops with side effects declare them in ``mutates`` (input
indices written in place, e.g. the KV cache spliced by ``attention``); their outputs
alias those inputs, so a scheduler must keep reads of the old value before the write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from dinfer_rt.ir.types import TensorType, same_dim


class OpTypeError(ValueError):
    """An op was given inputs or attributes it cannot accept."""


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: Callable[[Sequence[TensorType | None], dict[str, Any]], list[TensorType]]
    reference: Callable[..., Any]
    doc: str
    min_inputs: int
    max_inputs: int
    mutates: tuple[int, ...] = field(default=())


OPS: dict[str, OpDef] = {}


def op_def(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise OpTypeError(f"unknown IR op {name!r}; known ops: {', '.join(sorted(OPS))}") from None


def _register(name: str, n_inputs: int | tuple[int, int], mutates: tuple[int, ...] = ()):
    lo, hi = (n_inputs, n_inputs) if isinstance(n_inputs, int) else n_inputs

    def wrap(infer):
        def deco(ref):
            OPS[name] = OpDef(name, infer, ref, (ref.__doc__ or "").strip(), lo, hi, mutates)
            return ref

        return deco

    return wrap


def _need(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise OpTypeError(f"{op}: {msg}")


def _same_shape(op: str, a: TensorType, b: TensorType) -> None:
    _need(a.rank == b.rank and all(same_dim(x, y) for x, y in zip(a.shape, b.shape)), op, f"shape mismatch {a} vs {b}")
    _need(a.dtype == b.dtype, op, f"dtype mismatch {a} vs {b}")


# ---------------------------------------------------------------- elementwise


def _infer_binary(name):
    def infer(ts, attrs):
        _same_shape(name, ts[0], ts[1])
        return [ts[0]]

    return infer


@_register("add", 2)(_infer_binary("add"))
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b (same shape and dtype)."""
    return a + b


@_register("mul", 2)(_infer_binary("mul"))
def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b (same shape and dtype)."""
    return a * b


def _infer_unary_float(name):
    def infer(ts, attrs):
        _need(ts[0].is_float, name, f"needs a float input, got {ts[0]}")
        return [ts[0]]

    return infer


@_register("silu", 1)(_infer_unary_float("silu"))
def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x)."""
    return F.silu(x)


def _infer_cast(ts, attrs):
    _need(isinstance(attrs.get("dtype"), torch.dtype), "cast", "attr dtype must be a torch.dtype")
    return [ts[0].with_dtype(attrs["dtype"])]


@_register("cast", 1)(_infer_cast)
def cast(x: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """Convert x to ``dtype``."""
    return x.to(dtype)


# ---------------------------------------------------------------- embedding / linear / norms


def _infer_embedding(ts, attrs):
    ids, w = ts
    _need(not ids.is_float, "embedding", f"ids must be integer, got {ids}")
    _need(w.rank == 2, "embedding", f"weight must be [vocab, hidden], got {w}")
    return [TensorType((*ids.shape, w.shape[1]), w.dtype)]


@_register("embedding", 2)(_infer_embedding)
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of ``weight`` selected by ``ids``."""
    return F.embedding(ids, weight)


def _infer_linear(ts, attrs):
    x, w = ts[0], ts[1]
    _need(w.rank == 2, "linear", f"weight must be [out, in], got {w}")
    _need(same_dim(x.shape[-1], w.shape[1]), "linear", f"input {x} does not match weight {w} (in features)")
    _need(x.dtype == w.dtype, "linear", f"dtype mismatch: input {x}, weight {w}")
    if len(ts) == 3 and ts[2] is not None:
        _need(ts[2].shape == (w.shape[0],), "linear", f"bias {ts[2]} does not match weight {w}")
    return [TensorType((*x.shape[:-1], w.shape[0]), x.dtype)]


@_register("linear", (2, 3))(_infer_linear)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); weight in nn.Linear layout [out, in]."""
    return F.linear(x, weight, bias)


WEIGHT_QUANT_DTYPES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
"""Storage dtype of a weight-only quantised linear -> its format name (docs/quantization.md)."""


def _infer_linear_wq(ts, attrs):
    x, q, scale = ts[0], ts[1], ts[2]
    _need(x.is_float, "linear_wq", f"input must be float, got {x}")
    _need(
        q.rank == 2 and q.dtype in WEIGHT_QUANT_DTYPES,
        "linear_wq",
        f"weight must be int8 or float8_e4m3fn [out, in], got {q}",
    )
    _need(same_dim(x.shape[-1], q.shape[1]), "linear_wq", f"input {x} does not match weight {q} (in features)")
    _need(
        scale.shape == (q.shape[0],) and scale.is_float,
        "linear_wq",
        f"scale must be float [{q.shape[0]}] (one per output channel), got {scale}",
    )
    if len(ts) == 4 and ts[3] is not None:
        _need(ts[3].shape == (q.shape[0],), "linear_wq", f"bias {ts[3]} does not match weight {q}")
    return [TensorType((*x.shape[:-1], q.shape[0]), x.dtype)]


@_register("linear_wq", (3, 4))(_infer_linear_wq)
def linear_wq(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Weight-only quantised linear: dequantise ``qweight`` (int8 or fp8 e4m3, [out, in]) with
    its per-output-channel ``scale`` into x's dtype, then ``linear``. Activations stay in x's
    dtype; in float64 this is the exact dequantised product (the validation oracle)."""
    w = qweight.to(x.dtype) * scale.to(x.dtype)[:, None]
    return F.linear(x, w, bias)


GPTQ_PACK = 8  # 4-bit values per int32


def gptq_unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """[in/8, out] int32 -> [in, out] int (0..15): value j of word i is input row 8i + j, at bits 4j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    return ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).flatten(0, 1)


def gptq_unpack_cols(qzeros: torch.Tensor) -> torch.Tensor:
    """[G, out/8] int32 -> [G, out] int (0..15): value j of word c is output column 8c + j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qzeros.device)
    return ((qzeros[:, :, None] >> shifts[None, None, :]) & 0xF).flatten(1, 2)


def gptq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, zero_offset: int, dtype
) -> torch.Tensor:
    """The [out, in] weight a GPTQ 4-bit layer holds: (q - (z + zero_offset)) * s of its group."""
    q = gptq_unpack_rows(qweight)
    z = gptq_unpack_cols(qzeros) + zero_offset
    g = g_idx.long()
    return ((q - z[g]).to(dtype) * scales.to(dtype)[g]).T


def _infer_linear_gptq(ts, attrs):
    x, qw, qz, sc, gi = ts[:5]
    _need(x.is_float, "linear_gptq", f"input must be float, got {x}")
    for name, t in (("qweight", qw), ("qzeros", qz), ("g_idx", gi)):
        _need(t.dtype == torch.int32, "linear_gptq", f"{name} must be int32, got {t}")
    _need(qw.rank == 2 and sc.rank == 2 and qz.rank == 2, "linear_gptq", f"bad GPTQ tensors {qw}, {qz}, {sc}")
    k, n = qw.shape[0] * GPTQ_PACK, qw.shape[1]
    _need(same_dim(x.shape[-1], k), "linear_gptq", f"input {x} does not match qweight {qw} ({k} in features)")
    _need(sc.shape[1] == n and qz.shape == (sc.shape[0], n // GPTQ_PACK), "linear_gptq", f"scales {sc} / qzeros {qz}")
    _need(gi.shape == (k,), "linear_gptq", f"g_idx {gi} must be [{k}]")
    if len(ts) == 6 and ts[5] is not None:
        _need(ts[5].shape == (n,), "linear_gptq", f"bias {ts[5]} does not match {n} out features")
    return [TensorType((*x.shape[:-1], n), x.dtype)]


@_register("linear_gptq", (5, 6))(_infer_linear_gptq)
def linear_gptq(x, qweight, qzeros, scales, g_idx, bias=None, *, zero_offset: int = 1):
    """GPTQ 4-bit linear (AutoGPTQ layout): qweight [in/8, out] and qzeros [G, out/8] int32 hold
    eight 4-bit values per word, scales [G, out], g_idx [in] the group of each input row. The
    weight is (q - (zero + ``zero_offset``)) * scale (offset 1 in the "gptq" v1 format, 0 in
    "gptq_v2"), dequantised into x's dtype, then ``linear``."""
    w = gptq_dequantize(qweight, qzeros, scales, g_idx, zero_offset, x.dtype)
    return F.linear(x, w, bias)


def _infer_rms_norm(ts, attrs):
    x, w = ts
    _need(w.rank == 1 and same_dim(w.shape[0], x.shape[-1]), "rms_norm", f"weight {w} does not match input {x}")
    _need(attrs.get("eps", 0) > 0, "rms_norm", "attr eps must be > 0")
    return [x]


@_register("rms_norm", 2)(_infer_rms_norm)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: normalise in fp32 (or f64), cast back, then scale by weight.

    Applied to a [B, T, H, D] tensor with a [D] weight it is the per-head QK-norm.
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


# ---------------------------------------------------------------- shape ops


def _infer_view_heads(ts, attrs):
    x = ts[0]
    heads = attrs["heads"]
    last = x.shape[-1]
    _need(isinstance(last, int) and last % heads == 0, "view_heads", f"last dim of {x} not divisible by {heads}")
    return [x.with_shape(*x.shape[:-1], heads, last // heads)]


@_register("view_heads", 1)(_infer_view_heads)
def view_heads(x: torch.Tensor, *, heads: int) -> torch.Tensor:
    """[..., H*D] -> [..., H, D]."""
    return x.unflatten(-1, (heads, -1))


def _infer_merge_heads(ts, attrs):
    x = ts[0]
    _need(x.rank >= 2 and all(isinstance(d, int) for d in x.shape[-2:]), "merge_heads", f"bad input {x}")
    return [x.with_shape(*x.shape[:-2], x.shape[-2] * x.shape[-1])]


@_register("merge_heads", 1)(_infer_merge_heads)
def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[..., H, D] -> [..., H*D]."""
    return x.flatten(-2)


def _infer_split(ts, attrs):
    x, sizes = ts[0], attrs["sizes"]
    _need(x.shape[-1] == sum(sizes), "split", f"sizes {sizes} do not sum to last dim of {x}")
    return [x.with_shape(*x.shape[:-1], s) for s in sizes]


@_register("split", 1)(_infer_split)
def split(x: torch.Tensor, *, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Split the last dim into consecutive pieces (e.g. LLaDA2's fused [q | k | v] rows)."""
    return tuple(x.split(list(sizes), dim=-1))


# ---------------------------------------------------------------- rope / attention


def _infer_rope(ts, attrs):
    x, pos = ts
    _need(x.rank == 4, "rope", f"input must be [B, T, H, D], got {x}")
    _need(pos.rank == 2 and not pos.is_float, "rope", f"positions must be integer [B, T], got {pos}")
    rd = attrs["rotary_dim"]
    _need(
        isinstance(x.shape[-1], int) and 0 < rd <= x.shape[-1] and rd % 2 == 0,
        "rope",
        f"rotary_dim {rd} must be even and <= head_dim of {x}",
    )
    return [x]


def rope_angles(
    positions: torch.Tensor, rotary_dim: int, theta: float, acc: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, T, 1, rotary_dim] in ``acc`` (fp32, or f64 when validating), half-split layout."""
    inv = theta ** (-torch.arange(0, rotary_dim, 2, dtype=acc, device=positions.device) / rotary_dim)
    ang = positions.to(acc)[..., None] * inv
    ang = torch.cat((ang, ang), dim=-1)[:, :, None, :]
    return ang.cos(), ang.sin()


@_register("rope", 2)(_infer_rope)
def rope(x: torch.Tensor, positions: torch.Tensor, *, theta: float, rotary_dim: int) -> torch.Tensor:
    """Rotary embedding, half-split (NeoX) layout, on the leading ``rotary_dim`` dims of each head.

    Angles and the rotation run in fp32 (LLaDA's ``rope_full_precision``); f64 stays f64.
    The remaining head dims pass through (partial rotary, LLaDA2).
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = rope_angles(positions, rotary_dim, theta, acc)
    rot, rest = x[..., :rotary_dim].to(acc), x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    return torch.cat((rotated.to(x.dtype), rest), dim=-1)


def _infer_attention(ts, attrs):
    q, k, v, key_valid, token_index = ts[:5]
    _need(q.rank == 4 and k.rank == 4 and v.rank == 4, "attention", f"q/k/v must be [B, T, heads, D]: {q}, {k}, {v}")
    _need(k.shape == v.shape, "attention", f"k {k} and v {v} differ")
    _need(same_dim(q.shape[-1], k.shape[-1]), "attention", f"head_dim of q {q} and k {k} differ")
    h, kv = q.shape[2], k.shape[2]
    _need(
        isinstance(h, int) and isinstance(kv, int) and h % kv == 0,
        "attention",
        f"query heads {h} not a multiple of kv heads {kv} (GQA)",
    )
    _need(
        key_valid.dtype == torch.bool and key_valid.rank == 2,
        "attention",
        f"key_valid must be bool [B, S], got {key_valid}",
    )
    _need(
        token_index.rank in (1, 2) and not token_index.is_float,
        "attention",
        f"token_index must be integer [T] (shared by every row) or [B, T] (per row), got {token_index}",
    )
    out = [q]
    if len(ts) == 7:
        kc, vc = ts[5], ts[6]
        _need(
            kc.rank == 4 and kc.shape[2:] == k.shape[2:] and kc.dtype == k.dtype,
            "attention",
            f"k cache {kc} does not match k {k}",
        )
        _need(kc.shape == vc.shape and kc.dtype == vc.dtype, "attention", f"k cache {kc} and v cache {vc} differ")
        out += [kc, vc]
    else:
        _need(len(ts) == 5, "attention", "takes 5 inputs, or 7 with a KV cache")
    return out


def attention_mask(
    key_valid: torch.Tensor, query_index: torch.Tensor, key_index: torch.Tensor, block_size: int | None
) -> torch.Tensor:
    """Bool [B, 1, T, S]: padding mask, plus block-causal (key block <= query block) when set.
    ``query_index`` is [T] or, with per-row query windows, [B, T]; ``key_index`` [S] or [B, S]."""
    allowed = key_valid[:, None, None, :]
    if block_size is not None:
        qi = query_index if query_index.dim() == 2 else query_index[None]
        ki = key_index if key_index.dim() == 2 else key_index[None]
        causal = (ki[:, None, :] // block_size) <= (qi[:, :, None] // block_size)
        allowed = allowed & causal[:, None]
    # A query that may see nothing (a fully padded row) would give NaN; let it see everything.
    return allowed | ~allowed.any(-1, keepdim=True)


def splice_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    token_index: torch.Tensor,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys and values an attention op attends over, with their sequence positions.

    With a cache ([B, S, KV, D] buffers indexed by position) this forward's K/V are written in
    place at ``token_index`` and the whole cache is attended over (positions 0..S-1); without
    one, the fresh K/V at ``token_index``. Every attention kernel starts here.

    A [B, T] ``token_index`` gives each row its own slots (per-row query windows: continuous
    batching runs rows that sit at different blocks in one forward); the writes are a scatter."""
    if k_cache is None:
        return k, v, token_index
    if token_index.dim() == 2:
        idx = token_index[:, :, None, None].expand(k.shape)
        k_cache.scatter_(1, idx, k)
        v_cache.scatter_(1, idx, v)
    else:
        k_cache.index_copy_(1, token_index, k)
        v_cache.index_copy_(1, token_index, v)
    return k_cache, v_cache, torch.arange(k_cache.shape[1], device=k.device)


@_register("attention", (5, 7), mutates=(5, 6))(_infer_attention)
def attention(
    q, k, v, key_valid, token_index, k_cache=None, v_cache=None, *, scale: float, block_size: int | None = None
):
    """Scaled dot-product attention over [B, T, heads, D] with GQA and masks.

    Without a cache, keys are this forward's T tokens (S == T). With a cache ([B, S, KV, D]
    buffers indexed by sequence position), the fresh K/V are spliced in place at
    ``token_index`` and the queries attend over all S slots; the cache outputs alias the
    cache inputs. ``key_valid`` [B, S] masks padding; ``block_size`` adds the LLaDA2
    block-causal rule on absolute positions (blocks aligned to position 0).
    """
    keys, values, key_index = splice_kv(k, v, token_index, k_cache, v_cache)
    mask = attention_mask(key_valid, token_index, key_index, block_size)
    groups = q.shape[2] // keys.shape[2]
    qh, kh, vh = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    if groups > 1:
        kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).transpose(1, 2)
    if k_cache is not None:
        return out, k_cache, v_cache
    return out


# ---------------------------------------------------------------- paged KV storage


def _infer_kv_pools(op: str, k_pool: TensorType, v_pool: TensorType, table: TensorType) -> None:
    _need(k_pool.rank == 4, op, f"pools must be [NB, P, KV, D], got {k_pool}")
    _same_shape(op, k_pool, v_pool)
    _need(
        table.rank == 2 and table.dtype in (torch.int32, torch.int64),
        op,
        f"block_table must be int32 or int64 [B, NBT], got {table}",
    )


def _infer_kv_gather(ts, attrs):
    k_pool, v_pool, table, key_valid = ts
    _infer_kv_pools("kv_gather", k_pool, v_pool, table)
    _need(
        key_valid.dtype == torch.bool and key_valid.rank == 2 and same_dim(key_valid.shape[0], table.shape[0]),
        "kv_gather",
        f"key_valid must be bool [B, S] with the block table's rows, got {key_valid} for table {table}",
    )
    nbt, size, length = table.shape[1], k_pool.shape[1], key_valid.shape[1]
    if all(isinstance(d, int) for d in (nbt, size, length)):
        _need(nbt * size >= length, "kv_gather", f"a block table of {nbt} x {size} positions covers < {length} keys")
    out = TensorType((key_valid.shape[0], key_valid.shape[1], *k_pool.shape[2:]), k_pool.dtype)
    return [out, out]


def gather_pages(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` logical positions of every row of ``table`` as a contiguous [B, S, KV, D]
    copy: block ``table[b, p // P]`` holds position p of row b at offset ``p % P``."""
    p = pool.shape[1]
    used = table[:, : -(-length // p)].long()  # blocks past the length are never read
    return pool[used].flatten(1, 2)[:, :length].contiguous()


def scatter_pages(pool: torch.Tensor, table: torch.Tensor, token_index: torch.Tensor, cache: torch.Tensor) -> None:
    """``pool[table[b, p // P], p % P] = cache[b, p]`` for every slot p = ``token_index[b, t]``
    ([T]: the same slots in every row), in place."""
    b, p = table.shape[0], pool.shape[1]
    slots = token_index.long()
    slots = slots.expand(b, -1) if slots.dim() == 1 else slots
    rows = torch.arange(b, device=slots.device)[:, None].expand_as(slots)
    pool[table.long()[rows, slots // p], slots % p] = cache[rows, slots]


@_register("kv_gather", 4)(_infer_kv_gather)
def kv_gather(k_pool, v_pool, block_table, key_valid):
    """Read a paged KV pool into contiguous per-row caches [B, S, KV, D] (S = key_valid's).

    The pools [NB, P, KV, D] hold blocks of P positions shared by the running rows and the
    prefix cache; ``block_table`` [B, NBT] names the block of each row's P-position span
    (block 0 is trash: padding writes land there, nothing valid is read from it). Gathering
    lets the existing ``attention`` kernels run unchanged on the result; ``kv_scatter`` then
    writes back the slots this forward computed. Outputs are fresh tensors, not views.
    """
    s = key_valid.shape[1]
    return gather_pages(k_pool, block_table, s), gather_pages(v_pool, block_table, s)


def _infer_kv_scatter(ts, attrs):
    k_pool, v_pool, table, token_index, k_cache, v_cache = ts
    _infer_kv_pools("kv_scatter", k_pool, v_pool, table)
    _need(
        token_index.rank in (1, 2) and not token_index.is_float and token_index.dtype != torch.bool,
        "kv_scatter",
        f"token_index must be integer [T] or [B, T], got {token_index}",
    )
    _same_shape("kv_scatter", k_cache, v_cache)
    _need(
        k_cache.rank == 4 and k_cache.shape[2:] == k_pool.shape[2:] and k_cache.dtype == k_pool.dtype,
        "kv_scatter",
        f"caches {k_cache} do not match the pools {k_pool} (KV heads, head dim, dtype)",
    )
    _need(same_dim(k_cache.shape[0], table.shape[0]), "kv_scatter", f"caches {k_cache} vs block table {table} rows")
    return [k_pool, v_pool]


@_register("kv_scatter", 6, mutates=(0, 1))(_infer_kv_scatter)
def kv_scatter(k_pool, v_pool, block_table, token_index, k_cache, v_cache):
    """Write the slots this forward computed (``token_index`` [T] or [B, T], as in ``attention``)
    from the contiguous caches [B, S, KV, D] back into the paged pools, in place; the outputs
    alias the pools. Only these slots changed since ``kv_gather``, so nothing else is copied.
    Repeated slots in a row (padding queries sharing a scratch slot) carry equal values."""
    scatter_pages(k_pool, block_table, token_index, k_cache)
    scatter_pages(v_pool, block_table, token_index, v_cache)
    return k_pool, v_pool


# ---------------------------------------------------------------- collectives

COLLECTIVE_GROUPS: dict[str, object] = {}
"""Process groups by the name a collective op's ``group`` attribute carries (``"tp"``); set by
``dinfer_rt.parallel`` when a model is sharded. Absent (one process): the collectives are the
identity, which is their semantics over a group of one."""

REDUCE_OPS = ("sum", "max")
COLLECTIVE_BYTES: dict[str, int] = {}  # bytes this process all-reduced per group (benchmarks read it)


def _infer_all_reduce(ts, attrs):
    _need(attrs.get("op") in REDUCE_OPS, "all_reduce", f"op must be one of {REDUCE_OPS}, got {attrs.get('op')!r}")
    _need(ts[0].is_float, "all_reduce", f"needs a float tensor, got {ts[0]}")
    return [ts[0]]


def group_size(group: str = "tp") -> int:
    """Ranks in the process group a collective's ``group`` names (1 when there is none)."""
    pg = COLLECTIVE_GROUPS.get(group)
    if pg is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(pg) if dist.is_initialized() else 1


@_register("all_reduce", 1)(_infer_all_reduce)
def all_reduce(x: torch.Tensor, *, op: str = "sum", group: str = "tp") -> torch.Tensor:
    """Elementwise ``op`` (sum, max) of ``x`` over the ranks of process group ``group``, every
    rank receiving the result (torch.distributed: gloo on the CPU, NCCL / RCCL / HCCL on devices).
    Out of place: the input is left as it was."""
    pg = COLLECTIVE_GROUPS.get(group)
    if pg is None:
        return x
    import torch.distributed as dist

    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=pg)
    COLLECTIVE_BYTES[group] = COLLECTIVE_BYTES.get(group, 0) + out.numel() * out.element_size()
    return out


def _infer_all_gather(ts, attrs):
    sizes = attrs.get("sizes")
    _need(isinstance(sizes, tuple) and sizes and all(n > 0 for n in sizes), "all_gather", f"bad sizes {sizes!r}")
    x = ts[0]
    _need(x.is_float, "all_gather", f"needs a float tensor, got {x}")
    return [x.with_shape(*x.shape[:-1], sum(sizes))]


@_register("all_gather", 1)(_infer_all_gather)
def all_gather(x: torch.Tensor, *, sizes: tuple[int, ...], group: str = "tp") -> torch.Tensor:
    """The ranks' ``x`` concatenated along the last dim in rank order; rank r contributes
    ``sizes[r]`` columns (uneven splits: a vocabulary of 33 over 2 ranks is 17 + 16). Over a
    group of one it is the identity."""
    pg = COLLECTIVE_GROUPS.get(group)
    if pg is None:
        return x
    import torch.distributed as dist

    width = max(sizes)
    pad = torch.zeros((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    pad[..., : x.shape[-1]] = x
    parts = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(parts, pad, group=pg)
    COLLECTIVE_BYTES[group] = COLLECTIVE_BYTES.get(group, 0) + pad.numel() * pad.element_size() * len(sizes)
    return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1)


def vocab_shard(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [lo, hi) of a vocabulary-parallel LM head rank ``rank`` holds: ceil(V / N) each, the
    last rank the rest."""
    n = -(-vocab // world)
    return min(vocab, rank * n), min(vocab, (rank + 1) * n)


def _infer_vocab_parallel_confidence(ts, attrs):
    return _infer_lm_head_confidence(ts, attrs)


def _reduce(t: torch.Tensor, op: str, pg) -> torch.Tensor:
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    t = t.contiguous()
    dist.all_reduce(t, op=ops[op], group=pg)
    return t


@_register("vocab_parallel_confidence", 2)(_infer_vocab_parallel_confidence)
def vocab_parallel_confidence(
    h: torch.Tensor, weight: torch.Tensor, *, banned: int, kind: str = "max", vocab_offset: int = 0, group: str = "tp"
):
    """``lm_head_confidence`` over a vocabulary split across the ranks of ``group``: ``weight``
    holds rows ``vocab_offset`` .. of the LM head. Each rank reduces its logits to a few
    statistics (max, first argmax, sum exp(z - M), for entropy sum exp(z - M)(z - M), for margin
    its best candidate for second place) and all-reduces those: the full [positions x vocab]
    logits are never gathered. Semantics = ``confidence(linear(h, full LM head))``; over a group
    of one (``vocab_offset`` 0) exactly ``lm_head_confidence``."""
    pg = COLLECTIVE_GROUPS.get(group)
    if pg is None:
        return lm_head_confidence(h, weight, banned=banned, kind=kind)
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    z = linear(h, weight).to(acc)
    if vocab_offset <= banned < vocab_offset + z.shape[-1]:
        z[..., banned - vocab_offset] = float("-inf")
    top = z.topk(min(2, z.shape[-1]), dim=-1)
    m_loc, a_loc = top.values[..., 0], top.indices[..., 0] + vocab_offset
    big = torch.iinfo(torch.int64).max
    m = _reduce(m_loc.clone(), "max", pg)
    token = _reduce(torch.where(m_loc == m, a_loc, torch.full_like(a_loc, big)), "min", pg)
    e = (z - m[..., None]).exp()
    sums = [e.sum(-1)] + ([(e * (z - m[..., None])).nan_to_num(0.0).sum(-1)] if kind == "entropy" else [])
    sums = _reduce(torch.stack(sums), "sum", pg)
    z_sum = sums[0]
    moved = (3 + len(sums)) * m.numel() * m.element_size()  # max, argmin, the sums, (margin: runner-up)
    for key in (group, f"{group}/lm_head"):  # the head's own share, apart from the layers' all-reduces
        COLLECTIVE_BYTES[key] = COLLECTIVE_BYTES.get(key, 0) + moved
    if kind == "max":
        return 1.0 / z_sum, token
    if kind == "margin":
        # this rank's candidate for the global runner-up: its best unless that is the winner
        second = top.values[..., 1] if z.shape[-1] > 1 else torch.full_like(m_loc, float("-inf"))
        cand = torch.where(a_loc == token, second, m_loc)
        second = _reduce(cand, "max", pg)
        return (1.0 - (second - m).exp()) / z_sum, token
    if kind == "entropy":
        return sums[1] / z_sum - z_sum.log(), token
    raise OpTypeError(f"vocab_parallel_confidence: unknown kind {kind!r} (max, margin, entropy)")


# ---------------------------------------------------------------- mixture of experts


def _infer_router(name, with_bias):
    def infer(ts, attrs):
        logits = ts[0]
        _need(logits.is_float, name, f"router logits must be float, got {logits}")
        e, k = logits.shape[-1], attrs["k"]
        _need(isinstance(e, int) and 0 < k <= e, name, f"top-k {k} must be in 1..{e}")
        if with_bias:
            _need(ts[1].shape == (e,), name, f"expert bias {ts[1]} does not match {e} experts")
            g, tg = attrs["n_group"], attrs["topk_group"]
            _need(
                e % g == 0 and 0 < tg <= g and k <= tg * (e // g),
                name,
                f"group routing n_group={g} topk_group={tg} k={k} impossible with {e} experts",
            )
        shape = (*logits.shape[:-1], k)
        return [
            TensorType(shape, torch.float64 if logits.dtype == torch.float64 else torch.float32),
            TensorType(shape, torch.int64),
        ]

    return infer


@_register("router_softmax_topk", 1)(_infer_router("router_softmax_topk", False))
def router_softmax_topk(logits: torch.Tensor, *, k: int, renormalize: bool):
    """Softmax over experts (fp32), top-k; weights renormalised only if asked (LLaDA-MoE: not)."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = logits.to(acc).softmax(-1)
    w, idx = probs.topk(k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, idx


@_register("router_sigmoid_grouped", 2)(_infer_router("router_sigmoid_grouped", True))
def router_sigmoid_grouped(
    logits: torch.Tensor, bias: torch.Tensor, *, k: int, n_group: int, topk_group: int, renormalize: bool, scale: float
):
    """LLaDA2 router: sigmoid scores (fp32); the expert bias is used for selection only.

    Group score = sum of the top-2 biased scores in each of ``n_group`` groups; the best
    ``topk_group`` groups are kept and the top-k experts chosen among them. Weights are the
    unbiased scores of the chosen experts, renormalised if asked, times ``scale``.
    """
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    s = logits.to(acc).sigmoid()
    b = s + bias.to(acc)
    e = s.shape[-1]
    grouped = b.unflatten(-1, (n_group, e // n_group))
    group_score = grouped.topk(min(2, e // n_group), dim=-1).values.sum(-1)
    keep = group_score.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(-1, keep, True)
    expert_mask = group_mask.repeat_interleave(e // n_group, dim=-1)
    idx = b.masked_fill(~expert_mask, float("-inf")).topk(k, dim=-1).indices
    w = s.gather(-1, idx)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * scale, idx


def _infer_moe(ts, attrs):
    x, w, idx, gu, down = ts
    _need(
        gu.rank == 3 and down.rank == 3, "moe_experts", f"expert weights must be [E, 2I, H] and [E, H, I]: {gu}, {down}"
    )
    e, two_i, hid = gu.shape
    _need(down.shape == (e, hid, two_i // 2), "moe_experts", f"down weights {down} do not match gate/up {gu}")
    _need(same_dim(x.shape[-1], hid) and x.dtype == gu.dtype, "moe_experts", f"input {x} does not match experts {gu}")
    _need(
        w.shape == idx.shape and w.shape[:-1] == x.shape[:-1],
        "moe_experts",
        f"routing weights {w} / indices {idx} do not match input {x}",
    )
    return [x]


def local_routing(
    weights: torch.Tensor, indices: torch.Tensor, first_expert: int, n_local: int, elsewhere: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert parallelism: the routing restricted to the ``n_local`` experts from ``first_expert``
    a rank holds. Slots routed elsewhere get weight 0 and local expert ``elsewhere`` (0: computed,
    contributing nothing; ``n_local``: a virtual expert a kernel can skip), so kernels keep static
    shapes; the ranks' partial sums are all-reduced."""
    local = indices - first_expert
    mine = (local >= 0) & (local < n_local)
    kept = torch.where(mine, weights, torch.zeros_like(weights))
    return kept, torch.where(mine, local, torch.full_like(local, elsewhere))


@_register("moe_experts", 5)(_infer_moe)
def moe_experts(x, weights, indices, w_gate_up, w_down, *, first_expert: int = 0):
    """Weighted sum over each token's chosen SwiGLU experts.

    ``w_gate_up`` [E, 2I, H] stacks (gate, up) rows per expert; ``w_down`` is [E, H, I].
    Tokens are grouped by expert so each expert runs one matmul over its tokens. Under expert
    parallelism the weights hold experts ``first_expert`` .. ``first_expert + E - 1`` of the
    model's and ``indices`` stay global: other experts' slots are not computed here.
    """
    flat = x.reshape(-1, x.shape[-1])
    idx = indices.reshape(-1, indices.shape[-1])
    wts = weights.reshape(idx.shape)
    n_local = w_gate_up.shape[0]
    wts, idx = local_routing(wts, idx, first_expert, n_local, elsewhere=n_local)
    out = torch.zeros(flat.shape, dtype=weights.dtype, device=x.device)
    inter = w_down.shape[-1]
    for e in idx[idx < n_local].unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        gu = flat[tok] @ w_gate_up[e].T
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = h @ w_down[e].T
        out.index_add_(0, tok, y.to(out.dtype) * wts[tok, slot, None])
    return out.to(x.dtype).reshape(x.shape)


# ---------------------------------------------------------------- fused ops (reference = decomposition)


def _infer_add_rms_norm(ts, attrs):
    x, residual, w = ts
    _same_shape("add_rms_norm", x, residual)
    _infer_rms_norm([x, w], attrs)
    return [x, x]


@_register("add_rms_norm", 3)(_infer_add_rms_norm)
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float):
    """Fused residual add + RMSNorm: returns (rms_norm(x + residual), x + residual)."""
    s = x + residual
    return rms_norm(s, weight, eps=eps), s


def _infer_swiglu(ts, attrs):
    h = ts[0]
    _need(isinstance(h.shape[-1], int) and h.shape[-1] % 2 == 0, "swiglu", f"last dim of {h} must be even")
    return [h.with_shape(*h.shape[:-1], h.shape[-1] // 2)]


@_register("swiglu", 1)(_infer_swiglu)
def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for h = [gate | up] along the last dim (merged gate/up projection)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------- confidence head


def _infer_index_tokens(ts, attrs):
    h, select = ts
    _need(
        h.rank == 3 and select.rank == 1 and not select.is_float,
        "index_tokens",
        f"takes h [B, T, H] and integer select [M], got {h}, {select}",
    )
    return [h.with_shape(h.shape[0], select.shape[0], h.shape[2])]


@_register("index_tokens", 2)(_infer_index_tokens)
def index_tokens(h: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """The rows of h at token indices ``select`` (the positions whose predictions are needed)."""
    return h.index_select(1, select)


def _confidence_types(shape, acc) -> list[TensorType]:
    return [TensorType(shape, acc), TensorType(shape, torch.int64)]


def _infer_confidence(ts, attrs):
    logits = ts[0]
    _need(logits.is_float, "confidence", f"needs float logits, got {logits}")
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return _confidence_types(logits.shape[:-1], acc)


@_register("confidence", 1)(_infer_confidence)
def confidence(logits: torch.Tensor, *, banned: int, kind: str = "max") -> tuple[torch.Tensor, torch.Tensor]:
    """(score, argmax) over the vocabulary with token ``banned`` (the mask) excluded, in fp32
    (f64 when validating). ``kind``: "max" = top-1 probability, "margin" = top-1 minus top-2
    probability, "entropy" = negative entropy sum p log p (larger = more certain)."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(acc).clone()
    z[..., banned] = float("-inf")
    p = z.softmax(-1)
    top, token = p.max(-1)
    if kind == "max":
        return top, token
    if kind == "margin":
        return top - p.topk(2, dim=-1).values[..., 1], token
    if kind == "entropy":
        return (p * z.log_softmax(-1)).nan_to_num(0.0).sum(-1), token
    raise OpTypeError(f"confidence: unknown kind {kind!r} (max, margin, entropy)")


def _infer_lm_head_confidence(ts, attrs):
    (logits,) = _infer_linear(ts[:2], {})
    return _infer_confidence([logits], attrs)


@_register("lm_head_confidence", 2)(_infer_lm_head_confidence)
def lm_head_confidence(h: torch.Tensor, weight: torch.Tensor, *, banned: int, kind: str = "max", chunk: int = 8192):
    """Fused LM head + confidence; reference semantics = its decomposition
    ``confidence(linear(h, weight))``. Backends implement it without building the
    [positions x vocab] probabilities (the cpu backend's chunked kernel, the Triton kernel)."""
    return confidence(linear(h, weight), banned=banned, kind=kind)


# ---------------------------------------------------------------- attention with QK-norm and RoPE folded in


def _infer_rope_attention(ts, attrs):
    q, k, v, key_valid, token_index, positions, q_norm, k_norm, k_cache, v_cache = ts
    _infer_rope([q, positions], attrs)
    _infer_rope([k, positions], attrs)
    for w, x in ((q_norm, q), (k_norm, k)):
        if w is not None:
            _infer_rms_norm([x, w], {"eps": attrs["eps"]})
    _need((k_cache is None) == (v_cache is None), "rope_attention", "needs both caches or neither")
    core = [q, k, v, key_valid, token_index] + ([k_cache, v_cache] if k_cache is not None else [])
    return _infer_attention(core, attrs)


@_register("rope_attention", 10, mutates=(8, 9))(_infer_rope_attention)
def rope_attention(
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
    """Attention with per-head QK-norm (when the weights are given) and RoPE folded in; reference
    semantics = rms_norm -> rope on q and k, then ``attention`` (cache splice included)."""
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps=eps), rms_norm(k, k_norm, eps=eps)
    q = rope(q, positions, theta=theta, rotary_dim=rotary_dim)
    k = rope(k, positions, theta=theta, rotary_dim=rotary_dim)
    return attention(q, k, v, key_valid, token_index, k_cache, v_cache, scale=scale, block_size=block_size)


# ---------------------------------------------------------------- decoder-layer blocks


def _infer_attention_block(ts, attrs):
    x, w, b, key_valid, token_index, positions, q_norm, k_norm, k_cache, v_cache = ts
    (qkv,) = _infer_linear([x, w] + ([b] if b is not None else []), {})
    q, k, v = _infer_split([qkv], {"sizes": attrs["sizes"]})
    heads = [
        _infer_view_heads([t], {"heads": h})[0]
        for t, h in ((q, attrs["heads"]), (k, attrs["kv_heads"]), (v, attrs["kv_heads"]))
    ]
    out = _infer_rope_attention([*heads, key_valid, token_index, positions, q_norm, k_norm, k_cache, v_cache], attrs)
    return [_infer_merge_heads([out[0]], {})[0], *out[1:]]


@_register("attention_block", 10, mutates=(8, 9))(_infer_attention_block)
def attention_block(
    x,
    w_qkv,
    b_qkv,
    key_valid,
    token_index,
    positions,
    q_norm,
    k_norm,
    k_cache,
    v_cache,
    *,
    sizes: tuple[int, int, int],
    heads: int,
    kv_heads: int,
    scale: float,
    block_size: int | None,
    theta: float,
    rotary_dim: int,
    eps: float,
):
    """A layer's merged Q/K/V projection and its attention: reference semantics = ``linear`` ->
    ``split`` (``sizes``) -> ``view_heads`` (``heads``, ``kv_heads``) -> ``rope_attention`` ->
    ``merge_heads``; returns [B, T, heads * head_dim] (and the caches, aliased, when given)."""
    q, k, v = split(linear(x, w_qkv, b_qkv), sizes=sizes)
    q, k, v = view_heads(q, heads=heads), view_heads(k, heads=kv_heads), view_heads(v, heads=kv_heads)
    out = rope_attention(
        q, k, v, key_valid, token_index, positions, q_norm, k_norm, k_cache, v_cache,
        scale=scale, block_size=block_size, theta=theta, rotary_dim=rotary_dim, eps=eps,
    )  # fmt: skip
    if k_cache is None:
        return merge_heads(out)
    return merge_heads(out[0]), out[1], out[2]


def _infer_mlp_block(ts, attrs):
    attn, w_o, b_o, residual, w_norm, w_gate_up, w_down, w_out_norm = ts
    (proj,) = _infer_linear([attn, w_o] + ([b_o] if b_o is not None else []), {})
    normed, _ = _infer_add_rms_norm([residual, proj, w_norm], attrs)
    (h,) = _infer_swiglu(_infer_linear([normed, w_gate_up], {}), {})
    (down,) = _infer_linear([h, w_down], {})
    return _infer_add_rms_norm([residual, down, w_out_norm], attrs)


@_register("mlp_block", 8)(_infer_mlp_block)
def mlp_block(attn, w_o, b_o, residual, w_norm, w_gate_up, w_down, w_out_norm, *, eps: float):
    """The rest of a dense layer after attention: output projection, residual add + RMSNorm,
    SwiGLU MLP over the merged [gate | up] projection, residual add + the next RMSNorm. Reference
    semantics = ``linear`` -> ``add_rms_norm`` -> ``linear`` -> ``swiglu`` -> ``linear`` ->
    ``add_rms_norm``; returns (normed, residual stream) like ``add_rms_norm``."""
    normed, total = add_rms_norm(residual, linear(attn, w_o, b_o), w_norm, eps=eps)
    down = linear(swiglu(linear(normed, w_gate_up)), w_down)
    return add_rms_norm(total, down, w_out_norm, eps=eps)


# ---------------------------------------------------------------- MoE with routing folded in


def _infer_moe_routed(ts, attrs):
    x, router_w, bias, gate_up, down = ts
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    (logits,) = _infer_linear([x.with_dtype(acc), router_w], {})
    router = attrs["router"]
    if router == "softmax":
        w, idx = OPS["router_softmax_topk"].infer([logits], attrs)
    else:
        w, idx = OPS["router_sigmoid_grouped"].infer([logits, bias], attrs)
    return _infer_moe([x, w, idx, gate_up, down], {})


_ROUTER_ATTRS = {
    "softmax": ("k", "renormalize"),
    "sigmoid_grouped": ("k", "n_group", "topk_group", "renormalize", "scale"),
}


@_register("moe_routed", 5)(_infer_moe_routed)
def moe_routed(x, router_w, expert_bias, w_gate_up, w_down, *, router: str, **router_attrs):
    """MoE block with routing folded in: fp32 router logits, softmax top-k or group-limited sigmoid
    routing, then the chosen SwiGLU experts grouped by expert. Reference = the decomposition."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = linear(x.to(acc), router_w)
    attrs = {k: router_attrs[k] for k in _ROUTER_ATTRS[router]}
    if router == "softmax":
        w, idx = router_softmax_topk(logits, **attrs)
    else:
        w, idx = router_sigmoid_grouped(logits, expert_bias, **attrs)
    return moe_experts(x, w, idx, w_gate_up, w_down, first_expert=router_attrs.get("first_expert", 0))
