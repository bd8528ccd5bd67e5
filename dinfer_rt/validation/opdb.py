"""The op conformance database: sample inputs for every IR op and fused op over dtypes and
shape buckets, including edge shapes (size 1, non-powers of two, GQA ratios, masks, caches).

Each case builds float64 inputs from a seed; the backend runs them in the case's dtype and
the reference runs them in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

F64 = torch.float64


@dataclass(frozen=True)
class OpCase:
    op: str
    bucket: str  # shape bucket label, e.g. "gqa4-pad"
    build: Callable[[torch.Generator], list]  # float64 / integer / bool inputs (None for absent)
    attrs: dict = field(default_factory=dict)
    float_inputs: tuple[int, ...] = ()  # inputs converted to the tested dtype
    keep_fp32_inputs: tuple[int, ...] = ()  # inputs a model keeps in fp32 whatever the dtype (router bias)

    @property
    def key(self) -> str:
        return f"{self.op}/{self.bucket}"


def _r(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=F64) * scale


def _mixed_lengths(b: int, s: int, pad: int) -> torch.Tensor:
    """Key validity of a left-padded batch of mixed lengths: row 0 loses ``pad`` keys, row 1
    half as many, the rest none (so a kernel that ignores the mask, or applies one row's mask
    to every row, changes the result)."""
    valid = torch.ones(b, s, dtype=torch.bool)
    for row, n in enumerate((pad, pad // 2)[:b]):
        valid[row, :n] = False
    return valid


def _attention_case(bucket, b, t, s, h, kv, d, cached, block, pad):
    def build(g):
        q, k, v = _r(g, b, t, h, d), _r(g, b, t, kv, d), _r(g, b, t, kv, d)
        valid = _mixed_lengths(b, s, pad)
        idx = torch.arange(s - t, s) if cached else torch.arange(t)
        ins = [q, k, v, valid, idx]
        if cached:
            ins += [_r(g, b, s, kv, d), _r(g, b, s, kv, d)]
        return ins

    fl = (0, 1, 2, 5, 6) if cached else (0, 1, 2)
    return OpCase("attention", bucket, build, {"scale": 1 / math.sqrt(d), "block_size": block}, fl)


def _per_row_attention_case(bucket, b, t, s, h, kv, d, block):
    """Per-row query windows (token_index [B, T], continuous batching): each row writes and
    queries its own cache slots."""

    def build(g):
        q, k, v = _r(g, b, t, h, d), _r(g, b, t, kv, d), _r(g, b, t, kv, d)
        idx = torch.stack([torch.randperm(s, generator=g)[:t] for _ in range(b)])
        return [q, k, v, _mixed_lengths(b, s, 2), idx, _r(g, b, s, kv, d), _r(g, b, s, kv, d)]

    return OpCase("attention", bucket, build, {"scale": 1 / math.sqrt(d), "block_size": block}, (0, 1, 2, 5, 6))


def _paged_table(g, b: int, nbt: int, blocks: int) -> torch.Tensor:
    """A block table of ``b`` rows x ``nbt`` distinct pool blocks, drawn from 1..blocks-1 in a
    shuffled order (block 0 is the trash block): a kernel that reads or writes block ``p // P``
    of the pool instead of ``table[b, p // P]`` lands elsewhere."""
    order = torch.randperm(blocks - 1, generator=g)[: b * nbt] + 1
    return order.view(b, nbt).to(torch.int32)


def _kv_gather_case(bucket, b, s, size, kv, d):
    nbt = -(-s // size)
    blocks = b * nbt + 2

    def build(g):
        valid = _mixed_lengths(b, s, 2)
        return [_r(g, blocks, size, kv, d), _r(g, blocks, size, kv, d), _paged_table(g, b, nbt, blocks), valid]

    return OpCase("kv_gather", bucket, build, float_inputs=(0, 1))


def _kv_scatter_case(bucket, b, t, s, size, kv, d, per_row):
    nbt = -(-s // size)
    blocks = b * nbt + 2

    def build(g):
        if per_row:
            idx = torch.stack([torch.randperm(s, generator=g)[:t] for _ in range(b)])
        else:
            idx = torch.randperm(s, generator=g)[:t]
        pools = [_r(g, blocks, size, kv, d), _r(g, blocks, size, kv, d)]
        return [*pools, _paged_table(g, b, nbt, blocks), idx, _r(g, b, s, kv, d), _r(g, b, s, kv, d)]

    return OpCase("kv_scatter", bucket, build, float_inputs=(0, 1, 4, 5))


def cases(quick: bool = False) -> list[OpCase]:
    """Every op and fused op; ``quick`` keeps one or two buckets each."""
    c = [
        OpCase("add", "odd", lambda g: [_r(g, 3, 7, 5), _r(g, 3, 7, 5)], float_inputs=(0, 1)),
        OpCase("mul", "odd", lambda g: [_r(g, 3, 7, 5), _r(g, 3, 7, 5)], float_inputs=(0, 1)),
        OpCase("silu", "odd", lambda g: [_r(g, 2, 9, 33, scale=3)], float_inputs=(0,)),
        OpCase("cast", "to-f32", lambda g: [_r(g, 4, 6)], {"dtype": torch.float32}, float_inputs=(0,)),
        # one process: a group of one, whose all-reduce is the identity (multi-rank: tests/test_parallel.py)
        OpCase("all_reduce", "one-rank", lambda g: [_r(g, 2, 5, 8)], {"op": "sum"}, float_inputs=(0,)),
        OpCase("all_gather", "one-rank", lambda g: [_r(g, 2, 5, 8)], {"sizes": (8,)}, float_inputs=(0,)),
        OpCase(
            "vocab_parallel_confidence",
            "one-rank",
            lambda g: [_r(g, 2, 3, 16), _r(g, 37, 16, scale=0.5)],
            {"banned": 5, "kind": "margin"},
            float_inputs=(0, 1),
        ),
        OpCase(
            "embedding",
            "vocab-odd",
            lambda g: [torch.randint(0, 37, (2, 5), generator=g), _r(g, 37, 24)],
            float_inputs=(1,),
        ),
        OpCase(
            "linear",
            "bias-odd",
            lambda g: [_r(g, 2, 5, 48), _r(g, 33, 48, scale=0.15), _r(g, 33)],
            float_inputs=(0, 1, 2),
        ),
        OpCase("linear", "size1", lambda g: [_r(g, 1, 1, 16), _r(g, 8, 16, scale=0.25), None], float_inputs=(0, 1)),
        # the lowered graphs call linear without a bias input at all (two arguments, not None)
        OpCase("linear", "two-inputs", lambda g: [_r(g, 2, 3, 16), _r(g, 8, 16, scale=0.25)], float_inputs=(0, 1)),
        _linear_wq_case("int8-bias", "int8", bias=True),
        _linear_wq_case("fp8", "fp8", bias=False),
        OpCase("linear_gptq", "g16-act-order", _gptq_inputs, {"zero_offset": 1}, float_inputs=(0, 3)),
        OpCase(
            "rms_norm",
            "hidden-odd",
            lambda g: [_r(g, 2, 5, 56, scale=2), 1 + 0.1 * _r(g, 56)],
            {"eps": 1e-6},
            float_inputs=(0, 1),
        ),
        OpCase(
            "rms_norm",
            "per-head",
            lambda g: [_r(g, 2, 5, 3, 16), 1 + 0.1 * _r(g, 16)],
            {"eps": 1e-5},
            float_inputs=(0, 1),
        ),
        OpCase("view_heads", "7-heads", lambda g: [_r(g, 2, 3, 56)], {"heads": 7}, float_inputs=(0,)),
        OpCase("merge_heads", "7-heads", lambda g: [_r(g, 2, 3, 7, 8)], float_inputs=(0,)),
        OpCase("split", "qkv-gqa", lambda g: [_r(g, 2, 3, 96)], {"sizes": (64, 16, 16)}, float_inputs=(0,)),
        OpCase(
            "rope",
            "full",
            lambda g: [_r(g, 2, 9, 3, 16), torch.arange(9).expand(2, 9)],
            {"theta": 500000.0, "rotary_dim": 16},
            float_inputs=(0,),
        ),
        OpCase(
            "rope",
            "partial-long",
            lambda g: [_r(g, 1, 300, 2, 16), torch.arange(300)[None] + 1000],
            {"theta": 600000.0, "rotary_dim": 8},
            float_inputs=(0,),
        ),
        _attention_case("mha", 2, 7, 7, 4, 4, 16, False, None, 0),
        _attention_case("gqa4-pad", 2, 9, 9, 8, 2, 16, False, None, 3),
        _attention_case("gqa8-blockcausal", 1, 12, 12, 8, 1, 8, False, 4, 0),
        _attention_case("cache-splice-gqa", 2, 4, 11, 4, 2, 16, True, None, 2),
        _attention_case("cache-blockcausal", 1, 4, 12, 4, 4, 8, True, 4, 0),
        _attention_case("blockcausal-pad", 2, 12, 12, 4, 2, 8, False, 4, 5),
        _attention_case("cache-blockcausal-pad", 2, 4, 12, 4, 2, 8, True, 4, 6),
        _per_row_attention_case("per-row-cache-gqa", 3, 5, 13, 4, 2, 16, None),
        _per_row_attention_case("per-row-cache-blockcausal", 2, 6, 12, 4, 4, 8, 4),
        # the paged KV pool of the serving engine: gather, attention on the copy, scatter back
        _kv_gather_case("cache-pool-gqa-partial-block", 2, 10, 4, 2, 8),
        _kv_scatter_case("cache-pool-shared-slots", 2, 3, 10, 4, 2, 8, per_row=False),
        _kv_scatter_case("cache-pool-per-row-slots", 3, 4, 11, 4, 2, 8, per_row=True),
        OpCase(
            "router_softmax_topk",
            "e6k2",
            lambda g: [_r(g, 2, 5, 6, scale=2)],
            {"k": 2, "renormalize": False},
            float_inputs=(0,),
        ),
        OpCase(
            "router_sigmoid_grouped",
            "e8g4",
            lambda g: [_r(g, 2, 5, 8, scale=2), 0.1 * _r(g, 8)],
            {"k": 3, "n_group": 4, "topk_group": 2, "renormalize": True, "scale": 2.5},
            float_inputs=(0,),
            keep_fp32_inputs=(1,),
        ),
        OpCase("moe_experts", "e6k2", _moe_inputs, float_inputs=(0, 3, 4), keep_fp32_inputs=(1,)),
        OpCase(  # expert parallelism: this rank holds experts 3..5 of 6, routing ids stay global
            "moe_experts",
            "expert-parallel-e3of6",
            _moe_expert_parallel_inputs,
            {"first_expert": 3},
            float_inputs=(0, 3, 4),
            keep_fp32_inputs=(1,),
        ),
        OpCase(
            "add_rms_norm",
            "hidden-odd",
            lambda g: [_r(g, 2, 5, 40), _r(g, 2, 5, 40), 1 + 0.1 * _r(g, 40)],
            {"eps": 1e-6},
            float_inputs=(0, 1, 2),
        ),
        OpCase("swiglu", "odd", lambda g: [_r(g, 2, 5, 2 * 37, scale=2)], float_inputs=(0,)),
        OpCase("index_tokens", "subset", lambda g: [_r(g, 2, 9, 24), torch.tensor([0, 3, 8])], float_inputs=(0,)),
        OpCase("confidence", "vocab-odd", lambda g: [_r(g, 2, 5, 1001, scale=3)], {"banned": 7}, float_inputs=(0,)),
        *(
            OpCase("confidence", kind, lambda g: [_r(g, 2, 5, 301, scale=3)], {"banned": 7, "kind": kind}, (0,))
            for kind in ("margin", "entropy")
        ),
        OpCase(
            "lm_head_confidence",
            "vocab-not-chunk-multiple",
            lambda g: [_r(g, 2, 5, 48), _r(g, 20011, 48)],
            {"banned": 17, "chunk": 4096},
            float_inputs=(0, 1),
        ),
        *(
            OpCase(
                "lm_head_confidence",
                f"{kind}-chunked",
                lambda g: [_r(g, 2, 5, 48), _r(g, 3001, 48)],
                {"banned": 17, "chunk": 1000, "kind": kind},
                float_inputs=(0, 1),
            )
            for kind in ("entropy", "margin")
        ),
        _rope_attention_case("qknorm-partial-cache", norms=True, cached=True, theta=600000.0, rotary_dim=8),
        _rope_attention_case("plain-blockcausal", norms=False, cached=False, block=4),
        _rope_attention_case("qknorm-pad", norms=True, cached=False, pad=3, theta=600000.0, rotary_dim=8),
        _rope_attention_case("cache-splice-pad", norms=False, cached=True, pad=4),
        _rope_attention_case("blockcausal-cache-pad", True, True, pad=4, block=4, theta=600000.0, rotary_dim=8),
        _attention_block_case("bias-qknorm-cache-pad", bias=True, norms=True, cached=True, pad=4, rotary_dim=8),
        _attention_block_case("gqa-pad", bias=False, norms=False, cached=False, pad=3),
        _attention_block_case("blockcausal-cache", bias=False, norms=False, cached=True, block=4),
        OpCase("mlp_block", "bias-odd", _mlp_block_inputs(bias=True), {"eps": 1e-6}, (0, 1, 2, 3, 4, 5, 6, 7)),
        OpCase("mlp_block", "rows-1", _mlp_block_inputs(bias=False, rows=1), {"eps": 1e-5}, (0, 1, 3, 4, 5, 6, 7)),
        OpCase(
            "moe_routed",
            "softmax-e6k2",
            _moe_routed_inputs(False),
            {"router": "softmax", "k": 2, "renormalize": False},
            float_inputs=(0, 3, 4),
            keep_fp32_inputs=(1,),
        ),
        OpCase(
            "moe_routed",
            "sigmoid-grouped-e8",
            _moe_routed_inputs(True),
            {"router": "sigmoid_grouped", "k": 3, "n_group": 4, "topk_group": 2, "renormalize": True, "scale": 2.5},
            float_inputs=(0, 3, 4),
            keep_fp32_inputs=(1, 2),
        ),
    ]
    if not quick:
        return c
    kept, seen = [], set()
    for case in c:  # quick: the first bucket of each op, plus every padded or cache-splicing attention,
        # plus every call form the lowered graphs use (linear with two inputs)
        if case.op not in seen or "pad" in case.bucket or "cache" in case.bucket or case.bucket == "two-inputs":
            kept.append(case)
            seen.add(case.op)
    return kept


def _moe_inputs(g):
    x = _r(g, 2, 5, 24)
    w, idx = (
        torch.rand(2, 5, 2, generator=g, dtype=F64),
        torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(10)]).view(2, 5, 2),
    )
    return [x, w, idx, _r(g, 6, 2 * 12, 24, scale=0.2), _r(g, 6, 24, 12, scale=0.3)]


def _moe_expert_parallel_inputs(g):
    x, w, idx, gate_up, down = _moe_inputs(g)
    return [x, w, idx, gate_up[3:], down[3:]]


def _rope_attention_case(
    bucket: str,
    norms: bool,
    cached: bool,
    pad: int = 0,
    block: int | None = None,
    theta: float = 10000.0,
    rotary_dim: int = 16,
) -> OpCase:
    """rope_attention (head_dim 16, GQA 2) with or without QK-norm, KV cache, padding, blocks."""
    attrs = {"scale": 0.25, "block_size": block, "theta": theta, "rotary_dim": rotary_dim, "eps": 1e-6}
    floats = (0, 1, 2) + ((6, 7) if norms else ()) + ((8, 9) if cached else ())
    return OpCase(
        "rope_attention", bucket, _rope_attention_inputs(norms, cached, pad, block is not None), attrs, floats
    )


def _rope_attention_inputs(norms: bool, cached: bool, pad: int = 0, block: bool = False):
    def build(g):
        b, t, s, h, kv, d = 2, 4, 12 if block else 9, 4, 2, 16
        ins = [
            _r(g, b, t, h, d),
            _r(g, b, t, kv, d),
            _r(g, b, t, kv, d),
            _mixed_lengths(b, s if cached else t, pad),
            torch.arange(s - t, s) if cached else torch.arange(t),
            (torch.arange(s - t, s) if cached else torch.arange(t)).expand(b, t),
        ]
        ins += [1 + 0.1 * _r(g, d), 1 + 0.1 * _r(g, d)] if norms else [None, None]
        ins += [_r(g, b, s, kv, d), _r(g, b, s, kv, d)] if cached else [None, None]
        return ins

    return build


def _attention_block_case(
    bucket: str, bias: bool, norms: bool, cached: bool, pad: int = 0, block: int | None = None, rotary_dim: int = 16
) -> OpCase:
    """attention_block: x [2, 4, 40] through a merged Q/K/V projection (4 heads of 16, GQA 2),
    then rope_attention's cases (QK-norm, cache, padding, blocks)."""
    sizes = (64, 32, 32)
    attrs = {
        "sizes": sizes, "heads": 4, "kv_heads": 2, "scale": 0.25, "block_size": block, "theta": 10000.0,
        "rotary_dim": rotary_dim, "eps": 1e-6,
    }  # fmt: skip
    attention = _rope_attention_inputs(norms, cached, pad, block is not None)

    def build(g):
        rest = attention(g)[3:]  # key_valid, token_index, positions, q/k norms, caches
        x, w = _r(g, 2, 4, 40), _r(g, sum(sizes), 40, scale=40**-0.5)
        return [x, w, _r(g, sum(sizes)) if bias else None, *rest]

    floats = (0, 1) + ((2,) if bias else ()) + ((6, 7) if norms else ()) + ((8, 9) if cached else ())
    return OpCase("attention_block", bucket, build, attrs, floats)


def _mlp_block_inputs(bias: bool, rows: int = 5):
    """mlp_block: attention output [2, rows, 36] -> o-proj to 40, SwiGLU over 2 x 52 hidden."""

    def build(g):
        return [
            _r(g, 2, rows, 36),
            _r(g, 40, 36, scale=36**-0.5),
            _r(g, 40) if bias else None,
            _r(g, 2, rows, 40),
            1 + 0.1 * _r(g, 40),
            _r(g, 2 * 52, 40, scale=40**-0.5),
            _r(g, 40, 52, scale=52**-0.5),
            1 + 0.1 * _r(g, 40),
        ]

    return build


def _moe_routed_inputs(grouped: bool):
    def build(g):
        e = 8 if grouped else 6
        return [
            _r(g, 2, 5, 24),
            _r(g, e, 24, scale=0.3),
            0.1 * _r(g, e) if grouped else None,
            _r(g, e, 2 * 12, 24, scale=0.2),
            _r(g, e, 24, 12, scale=0.3),
        ]

    return build


def _linear_wq_case(bucket: str, fmt: str, bias: bool) -> OpCase:
    """Weight-only quantised linear: the quantised weight and its fp32 scale are exact inputs (the
    reference dequantises them in float64), so only the activations carry the tested dtype."""
    from dinfer_rt.quant import quantize

    def build(g):
        q, scale = quantize(_r(g, 40, 48, scale=0.2), fmt)
        return [_r(g, 2, 5, 48), q, scale, _r(g, 40) if bias else None]

    return OpCase("linear_wq", bucket, build, float_inputs=(0, 3), keep_fp32_inputs=(2,))


def _gptq_inputs(g):
    """A GPTQ 4-bit layer, in 48 -> 16, group 16, with act-order (a permuted g_idx)."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (48 // 8, 16), generator=g, dtype=torch.int32)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (3, 16 // 8), generator=g, dtype=torch.int32)
    scales = 0.01 + 0.02 * torch.rand(3, 16, generator=g, dtype=F64)
    g_idx = (torch.arange(48) // 16)[torch.randperm(48, generator=g)].to(torch.int32)
    return [_r(g, 2, 5, 48), qweight, qzeros, scales, g_idx, None]
