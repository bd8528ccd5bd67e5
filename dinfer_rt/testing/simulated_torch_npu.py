"""A simulated ``torch_npu`` for tests on machines without an NPU: exactly the operators the
``ascend`` backend calls, with the documented signatures and argument conventions, computed on
the CPU in plain torch. It checks what the documentation constrains (layout letters, mask
dtype and polarity, shapes, dtypes) and raises like a real op would, so a lowering that gets a
convention wrong fails a test. This checks the lowering against the documented contract, not
the hardware: numerics, performance and undocumented behaviour of the real ops are untested.

Install with ``install(monkeypatch)`` (or put the module in ``sys.modules["torch_npu"]``).
Sources of each signature are listed in docs/backends/ascend.md.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

__version__ = "simulated"
SIMULATED = True


def _need(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"{op}: {msg}")


def _float16ish(op: str, *ts: torch.Tensor, allow_fp32: bool = True) -> None:
    ok = (torch.float16, torch.bfloat16) + ((torch.float32,) if allow_fp32 else ())
    for t in ts:
        _need(t.dtype in ok, op, f"dtype {t.dtype} not supported (supports {', '.join(map(str, ok))})")


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (y, rstd); rstd is fp32 (RmsNorm IR: OUTPUT rstd DT_FLOAT)."""
    _float16ish("npu_rms_norm", self, gamma)
    _need(gamma.dtype == self.dtype, "npu_rms_norm", "gamma must have self's dtype")
    _need(
        self.shape[-gamma.dim() :] == gamma.shape, "npu_rms_norm", f"gamma {tuple(gamma.shape)} vs {tuple(self.shape)}"
    )
    x = self.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return ((x * rstd).to(self.dtype) * gamma).to(self.dtype), rstd


def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (y, rstd, x) with x = x1 + x2 and y = rms_norm(x) * gamma (op-plugin test reference)."""
    _need(x1.shape == x2.shape and x1.dtype == x2.dtype, "npu_add_rms_norm", "x1 and x2 must match")
    x = x1 + x2
    y, rstd = npu_rms_norm(x, gamma, epsilon)
    return y, rstd, x


def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """half mode: output = r1 * x + r2 * cat(-x2, x1) with (x1, x2) = chunk(x, 2, -1); 4-D
    inputs, r1/r2 broadcast to x (layouts BNSD / BSND / SBND)."""
    _need(rotary_mode in ("half", "interleave"), "npu_rotary_mul", f"rotary_mode {rotary_mode!r}")
    _need(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul", "inputs must be 4-D")
    _need(input.shape[-1] % 2 == 0 and input.shape[-1] < 896, "npu_rotary_mul", f"D={input.shape[-1]}")
    _need(r1.shape == r2.shape and r1.shape[-1] == input.shape[-1], "npu_rotary_mul", "r1/r2 must match input's D")
    for a, b in zip(r1.shape, input.shape):
        _need(a in (1, b), "npu_rotary_mul", f"r1 {tuple(r1.shape)} does not broadcast to {tuple(input.shape)}")
    _float16ish("npu_rotary_mul", input, r1, r2)
    if rotary_mode == "half":
        x1, x2 = input.chunk(2, -1)
        rotated = torch.cat((-x2, x1), -1)
    else:
        rotated = torch.stack((-input[..., 1::2], input[..., ::2]), -1).flatten(-2)
    return r1 * input + r2 * rotated


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """swish(A) * B with A the first half of ``input`` along ``dim``, B the second."""
    _float16ish("npu_swiglu", input)
    _need(input.shape[dim] % 2 == 0, "npu_swiglu", f"dim {dim} of {tuple(input.shape)} must be even")
    a, b = input.chunk(2, dim)
    return (F.silu(a.float()) * b.float()).to(input.dtype)


_LAYOUTS = ("BSH", "BSND", "BNSD")


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift=None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    softmax_lse_flag: bool = False,
    **unsupported,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt/incremental flash attention -> (attention_out, softmax_lse). ``atten_mask`` is
    bool with True = masked out (does not take part), shaped [B, 1, Sq, Skv] / [B, Sq, Skv] /
    [Sq, Skv]; ``num_key_value_heads`` 0 means num_heads (GQA when smaller); fp16/bf16 only."""
    op = "npu_fused_infer_attention_score"
    _need(not unsupported, op, f"arguments not simulated: {sorted(unsupported)}")
    _need(input_layout in _LAYOUTS, op, f"input_layout {input_layout!r} not one of {_LAYOUTS}")
    _float16ish(op, query, key, value, allow_fp32=False)
    _need(sparse_mode == 0 and pse_shift is None, op, "only sparse_mode=0 without pse is simulated")
    out = _attend(query, key, value, atten_mask, num_heads, num_key_value_heads or num_heads, scale, input_layout, op)
    return out, torch.empty(0)


