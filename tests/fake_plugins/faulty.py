"""Backends with one subtly wrong kernel each (copies of the cpu backend's kernels with one fault
planted): the validation suite must catch every one and name the op."""

import torch
import torch.nn.functional as F

from dinfer_rt.backends.cpu.backend import CpuBackend
from dinfer_rt.ir import ops
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


def rms_norm_eps_off(x, weight, *, eps):
    return ops.rms_norm(x, weight, eps=eps + 1e-3)


def rope_wrong_way(x, positions, *, theta, rotary_dim):
    return ops.rope(x, -positions, theta=theta, rotary_dim=rotary_dim)  # rotates by -angle


def attention_ignores_padding(q, k, v, key_valid, token_index, k_cache=None, v_cache=None, *, scale, block_size=None):
    return ops.attention(
        q, k, v, torch.ones_like(key_valid), token_index, k_cache, v_cache, scale=scale, block_size=block_size
    )


def rope_attention_ignores_padding(q, k, v, key_valid, token_index, positions, *rest, **attrs):
    return ops.rope_attention(q, k, v, torch.ones_like(key_valid), token_index, positions, *rest, **attrs)


def attention_mask_swapped(q, k, v, key_valid, token_index, k_cache=None, v_cache=None, *, scale, block_size=None):
    """Bidirectional <-> causal: block-causal graphs attend everywhere, bidirectional ones causally."""
    swapped = 1 if block_size is None else None
    return ops.attention(q, k, v, key_valid, token_index, k_cache, v_cache, scale=scale, block_size=swapped)


def attention_splice_off_by_one(q, k, v, key_valid, token_index, k_cache=None, v_cache=None, *, scale, block_size=None):
    """Splices the fresh K/V one cache slot too far (clamped at the end of the cache)."""
    if k_cache is not None:
        token_index = (token_index + 1).clamp_max(k_cache.shape[1] - 1)
    return ops.attention(q, k, v, key_valid, token_index, k_cache, v_cache, scale=scale, block_size=block_size)


def attention_gqa_tiled(q, k, v, key_valid, token_index, k_cache=None, v_cache=None, *, scale, block_size=None):
    """Maps query head h to KV head h % KV instead of h // groups."""
    keys, values, key_index = ops.splice_kv(k, v, token_index, k_cache, v_cache)
    mask = ops.attention_mask(key_valid, token_index, key_index, block_size)
    groups = q.shape[2] // keys.shape[2]
    kh, vh = keys.transpose(1, 2).repeat(1, groups, 1, 1), values.transpose(1, 2).repeat(1, groups, 1, 1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, attn_mask=mask, scale=scale).transpose(1, 2)
    return (out, k_cache, v_cache) if k_cache is not None else out


def router_topk_off_by_one(logits, *, k, renormalize):
    """Takes ranks 2..k+1 instead of 1..k (the best expert is dropped)."""
    probs = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32).softmax(-1)
    w, idx = probs.topk(min(k + 1, probs.shape[-1]), dim=-1)
    w, idx = w[..., -k:], idx[..., -k:]
    return (w / w.sum(-1, keepdim=True) if renormalize else w), idx


def confidence_scaled(logits, *, banned, kind="max"):
    score, token = ops.confidence(logits, banned=banned, kind=kind)
    return score * (1 + 1e-3), token


def kv_gather_ignores_the_table(k_pool, v_pool, block_table, key_valid):
    """Reads each row's blocks in the pool's own order (1, 2, ...) instead of its block table's."""
    own = torch.arange(1, block_table.shape[1] + 1, dtype=block_table.dtype).expand_as(block_table)
    return ops.kv_gather(k_pool, v_pool, own, key_valid)


def kv_scatter_one_slot_late(k_pool, v_pool, block_table, token_index, k_cache, v_cache):
    """Writes each computed slot into the pool position after it (clamped at the row's end)."""
    late = (token_index + 1).clamp_max(k_cache.shape[1] - 1)
    ops.scatter_pages(k_pool, block_table, late, k_cache.roll(1, dims=1))  # slot s + 1 gets slot s's K/V
    ops.scatter_pages(v_pool, block_table, late, v_cache.roll(1, dims=1))
    return k_pool, v_pool


LAYER_BLOCKS = {"attention_block", "mlp_block"}  # composites of the other fused ops: they would hide a planted one
FUSED_OPS = {"add_rms_norm", "swiglu", "lm_head_confidence", "rope_attention", "moe_routed"} | LAYER_BLOCKS


def _faulty(name, op, kernel, keep_fused: bool):
    class Faulty(CpuBackend):
        flavour = "faulty"
        priority = -5

        def kernels(self):
            # A port without fused kernels (unless the fault is in one): no fusion applies, so the
            # faulty unfused kernel is the one the model runs.
            base = super().kernels()
            dropped = LAYER_BLOCKS if keep_fused else FUSED_OPS
            unfused = {k: v for k, v in base.items() if k not in dropped}
            return {**unfused, op: kernel}

    Faulty.name = name
    return Faulty


# backend name -> (op, planted kernel, keep the fused kernels)
FAULTS = {
    "faulty_norm": ("rms_norm", rms_norm_eps_off, False),
    "faulty_rope": ("rope", rope_wrong_way, False),
    "faulty_attention": ("attention", attention_ignores_padding, False),
    "faulty_rope_attention": ("rope_attention", rope_attention_ignores_padding, True),
    "faulty_mask_swap": ("attention", attention_mask_swapped, False),
    "faulty_splice": ("attention", attention_splice_off_by_one, False),
    "faulty_gqa": ("attention", attention_gqa_tiled, False),
    "faulty_router": ("router_softmax_topk", router_topk_off_by_one, False),
    "faulty_confidence": ("confidence", confidence_scaled, False),
    "faulty_kv_gather": ("kv_gather", kv_gather_ignores_the_table, False),
    "faulty_kv_scatter": ("kv_scatter", kv_scatter_one_slot_late, False),
}


@hookimpl
def dinfer_rt_register_backends():
    return [_faulty(name, op, k, keep) for name, (op, k, keep) in FAULTS.items()]
