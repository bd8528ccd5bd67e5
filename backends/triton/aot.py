"""Ahead-of-time compilation of every shared Triton kernel for a GPU target (no GPU needed):
the kernel specs for the shipped launch configurations and the compile loop. Device folders
contribute their targets through the ``dinfer_rt_compile_targets`` hook and read the resources
out of their own binary format (``cuda/aot.py``: ptxas; ``rocm_dcu/aot.py``: AMDGCN metadata)."""

from __future__ import annotations

from collections.abc import Callable

from dinfer_rt.errors import BackendError

# LLaDA-8B (hidden 4096, head_dim 128, vocab 126464), LLaDA-MoE (64 experts, top-8, hidden 2048,
# expert width 1024) and LLaDA2 (256 experts in 8 groups, 4 kept, top-8): the shipped shapes.
HIDDEN, HEAD_DIM, BLOCK_TOKENS = 4096, 128, 32


def kernel_specs(t: dict, dt: str = "bf16") -> list[tuple[str, dict, dict, int]]:
    """(kernel, signature, constexprs, num_warps) for every kernel with tuning row ``t`` and
    16-bit type ``dt`` ("bf16", or "fp16" on archs without bf16 matrix cores)."""
    from dinfer_rt.backends.triton.launch import attention_config, default_config, row_config

    p = "*" + dt
    i32, f32 = "i32", "fp32"
    row = row_config(HIDDEN, t)
    rows = {"ROWS": row["ROWS"], "BLOCK": row["BLOCK"]}
    sw, rope, router = default_config("swiglu", t), default_config("rope", t), default_config("router", t)
    head, moe = default_config("lm_head_confidence", t), default_config("moe", t)
    attn = attention_config(BLOCK_TOKENS, HEAD_DIM, t)
    gemm_common = {"DOT_F32": False}
    router_sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "idx_ptr": "*i64"}
    router_sig |= {"n_rows": i32, "n_experts": i32, "scale": f32}
    moe_sig = {"x_ptr": p, "wgu_ptr": p, "h_ptr": p, "tok_ptr": "*i32", "tile_expert_ptr": "*i32"}
    down_sig = {"h_ptr": p, "wd_ptr": p, "y_ptr": "*fp32", "tok_ptr": "*i32", "row_weight_ptr": "*fp32"}
    down_sig |= {"tile_expert_ptr": "*i32", "inter": i32, "hidden": i32}
    moe_cfg = {k: moe[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    attn_sig = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, "key_valid_ptr": "*i1", "first_block_ptr": "*i64"}
    attn_sig |= {"q_pos_ptr": "*i64", "k_pos_ptr": "*i64", "n_q": i32, "n_k": i32, "heads": i32, "groups": i32}
    attn_sig |= {"head_dim": i32, "scale": f32, "block_size": i32, "k_stride_b": i32, "k_stride_s": i32}
    attn_sig |= {"q_pos_stride_b": i32, "k_pos_stride_b": i32, "part_m_ptr": "*fp32", "part_l_ptr": "*fp32"}
    attn_sig |= {"part_acc_ptr": "*fp32", "keys_per_split": i32, "n_rows": i32}
    commit_sig = {"conf_ptr": "*fp32", "masked_ptr": "*i1", "quota_ptr": "*i64", "x0_ptr": "*i64", "x_ptr": "*i64"}
    commit_sig |= {"commit_ptr": "*i8", "n_rows": i32, "n_slots": i32, "x_stride": i32, "threshold": f32}
    edit_sig = {"conf_ptr": "*fp32", "token_ptr": "*i64", "masked_ptr": "*i1", "editable_ptr": "*i1", "x_ptr": "*i64"}
    edit_sig |= {"commit_ptr": "*i8", "edit_ptr": "*i8", "n_rows": i32, "n_slots": i32, "x_stride": i32}
    edit_sig |= {"threshold": f32, "edit_threshold": f32}
    return [
        (
            "rms_norm_kernel",
            {"x_ptr": p, "w_ptr": p, "y_ptr": p, "n_rows": i32, "n_cols": i32, "eps": f32},
            rows,
            row["num_warps"],
        ),
        (
            "add_rms_norm_kernel",
            {"x_ptr": p, "r_ptr": p, "w_ptr": p, "y_ptr": p, "s_ptr": p, "n_rows": i32, "n_cols": i32, "eps": f32},
            rows,
            row["num_warps"],
        ),
        ("swiglu_kernel", {"h_ptr": p, "y_ptr": p, "n_rows": i32, "inter": i32}, sw, 4),
        (
            "rope_kernel",
            {"x_ptr": p, "pos_ptr": "*i64", "inv_ptr": "*fp32", "y_ptr": p, "n_rows": i32, "heads": i32}
            | {"head_dim": i32, "half": i32},
            {"ROWS": rope["ROWS"], "HALF": HEAD_DIM // 2, "REST": 0},
            4,
        ),
        (
            "lm_head_confidence_kernel",
            {"h_ptr": p, "w_ptr": p, "score_ptr": "*fp32", "token_ptr": "*i64", "n_rows": i32, "hidden": i32}
            | {"vocab": i32, "banned": i32},
            {"KIND": 0, "BLOCK_M": head["BLOCK_M"], "BLOCK_V": head["BLOCK_V"], "BLOCK_K": head["BLOCK_K"]}
            | gemm_common,
            head["num_warps"],
        ),
        *(
            (
                "attention_kernel",
                attn_sig,
                {k: attn[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_D", "HEADS")}
                | {"BLOCK_CAUSAL": True, "SPLIT": split}
                | gemm_common,
                attn["num_warps"],
            )
            for split in (False, True)
        ),
        (
            "attention_combine_kernel",
            {"part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "o_ptr": p}
            | {"n_rows": i32, "head_dim": i32, "splits": i32},
            {"ROWS": t["attn_combine_rows"], "BLOCK_D": attn["BLOCK_D"]},
            4,
        ),
        (
            "router_kernel",
            router_sig,
            {"SIGMOID": False, "K": 8, "KP": 8, "GROUPS": 1, "GP": 1, "TOPK_GROUP": 1, "RENORMALIZE": False}
            | {"ROWS": max(1, min(router["ROWS"], t["router_elems"] // 64)), "BLOCK_E": 64},
            4,
        ),
        (
            "router_kernel",
            router_sig,
            {"SIGMOID": True, "K": 8, "KP": 8, "GROUPS": 8, "GP": 8, "TOPK_GROUP": 4, "RENORMALIZE": True}
            | {"ROWS": max(1, min(router["ROWS"], t["router_elems"] // 256)), "BLOCK_E": 256},
            4,
        ),
        ("moe_gate_up_kernel", moe_sig | {"hidden": i32, "inter": i32}, moe_cfg | gemm_common, moe["num_warps"]),
        ("commit_kernel", commit_sig, {"TOP_K": True, "BLOCK_L": BLOCK_TOKENS, "PERSISTENT": False}, 1),
        ("commit_kernel", commit_sig, {"TOP_K": False, "BLOCK_L": BLOCK_TOKENS, "PERSISTENT": False}, 1),
        ("commit_edit_kernel", edit_sig, {"BLOCK_L": BLOCK_TOKENS, "PERSISTENT": False}, 1),  # LLaDA2.1's editing rule
        ("moe_down_kernel", down_sig, moe_cfg | gemm_common, moe["num_warps"]),
    ]


def build(name: str, signature: dict, constexprs: dict, warps: int, target):
    """``triton.compile`` one kernel for a ``GPUTarget`` (no device needed)."""
    import triton
    from triton.compiler import ASTSource

    from dinfer_rt.backends.triton import kernels

    fn = getattr(kernels, name)
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return triton.compile(src, target=target, options={"num_warps": warps})


def report_row(name: str, target: str, warps: int, constexprs: dict, **resources) -> dict:
    kernel = name.removesuffix("_kernel")
    if kernel == "router":
        kernel += "_sigmoid_grouped" if constexprs["SIGMOID"] else "_softmax_topk"
    if kernel == "commit":
        kernel += "_top_k" if constexprs["TOP_K"] else "_threshold"
    if kernel == "attention" and constexprs["SPLIT"]:
        kernel += "_split_keys"
    return {"kernel": kernel, "target": target, "num_warps": warps, "constexprs": constexprs, **resources}


def compile_each(
    target: str, tuning: dict, dtype: str, gpu_target, resources: Callable[[str, object], dict]
) -> list[dict]:
    """Compile every kernel spec for ``gpu_target`` (a ``triton.backends.compiler.GPUTarget``)
    and return one row per kernel with ``resources(name, compiled)``'s fields."""
    rows = []
    for name, signature, constexprs, warps in kernel_specs(tuning, dtype):
        try:
            compiled = build(name, signature, constexprs, warps, gpu_target)
        except Exception as e:  # an MLIR/LLVM failure: name the kernel and target, keep the cause
            raise BackendError(f"Triton compile of {name} for {target} failed: {str(e).strip()[-300:]}") from e
        rows.append(report_row(name, target, warps, constexprs, **resources(name, compiled)))
    return rows