def _attend(query, key, value, atten_mask, num_heads, kv_heads, scale, input_layout, op):
    """Reference math for both attention operators, honouring the layout letters and the mask
    polarity (True = masked out); outputs in the query's layout and dtype."""
    _need(num_heads % kv_heads == 0, op, f"num_heads {num_heads} not a multiple of {kv_heads}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _need(t.is_contiguous(), op, f"{name} must be contiguous")

    def to_bnsd(t, heads):
        if input_layout == "BNSD":
            _need(t.dim() == 4 and t.shape[1] == heads, op, f"BNSD tensor {tuple(t.shape)} lacks N={heads}")
            return t
        if input_layout == "BSND":
            _need(t.dim() == 4 and t.shape[2] == heads, op, f"BSND tensor {tuple(t.shape)} lacks N={heads}")
            return t.transpose(1, 2)
        _need(t.dim() == 3 and t.shape[2] % heads == 0, op, f"BSH tensor {tuple(t.shape)} vs N={heads}")
        return t.unflatten(2, (heads, t.shape[2] // heads)).transpose(1, 2)

    q, k, v = to_bnsd(query, num_heads), to_bnsd(key, kv_heads), to_bnsd(value, kv_heads)
    _need(k.shape == v.shape and q.shape[-1] == k.shape[-1] and q.shape[0] == k.shape[0], op, "q/k/v disagree")
    rep = num_heads // kv_heads
    scores = torch.matmul(q.float(), k.float().repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    if atten_mask is not None:
        _need(atten_mask.dtype in (torch.bool, torch.uint8, torch.int8), op, f"atten_mask dtype {atten_mask.dtype}")
        m = atten_mask.bool()
        if m.dim() == 3:
            m = m[:, None]
        _need(
            m.dim() in (2, 4) and m.shape[-2:] == scores.shape[-2:],
            op,
            f"atten_mask {tuple(atten_mask.shape)} vs scores {tuple(scores.shape)}",
        )
        scores = scores.masked_fill(m, float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)
    out = torch.matmul(probs, v.float().repeat_interleave(rep, 1)).to(query.dtype)
    if input_layout == "BSND":
        return out.transpose(1, 2)
    if input_layout == "BSH":
        return out.transpose(1, 2).flatten(2)
    return out


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse=None,
    padding_mask=None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
) -> tuple:
    """Training flash attention -> (attention_out, softmax_max, softmax_sum, softmax_out, seed,
    offset, numels); fp32 accepted; atten_mask True (1) = masked; key/value heads may divide
    head_num (GQA). Simulated: keep_prob 1, sparse_mode 0, no pse / padding_mask."""
    op = "npu_fusion_attention"
    _need(keep_prob == 1.0 and pse is None and padding_mask is None and sparse_mode == 0, op, "not simulated")
    _need(input_layout in _LAYOUTS, op, f"input_layout {input_layout!r} not one of {_LAYOUTS}")
    _float16ish(op, query, key, value)
    kv_heads = key.shape[1] if input_layout == "BNSD" else key.shape[2] if input_layout == "BSND" else None
    if kv_heads is None:  # BSH: key heads from the hidden size ratio
        kv_heads = head_num * key.shape[2] // query.shape[2]
    out = _attend(query, key, value, atten_mask, head_num, kv_heads, scale, input_layout, op)
    return out, None, None, None, 0, 0, 0


def npu_moe_gating_top_k_softmax(
    x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax over experts, top-k -> (y, expert_idx int32, row_idx int32); y has x's dtype;
    rows with finished=True get expert index = num_experts."""
    op = "npu_moe_gating_top_k_softmax"
    _need(x.dim() in (2, 3), op, f"x must be 2-D/3-D, got {tuple(x.shape)}")
    _need(0 < k <= min(x.shape[-1], 1024), op, f"k={k}")
    _float16ish(op, x)
    y, idx = x.float().softmax(-1).topk(k, -1)
    idx = idx.to(torch.int32)
    if finished is not None:
        idx = torch.where(finished[..., None], x.shape[-1], idx)
    rows = torch.arange(idx.numel() // k, dtype=torch.int32)
    row_idx = (rows[:, None] + torch.arange(k, dtype=torch.int32)[None] * (idx.numel() // k)).reshape(idx.shape)
    return y.to(x.dtype), idx, row_idx


def npu_moe_gating_top_k(
    x: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 1,
    out_flag: bool = False,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Grouped routing -> (y, expert_idx int32, out): norm_type 1 = sigmoid scores; groups
    ranked by their top-2 sum (group_select_mode 1) or max (0); top-k among the k_group best
    groups on score + bias; y = score / (sum + eps) * routed_scaling_factor. Atlas A2 limits:
    256 experts, k_group 4, k <= 32, bias required."""
    op = "npu_moe_gating_top_k"
    _need(x.dim() == 2, op, f"x must be 2-D, got {tuple(x.shape)}")
    e = x.shape[-1]
    _need(e == 256 and k_group == 4 and 1 <= k <= 32 and bias is not None, op, "Atlas A2: 256 experts, k_group 4")
    _need(norm_type == 1 and renorm == 0 and e % group_count == 0, op, "only sigmoid, renorm 0 simulated")
    s = x.float().sigmoid()
    b = s + bias.float()
    grouped = b.unflatten(-1, (group_count, e // group_count))
    gscore = grouped.topk(2, -1).values.sum(-1) if group_select_mode == 1 else grouped.max(-1).values
    keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(-1, gscore.topk(k_group, -1).indices, True)
    idx = b.masked_fill(~keep.repeat_interleave(e // group_count, -1), float("-inf")).topk(k, -1).indices
    y = s.gather(-1, idx)
    y = y / (y.sum(-1, keepdim=True) + eps) * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), (s if out_flag else None)


def npu_moe_init_routing(
    x: torch.Tensor, row_idx: torch.Tensor, expert_idx: torch.Tensor, active_num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (expanded_x, expanded_row_idx, expanded_expert_idx): (expert_idx, row_idx) sorted by
    expert (stable); expanded_row_idx[sorted_row_idx[i]] = i; expanded_x[i] = x[sorted_row_idx[i] % rows]."""
    op = "npu_moe_init_routing"
    _need(x.dim() == 2 and expert_idx.dim() == 2, op, "x and expert_idx must be 2-D")
    _need(row_idx.shape == expert_idx.shape, op, "row_idx must match expert_idx")
    _need(row_idx.dtype == torch.int32 and expert_idx.dtype == torch.int32, op, "row_idx/expert_idx must be int32")
    _float16ish(op, x)
    rows, k = expert_idx.shape
    order = torch.argsort(expert_idx.flatten(), stable=True)
    sorted_row = row_idx.flatten()[order].long()
    expanded_row_idx = torch.empty(rows * k, dtype=torch.int32)
    expanded_row_idx[sorted_row] = torch.arange(rows * k, dtype=torch.int32)
    expanded_x = x[sorted_row % rows][: min(rows, active_num) * k]
    return expanded_x, expanded_row_idx, expert_idx.flatten()[order]


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    group_list: list[int] | None = None,
    split_item: int = 0,
    output_dtype=None,
) -> list[torch.Tensor]:
    """Grouped matmuls y_i = x_i @ weight_i ([M_i, K] @ [K, N]). split_item 3: x and y are one
    tensor each, split along M by ``group_list`` (cumulative row ends, one per weight)."""
    op = "npu_grouped_matmul"
    _need(isinstance(x, list) and isinstance(weight, list), op, "x and weight are lists of tensors")
    _need(len(weight) <= 128, op, f"at most 128 groups, got {len(weight)}")
    _need(bias is None and scale is None and offset is None and antiquant_scale is None, op, "not simulated")
    for w in weight:
        _need(w.dim() == 2, op, "each weight must be 2-D [K, N]")
        _float16ish(op, w)
    if split_item == 0:
        _need(len(x) == len(weight), op, "split_item 0 takes one x per weight")
        return [xi @ wi for xi, wi in zip(x, weight)]
    _need(split_item == 3 and len(x) == 1, op, "only split_item 0 and 3 are simulated")
    _need(group_list is not None and len(group_list) == len(weight), op, "group_list needs one end per weight")
    ends = list(group_list)
    _need(all(a <= b for a, b in zip([0, *ends], ends)) and ends[-1] <= x[0].shape[0], op, f"group_list {ends}")
    starts = [0, *ends[:-1]]
    return [torch.cat([x[0][a:b] @ w for a, b, w in zip(starts, ends, weight)], 0)]


def npu_moe_finalize_routing(
    expanded_permuted_rows: torch.Tensor,
    skip1: torch.Tensor | None,
    skip2: torch.Tensor | None,
    bias: torch.Tensor | None,
    scales: torch.Tensor | None,
    expanded_src_to_dst_row: torch.Tensor,
    export_for_source_row: torch.Tensor | None,
    drop_pad_mode: int = 0,
) -> torch.Tensor:
    """out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[src_to_dst[i + k * R]] + bias[expert[i, k]])."""
    op = "npu_moe_finalize_routing"
    _need(drop_pad_mode == 0, op, "only drop_pad_mode 0")
    _need(expanded_src_to_dst_row.dtype == torch.int32, op, "expanded_src_to_dst_row must be int32")
    _need(scales is not None and scales.dtype == expanded_permuted_rows.dtype, op, "scales must have the rows' dtype")
    rows, k = scales.shape
    dst = expanded_src_to_dst_row.long().view(k, rows).t()  # [R, K]: slot (i, k) at i + k * R
    picked = expanded_permuted_rows.float()[dst]  # [R, K, H]
    if bias is not None:
        picked = picked + bias.float()[export_for_source_row.long()]
    out = (picked * scales.float()[..., None]).sum(1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(expanded_permuted_rows.dtype)


def npu_weight_quant_batchmatmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset: torch.Tensor | None = None,
    quant_scale: torch.Tensor | None = None,
    quant_offset: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    antiquant_group_size: int = 0,
) -> torch.Tensor:
    """x (M, K) @ ((weight + antiquant_offset) * antiquant_scale) for an int8 (K, N) weight and a
    per-channel (N,) / (1, N) scale in x's dtype; output in x's dtype (no quant_scale)."""
    op = "npu_weight_quant_batchmatmul"
    _float16ish(op, x, allow_fp32=False)
    _need(x.dim() == 2 and weight.dim() == 2, op, "x and weight must be 2-D (M, K) and (K, N)")
    _need(weight.dtype == torch.int8, op, f"weight must be int8 (K, N), got {weight.dtype}")
    _need(x.shape[1] == weight.shape[0], op, f"x {tuple(x.shape)} and weight {tuple(weight.shape)} (K, N) differ in K")
    _need(antiquant_scale.dtype == x.dtype, op, "antiquant_scale must have x's dtype")
    _need(antiquant_scale.numel() == weight.shape[1], op, f"per-channel antiquant_scale needs {weight.shape[1]} values")
    _need(
        quant_scale is None and quant_offset is None and antiquant_group_size == 0, op, "only per-channel is simulated"
    )
    w = weight.to(x.dtype)
    if antiquant_offset is not None:
        w = w + antiquant_offset.reshape(1, -1)
    y = x @ (w * antiquant_scale.reshape(1, -1))
    return y + bias.to(x.dtype) if bias is not None else y


def install(monkeypatch) -> object:
    """Put this module in ``sys.modules['torch_npu']`` for one test (pytest monkeypatch)."""
    module = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module
