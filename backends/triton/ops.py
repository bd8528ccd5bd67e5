"""Host-side wrappers: each has its IR op's reference signature, allocates outputs and launches
the Triton kernel with the backend's launch configuration (resolved once, not per call)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from dinfer_rt.backends.triton import kernels as kern
from dinfer_rt.backends.triton.autotune import Autotuner
from dinfer_rt.backends.triton.launch import AUTOTUNE_SPACE, attention_config, row_config
from dinfer_rt.ir import ops

KERNELS = (
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "rope",
    "lm_head_confidence",
    "attention",
    "router",
    "moe",
    "linear_wq",
    "linear_gptq",
)
SCORE_KINDS = {"max": 0, "margin": 1, "entropy": 2}


def _need_inner_contiguous(op: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"cuda {op}: K/V must have contiguous [heads, head_dim] rows, got strides {t.stride()}")


def first_allowed_block(key_valid: torch.Tensor, key_pos: torch.Tensor, block_size: int | None) -> torch.Tensor:
    """[B] lowest block of ``block_size`` positions holding a valid key (0 without block-causal
    masking, when any key is valid); huge when a row has none. A query whose block is below it
    sees no key."""
    none = torch.iinfo(torch.int64).max // 2
    first = torch.where(key_valid, key_pos if key_pos.dim() == 2 else key_pos[None, :], none).amin(-1)
    lowest = first // block_size if block_size is not None else torch.zeros_like(first)
    return torch.where(first == none, none, lowest).contiguous()


def commit(conf, masked, quota, x0, x_block, *, rule: str, threshold: float = 0.9, programs=None, min_block=16):
    """Device-side commit selection for one block: ``rule`` "top_k" (commit ``quota`` [B] best
    masked slots) or "threshold" (>= ``threshold``, at least the best). Writes the committed
    candidates ``x0`` into ``x_block`` (a [B, L] view of the sequence) and returns the [B, L]
    commit mask; no host sync. ``programs``: a persistent grid of that many programs striding
    over rows (Ascend's vector cores), else one program per row; ``min_block``: the smallest
    slot tile (Ascend wants 32-byte aligned int8 tiles)."""
    if rule not in ("top_k", "threshold"):
        raise ValueError(f"commit: unknown rule {rule!r} (top_k, threshold)")
    b, n = conf.shape
    if x_block.stride(-1) != 1:
        raise ValueError(f"commit: the block view must have unit stride in L, got {x_block.stride()}")
    out = torch.empty((b, n), dtype=torch.int8, device=conf.device)
    kern.commit_kernel[(programs or b,)](
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
        BLOCK_L=max(min_block, triton.next_power_of_2(n)),
        PERSISTENT=programs is not None,
    )
    return out.bool()


def commit_edit(
    conf, token, masked, editable, x_block, *, threshold: float, edit_threshold: float, programs=None, min_block=16
):
    """Device-side step of the editing rule joint_threshold (greedy, ``penalty_lambda`` 0) for
    one block, through ``commit_edit_kernel``: from the confidence head's (``conf``, ``token``)
    [B, L], the slots masked at the start of the step ``masked`` and the ``editable`` ones,
    writes mask-to-token commits and token-to-token edits into ``x_block`` (a [B, L] view of the
    sequence, unit stride in L) and returns the (commit, edit) masks; no host sync. Semantics:
    ``dinfer_rt.backends.reference.backend.commit_edit``. ``programs`` / ``min_block`` as
    :func:`commit`."""
    b, n = conf.shape
    if x_block.stride(-1) != 1:
        raise ValueError(f"commit_edit: the block view must have unit stride in L, got {x_block.stride()}")
    commit_out = torch.empty((b, n), dtype=torch.int8, device=conf.device)
    edit_out = torch.empty((b, n), dtype=torch.int8, device=conf.device)
    kern.commit_edit_kernel[(programs or b,)](
        conf.float().contiguous(),
        token.to(x_block.dtype).contiguous(),
        masked.contiguous(),
        editable.contiguous(),
        x_block,
        commit_out,
        edit_out,
        b,
        n,
        x_block.stride(0),
        float(threshold),
        float(edit_threshold),
        BLOCK_L=max(min_block, triton.next_power_of_2(n)),
        PERSISTENT=programs is not None,
    )
    return commit_out.bool(), edit_out.bool()


def confidence(logits, *, banned, kind="max", launch: Callable[[int, int, int], dict]):
    """Logits -> (score, argmax) through ``confidence_kernel``; ``launch(vocab, elem_bytes, rows)``
    gives ``grid``, ``BLOCK_V`` and ``ROWS`` (the device's rules, e.g. Ascend's UB budget)."""
    z = logits.contiguous()
    vocab = z.shape[-1]
    rows = z.numel() // vocab
    score = torch.empty(z.shape[:-1], dtype=torch.float32, device=z.device)
    token = torch.empty(z.shape[:-1], dtype=torch.int64, device=z.device)
    cfg = launch(vocab, z.element_size(), rows)
    kern.confidence_kernel[(cfg["grid"],)](
        z, score, token, rows, vocab, banned, KIND=SCORE_KINDS[kind], BLOCK_V=cfg["BLOCK_V"], ROWS=cfg["ROWS"]
    )
    return score, token


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def inv_freq(theta: float, rotary_dim: int, device: torch.device) -> torch.Tensor:
    """The reference's fp32 inverse frequencies (computed on the CPU as it does, so the angles
    match it exactly), copied to ``device`` once: a per-call host-to-device copy would also break
    CUDA / ACL graph capture, which refuses copies from pageable host memory."""
    key = (float(theta), int(rotary_dim), str(device))
    if key not in _INV_FREQ:
        cpu = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        _INV_FREQ[key] = cpu.to(device)
    return _INV_FREQ[key]


def key_splits(programs: int, n_keys: int, block_n: int, tuning: dict) -> int:
    """How many key ranges one attention launch splits into: more than one only when the launch
    has fewer programs than ``attn_split_below`` (about the device's multiprocessors: a block step
    at batch 1 has one per head) and each range keeps at least ``attn_split_keys`` keys. A
    tuning row without these keys (a plugin's own) never splits."""
    if programs >= tuning.get("attn_split_below", 0):
        return 1
    want = min(tuning["attn_max_splits"], triton.cdiv(tuning["attn_split_below"], programs))
    return max(1, min(want, n_keys // max(tuning["attn_split_keys"], block_n)))


def make_kernels(
    tuning: dict, interpret: bool, launch_config: Callable[[str], dict], tuner: Autotuner | None = None
) -> dict[str, Callable]:
    """IR op -> wrapper for one architecture's tuning row. ``launch_config(kernel)`` (the row's
    defaults + plugin overrides) is read once here, not per call. ``interpret``: the kernels run
    under Triton's interpreter (16-bit dot tiles are widened to fp32 there, see kernels._round).
    ``tuner`` (DINFER_AUTOTUNE=1): attention tiles are timed once per shape bucket and cached."""
    tuned = {name: launch_config(name) for name in KERNELS}

    def dot_f32(x: torch.Tensor) -> bool:
        """Dequant GEMMs: fp32 dots for fp32 activations (IEEE, no TF32) and under the
        interpreter; 16-bit activations meet the tile rounded to their dtype on tensor cores."""
        return interpret or x.dtype == torch.float32

    def row(name: str, n: int) -> dict:
        return {**row_config(n, tuning), **tuned[name]}

    def rms_norm(x, weight, *, eps):
        xc = x.contiguous()
        n = xc.shape[-1]
        rows, y = xc.numel() // n, torch.empty_like(xc)
        cfg = row("rms_norm", n)
        kern.rms_norm_kernel[(triton.cdiv(rows, cfg["ROWS"]),)](xc, weight, y, rows, n, eps, **cfg)
        return y

    def add_rms_norm(x, residual, weight, *, eps):
        xc, rc = x.contiguous(), residual.contiguous()
        n = xc.shape[-1]
        rows, y, s = xc.numel() // n, torch.empty_like(xc), torch.empty_like(xc)
        cfg = row("add_rms_norm", n)
        kern.add_rms_norm_kernel[(triton.cdiv(rows, cfg["ROWS"]),)](xc, rc, weight, y, s, rows, n, eps, **cfg)
        return y, s

    def swiglu(h):
        hc = h.contiguous()
        inter = hc.shape[-1] // 2
        rows = hc.numel() // hc.shape[-1]
        y = torch.empty((*hc.shape[:-1], inter), dtype=hc.dtype, device=hc.device)
        cfg = tuned["swiglu"]
        grid = (triton.cdiv(rows, cfg["ROWS"]), triton.cdiv(inter, cfg["BLOCK"]))
        kern.swiglu_kernel[grid](hc, y, rows, inter, **cfg)
        return y

    def rope(x, positions, *, theta, rotary_dim):
        xc = x.contiguous()
        b, t, heads, d = xc.shape
        inv = inv_freq(theta, rotary_dim, xc.device)
        y = torch.empty_like(xc)
        rows = b * t * heads
        rest = triton.next_power_of_2(d - rotary_dim) if d > rotary_dim else 0
        cfg = tuned["rope"]
        kern.rope_kernel[(triton.cdiv(rows, cfg["ROWS"]),)](
            xc,
            positions.contiguous(),
            inv,
            y,
            rows,
            heads,
            d,
            rotary_dim // 2,
            HALF=triton.next_power_of_2(rotary_dim // 2),
            REST=rest,
            **cfg,
        )
        return y

    def lm_head_confidence(h, weight, *, banned, kind="max", chunk=8192):
        hc, wc = h.contiguous(), weight.contiguous()
        hidden, vocab = hc.shape[-1], wc.shape[0]
        rows = hc.numel() // hidden
        score = torch.empty(hc.shape[:-1], dtype=torch.float32, device=hc.device)
        token = torch.empty(hc.shape[:-1], dtype=torch.int64, device=hc.device)
        cfg = tuned["lm_head_confidence"]
        kern.lm_head_confidence_kernel[(triton.cdiv(rows, cfg["BLOCK_M"]),)](
            hc, wc, score, token, rows, hidden, vocab, banned, KIND=SCORE_KINDS[kind], DOT_F32=interpret, **cfg
        )
        return score, token

    def linear_wq(x, qweight, scale, bias=None):
        """Dequant GEMM over the flattened rows of x; fp8 weights go in as their bytes."""
        xc = x.reshape(-1, x.shape[-1]).contiguous()
        m, k = xc.shape
        n = qweight.shape[0]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        fp8 = qweight.dtype == torch.float8_e4m3fn
        q = qweight.contiguous().view(torch.uint8) if fp8 else qweight.contiguous()
        cfg = tuned["linear_wq"]
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        b = bias if bias is not None else scale
        kern.linear_wq_kernel[grid](
            xc, q, scale, b, y, m, n, k, HAS_BIAS=bias is not None, FP8=fp8, DOT_F32=dot_f32(x), **cfg
        )
        return y.reshape(*x.shape[:-1], n)

    def linear_gptq(x, qweight, qzeros, scales, g_idx, bias=None, *, zero_offset=1):
        """GPTQ 4-bit dequant GEMM over the flattened rows of x (scales read in their own dtype)."""
        xc = x.reshape(-1, x.shape[-1]).contiguous()
        m, k = xc.shape
        n = qweight.shape[1]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        cfg = tuned["linear_gptq"]
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        tensors = (qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), g_idx.contiguous())
        b = bias if bias is not None else scales
        kern.linear_gptq_kernel[grid](
            xc, *tensors, b, y, m, n, k, zero_offset, HAS_BIAS=bias is not None, DOT_F32=dot_f32(x), **cfg
        )
        return y.reshape(*x.shape[:-1], n)

    def attention(q, k, v, key_valid, token_index, k_cache=None, v_cache=None, *, scale, block_size=None):
        qc = q.contiguous()
        # the cache is read in place after the splice; fresh K/V must be contiguous rows
        keys, values, key_pos = ops.splice_kv(k.contiguous(), v.contiguous(), token_index, k_cache, v_cache)
        _need_inner_contiguous("attention", keys, values)
        b, t, heads, d = qc.shape
        out = torch.empty_like(qc)
        args = (qc, keys, values, out, key_valid.contiguous(), first_allowed_block(key_valid, key_pos, block_size))
        args += (token_index.contiguous(), key_pos.contiguous(), t, keys.shape[1], heads, heads // keys.shape[2], d)
        args += (scale, block_size or 1, keys.stride(0), keys.stride(1))
        args += (t if token_index.dim() == 2 else 0, key_pos.shape[-1] if key_pos.dim() == 2 else 0)
        n_k, n_rows = keys.shape[1], b * t * heads

        def launch(cfg: dict) -> None:
            grid = (triton.cdiv(t, cfg["BLOCK_M"]), b * triton.cdiv(heads, cfg["HEADS"]))
            splits = key_splits(grid[0] * grid[1], n_k, cfg["BLOCK_N"], tuning)
            common = {"BLOCK_CAUSAL": block_size is not None, "DOT_F32": interpret, **cfg}
            if splits == 1:
                kern.attention_kernel[grid](*args, out, out, out, n_k, n_rows, SPLIT=False, **common)
                return
            per_split = triton.cdiv(triton.cdiv(n_k, splits), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
            part_m, part_l = (torch.empty(splits * n_rows, dtype=torch.float32, device=qc.device) for _ in "ml")
            part_acc = torch.empty(splits * n_rows * d, dtype=torch.float32, device=qc.device)
            kern.attention_kernel[(*grid, splits)](
                *args, part_m, part_l, part_acc, per_split, n_rows, SPLIT=True, **common
            )
            rows = tuning.get("attn_combine_rows", 16)
            kern.attention_combine_kernel[(triton.cdiv(n_rows, rows),)](
                part_m, part_l, part_acc, out, n_rows, d, splits, ROWS=rows, BLOCK_D=cfg["BLOCK_D"]
            )

        cfg = {**attention_config(t, d, tuning), **tuned["attention"]}
        if tuner is not None:
            bucket = (triton.next_power_of_2(t), triton.next_power_of_2(keys.shape[1]), d, args[11], qc.dtype)
            cands = [{**cfg, **c} for c in AUTOTUNE_SPACE["attention"]]
            cfg = tuner.best("attention", (*bucket, block_size is not None), cands, launch)
        launch(cfg)
        if k_cache is not None:
            return out, k_cache, v_cache
        return out

    def rope_attention(q, k, v, key_valid, token_index, positions, q_norm, k_norm, k_cache, v_cache, **attrs):
        """QK-norm and RoPE through their Triton kernels, then the flash kernel (the IR op's
        attributes: scale, block_size, theta, rotary_dim, eps)."""
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps=attrs["eps"]), rms_norm(k, k_norm, eps=attrs["eps"])
        rot = {"theta": attrs["theta"], "rotary_dim": attrs["rotary_dim"]}
        q, k = rope(q, positions, **rot), rope(k, positions, **rot)
        return attention(
            q, k, v, key_valid, token_index, k_cache, v_cache, scale=attrs["scale"], block_size=attrs["block_size"]
        )

    def router(logits, bias, *, k, renormalize, sigmoid, n_group=1, topk_group=1, scale=1.0):
        lc = logits.float().contiguous()  # fp32 router logits, as the reference
        n_exp = lc.shape[-1]
        rows = lc.numel() // n_exp
        w = torch.empty((*lc.shape[:-1], k), dtype=torch.float32, device=lc.device)
        idx = torch.empty((*lc.shape[:-1], k), dtype=torch.int64, device=lc.device)
        block_e = triton.next_power_of_2(n_exp)
        cfg = {**tuned["router"], "ROWS": max(1, min(tuned["router"]["ROWS"], tuning["router_elems"] // block_e))}
        group = {"GROUPS": n_group, "GP": triton.next_power_of_2(n_group), "TOPK_GROUP": topk_group}
        kern.router_kernel[(triton.cdiv(rows, cfg["ROWS"]),)](
            lc,
            lc if bias is None else bias.float().contiguous(),
            w,
            idx,
            rows,
            n_exp,
            float(scale),
            SIGMOID=sigmoid,
            K=k,
            KP=triton.next_power_of_2(k),
            RENORMALIZE=renormalize,
            BLOCK_E=block_e,
            **group,
            **cfg,
        )
        return w, idx

    def router_softmax_topk(logits, *, k, renormalize):
        return router(logits, None, k=k, renormalize=renormalize, sigmoid=False)

    def router_sigmoid_grouped(logits, bias, *, k, n_group, topk_group, renormalize, scale):
        group = {"n_group": n_group, "topk_group": topk_group, "scale": scale}
        return router(logits, bias, k=k, renormalize=renormalize, sigmoid=True, **group)

    def moe_experts(x, weights, indices, w_gate_up, w_down, *, first_expert=0):
        """Expert-sorted slots padded per expert to whole tiles, built on the device with no host
        sync (the padded length is a static bound); two grouped GEMMs; a gather-sum finalize.
        Under expert parallelism only this rank's experts are computed: other ranks' slots go to a
        virtual expert ``n_exp`` whose tiles the kernels skip (``ops.local_routing``)."""
        hidden, inter, n_exp = x.shape[-1], w_down.shape[-1], w_down.shape[0]
        weights, indices = ops.local_routing(weights, indices, first_expert, n_exp, elsewhere=n_exp)
        flat = x.reshape(-1, hidden).contiguous()
        idx = indices.reshape(flat.shape[0], -1)
        n, top = idx.shape
        cfg = tuned["moe"]
        bm = cfg["BLOCK_M"]
        slot_expert = idx.reshape(-1)
        counts = torch.bincount(slot_expert, minlength=n_exp + 1)  # + the virtual "elsewhere" expert
        padded = (counts + bm - 1) // bm * bm
        padded_end = padded.cumsum(0)
        order = torch.argsort(slot_expert, stable=True)
        sorted_expert = slot_expert[order]
        first = (counts.cumsum(0) - counts)[sorted_expert]
        rank = torch.arange(order.numel(), device=x.device) - first
        pos_sorted = (padded_end - padded)[sorted_expert] + rank
        n_pad = triton.cdiv(n * top + (n_exp + 1) * (bm - 1), bm) * bm
        tok = torch.full((n_pad,), -1, dtype=torch.int32, device=x.device)
        tok[pos_sorted] = (order // top).to(torch.int32)
        row_weight = torch.zeros(n_pad, dtype=torch.float32, device=x.device)
        row_weight[pos_sorted] = weights.reshape(-1)[order].float()
        slot_row = torch.empty_like(order)
        slot_row[order] = pos_sorted
        tiles = torch.arange(n_pad // bm, device=x.device) * bm
        tile_expert = torch.searchsorted(padded_end, tiles, right=True).to(torch.int32)
        tile_expert = torch.where(tile_expert < n_exp, tile_expert, -1)
        common = {"DOT_F32": interpret}
        h = torch.empty((n_pad, inter), dtype=x.dtype, device=x.device)
        grid = (n_pad // bm, triton.cdiv(inter, cfg["BLOCK_N"]))
        kern.moe_gate_up_kernel[grid](flat, w_gate_up.contiguous(), h, tok, tile_expert, hidden, inter, **cfg, **common)
        y = torch.empty((n_pad, hidden), dtype=torch.float32, device=x.device)
        grid = (n_pad // bm, triton.cdiv(hidden, cfg["BLOCK_N"]))
        kern.moe_down_kernel[grid](
            h, w_down.contiguous(), y, tok, row_weight, tile_expert, inter, hidden, **cfg, **common
        )
        rows = y[slot_row.view(n, top)]  # slots of the skipped virtual expert hold no values
        rows = torch.where((idx < n_exp)[..., None], rows, torch.zeros((), dtype=rows.dtype, device=x.device))
        return rows.sum(1).to(x.dtype).reshape(x.shape)

    def moe_routed(x, router_w, expert_bias, w_gate_up, w_down, *, router, **router_attrs):
        logits = ops.linear(x.to(torch.float32), router_w)
        if router == "softmax":
            w, idx = router_softmax_topk(logits, k=router_attrs["k"], renormalize=router_attrs["renormalize"])
        else:
            keys = ("k", "n_group", "topk_group", "renormalize", "scale")
            w, idx = router_sigmoid_grouped(logits, expert_bias, **{key: router_attrs[key] for key in keys})
        return moe_experts(x, w, idx, w_gate_up, w_down, first_expert=router_attrs.get("first_expert", 0))

    return {
        "router_softmax_topk": router_softmax_topk,
        "router_sigmoid_grouped": router_sigmoid_grouped,
        "moe_experts": moe_experts,
        "moe_routed": moe_routed,
        "attention": attention,
        "rope_attention": rope_attention,
        "rms_norm": rms_norm,
        "add_rms_norm": add_rms_norm,
        "swiglu": swiglu,
        "rope": rope,
        "lm_head_confidence": lm_head_confidence,
        "linear_wq": linear_wq,
        "linear_gptq": linear_gptq,
        # Paged KV: pure data movement, done by torch index ops (gather / index_put run on CUDA and
        # ROCm as they are). Next step: a paged attention kernel reading the block table itself.
        "kv_gather": ops.kv_gather,
        "kv_scatter": ops.kv_scatter,
    }
