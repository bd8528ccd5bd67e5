"""IR ops -> torch_npu fused operators (signatures and sources: docs/backends/ascend.md).

Each wrapper has its IR op's reference signature. Conventions are written next to each call:
layouts, mask polarity, scale. An op whose documented constraints a call does not meet (say the
grouped router outside Atlas A2's 256-expert shape) runs the IR reference instead, and the
backend records that with the reason (``AscendBackend.constraint_fallbacks``), never silently.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dinfer_rt.ir import ops

ATTENTION_LAYOUT = "BNSD"  # q/k/v handed over as [B, N, S, D], contiguous (the op rejects strided input)
MASK_TRUE_MEANS_MASKED = True  # atten_mask: True = the position does not take part
GROUP_SELECT_TOP2_SUM = 1  # npu_moe_gating_top_k group_select_mode: rank groups by their top-2 sum


def make_kernels(npu, fallback: Callable[[str, str], None], vector_cores: int, interpret: bool) -> dict[str, Callable]:
    """IR op -> wrapper over the torch_npu module ``npu`` (real or simulated). Ops whose
    operator ``npu`` lacks (``hasattr``) are left out and take the counted reference fallback."""
    k: dict[str, Callable] = {}

    def has(name: str) -> bool:
        return hasattr(npu, name)

    if has("npu_rms_norm"):

        def rms_norm(x, weight, *, eps):
            return npu.npu_rms_norm(x, weight, epsilon=eps)[0]  # -> (y, rstd)

        k["rms_norm"] = rms_norm

    if has("npu_add_rms_norm"):

        def add_rms_norm(x, residual, weight, *, eps):
            y, _rstd, summed = npu.npu_add_rms_norm(x, residual, weight, eps)  # -> (y, rstd, x1 + x2)
            return y, summed

        k["add_rms_norm"] = add_rms_norm

    if has("npu_rotary_mul"):

        def rope(x, positions, *, theta, rotary_dim):
            # x is [B, S, N, D] (BSND); cos/sin [B, S, 1, rotary_dim] broadcast over heads. Half-split
            # ("half" mode) as the IR; rotated in fp32 like the reference, the rest passes through.
            cos, sin = ops.rope_angles(positions, rotary_dim, theta)
            rotated = npu.npu_rotary_mul(x[..., :rotary_dim].float().contiguous(), cos, sin)
            return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)

        k["rope"] = rope

    if has("npu_swiglu"):

        def swiglu(h):
            return npu.npu_swiglu(h.contiguous(), dim=-1)  # A (first half) = gate, B (second) = up

        k["swiglu"] = swiglu

    if has("npu_fused_infer_attention_score") and has("npu_fusion_attention"):

        def attention(q, key, value, key_valid, token_index, k_cache=None, v_cache=None, *, scale, block_size=None):
            keys, values, key_index = ops.splice_kv(key, value, token_index, k_cache, v_cache)
            allowed = ops.attention_mask(key_valid, token_index, key_index, block_size)
            allowed = allowed.expand(q.shape[0], 1, q.shape[1], keys.shape[1]).contiguous()  # B1SS, as documented
            mask = ~allowed if MASK_TRUE_MEANS_MASKED else allowed
            qkv = [t.transpose(1, 2).contiguous() for t in (q, keys, values)]  # BNSD
            if q.dtype == torch.float32:  # the inference operator takes fp16/bf16/int8 only
                out = npu.npu_fusion_attention(*qkv, q.shape[2], ATTENTION_LAYOUT, atten_mask=mask, scale=scale)[
                    0
                ]  # -> (out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)
            else:
                out, _lse = npu.npu_fused_infer_attention_score(
                    *qkv,
                    atten_mask=mask,
                    num_heads=q.shape[2],
                    num_key_value_heads=keys.shape[2],
                    scale=scale,
                    input_layout=ATTENTION_LAYOUT,
                )
            out = out.transpose(1, 2)
            return (out, k_cache, v_cache) if k_cache is not None else out

        k["attention"] = attention

    if has("npu_moe_gating_top_k_softmax"):

        def router_softmax_topk(logits, *, k, renormalize):
            w, idx, _row_idx = npu.npu_moe_gating_top_k_softmax(logits, None, k=k)
            w = w.float()  # the operator returns the activation dtype; the IR's router weights are float32
            if renormalize:
                w = w / w.sum(-1, keepdim=True)
            return w, idx.long()

        k["router_softmax_topk"] = router_softmax_topk

    if has("npu_moe_gating_top_k"):

        def router_sigmoid_grouped(logits, bias, *, k, n_group, topk_group, renormalize, scale):
            experts = logits.shape[-1]
            if experts != 256 or topk_group != 4 or not 1 <= k <= 32 or not renormalize:
                fallback(
                    "router_sigmoid_grouped", "npu_moe_gating_top_k on Atlas A2 takes 256 experts, k_group 4, k<=32"
                )
                return ops.router_sigmoid_grouped(
                    logits, bias, k=k, n_group=n_group, topk_group=topk_group, renormalize=renormalize, scale=scale
                )
            flat = logits.reshape(-1, experts)
            w, idx, _ = npu.npu_moe_gating_top_k(
                flat,
                k,
                bias=bias.to(flat.dtype),
                k_group=topk_group,
                group_count=n_group,
                group_select_mode=GROUP_SELECT_TOP2_SUM,
                renorm=0,
                norm_type=1,  # sigmoid scores
                routed_scaling_factor=scale,  # y = score / sum * factor: renormalised, then scaled
                eps=1e-20,
            )
            shape = (*logits.shape[:-1], k)
            return w.float().reshape(shape), idx.long().reshape(shape)

        k["router_sigmoid_grouped"] = router_sigmoid_grouped

    if all(has(n) for n in ("npu_moe_init_routing", "npu_grouped_matmul", "npu_moe_finalize_routing", "npu_swiglu")):

        def moe_experts(x, weights, indices, w_gate_up, w_down, *, first_expert=0):
            n_exp, hidden = w_gate_up.shape[0], x.shape[-1]
            weights, indices = ops.local_routing(weights, indices, first_expert, n_exp)  # expert parallelism
            if n_exp > 128:  # npu_grouped_matmul takes at most 128 weights per call
                fallback("moe_experts", f"npu_grouped_matmul takes <= 128 groups, the model has {n_exp} experts")
                return ops.moe_experts(x, weights, indices, w_gate_up, w_down)  # already local
            flat = x.reshape(-1, hidden)
            rows, top = flat.shape[0], indices.shape[-1]
            expert = indices.reshape(rows, top).to(torch.int32)
            # row_idx as npu_moe_gating_top_k_softmax returns it: slot (r, j) -> r + j * rows
            row_idx = (torch.arange(rows)[:, None] + torch.arange(top)[None, :] * rows).to(torch.int32).to(x.device)
            ex, ex_row, _ = npu.npu_moe_init_routing(flat, row_idx, expert, rows)
            # group_list: cumulative row ends per expert (a host int list in the documented signature)
            ends = torch.bincount(expert.flatten().long(), minlength=n_exp).cumsum(0).tolist()
            # weights are [E, out, in]: the operator takes [K, N] = transposed views
            gu = npu.npu_grouped_matmul([ex], [w.t() for w in w_gate_up], group_list=ends, split_item=3)[0]
            h = npu.npu_swiglu(gu, dim=-1)
            y = npu.npu_grouped_matmul([h], [w.t() for w in w_down], group_list=ends, split_item=3)[0]
            scales = weights.reshape(rows, top).to(y.dtype)  # the operator wants the rows' dtype
            out = npu.npu_moe_finalize_routing(y, None, None, None, scales, ex_row, expert, 0)
            return out.reshape(x.shape)

        k["moe_experts"] = moe_experts

    if has("npu_weight_quant_batchmatmul"):

        def linear_wq(x, qweight, scale, bias=None):
            # x (M, K) fp16/bf16; weight (K, N) int8: the [N, K] weight's transposed view, as the
            # documentation recommends for per-channel scales; antiquant_scale (N,) in x's dtype.
            if x.dtype not in (torch.float16, torch.bfloat16) or qweight.dtype != torch.int8:
                fallback("linear_wq", f"npu_weight_quant_batchmatmul takes fp16/bf16 x and int8 weights, got {x.dtype}")
                return ops.linear_wq(x, qweight, scale, bias)
            flat = x.reshape(-1, x.shape[-1])
            y = npu.npu_weight_quant_batchmatmul(flat, qweight.t(), scale.to(x.dtype), bias=bias)
            return y.reshape(*x.shape[:-1], qweight.shape[0])

        k["linear_wq"] = linear_wq

    k.update(_triton_kernels(vector_cores, interpret))
    return k


def triton_usable(interpret: bool) -> bool:
    """Whether a Triton that can run the triton-ascend kernels is present: triton-ascend's
    Ascend backend, or the interpreter."""
    try:
        import triton
    except ImportError:
        return False
    return interpret or "ascend" in getattr(triton.backends, "backends", {})


def _triton_kernels(vector_cores: int, interpret: bool) -> dict[str, Callable]:
    """The shared Triton confidence kernel under Ascend's launch rules when ``triton_usable``;
    else none, and the op takes the fallback."""
    if not triton_usable(interpret):
        return {}
    import functools

    from dinfer_rt.backends.ascend.launch import launch_config
    from dinfer_rt.backends.triton.ops import confidence

    def launch(vocab: int, elem_bytes: int, rows: int) -> dict:
        return launch_config(vocab, elem_bytes, vector_cores, rows)

    return {"confidence": functools.partial(confidence, launch=launch)}
