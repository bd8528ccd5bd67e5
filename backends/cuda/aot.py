"""Ahead-of-time compilation of every cuda Triton kernel for a target (no GPU needed):
``dinfer-rt kernels compile --target cuda:sm_90`` reports registers, spills and shared memory
per kernel from ``ptxas -v`` on the generated PTX, for the shipped launch configurations."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from dinfer_rt.errors import BackendError

TARGETS = {"sm_80": 80, "sm_90": 90}


def _specs(arch: str) -> list[tuple[str, dict, dict, int]]:
    """(kernel, signature, constexprs, num_warps) for LLaDA-8B-sized bf16 launches."""
    from dinfer_rt.backends.cuda.launch import default_config, row_config

    row = row_config(4096, arch)
    sw = default_config("swiglu", arch)
    rope = default_config("rope", arch)
    bf16 = "*bf16"
    return [
        (
            "rms_norm_kernel",
            {"x_ptr": bf16, "w_ptr": bf16, "y_ptr": bf16, "n_rows": "i32", "n_cols": "i32", "eps": "fp32"},
            {"ROWS": row["ROWS"], "BLOCK": row["BLOCK"]},
            row["num_warps"],
        ),
        (
            "add_rms_norm_kernel",
            {
                "x_ptr": bf16,
                "r_ptr": bf16,
                "w_ptr": bf16,
                "y_ptr": bf16,
                "s_ptr": bf16,
                "n_rows": "i32",
                "n_cols": "i32",
                "eps": "fp32",
            },
            {"ROWS": row["ROWS"], "BLOCK": row["BLOCK"]},
            row["num_warps"],
        ),
        (
            "swiglu_kernel",
            {"h_ptr": bf16, "y_ptr": bf16, "n_rows": "i32", "inter": "i32"},
            {"ROWS": sw["ROWS"], "BLOCK": sw["BLOCK"]},
            4,
        ),
        (
            "rope_kernel",
            {
                "x_ptr": bf16,
                "pos_ptr": "*i64",
                "inv_ptr": "*fp32",
                "y_ptr": bf16,
                "n_rows": "i32",
                "heads": "i32",
                "head_dim": "i32",
                "half": "i32",
            },
            {"ROWS": rope["ROWS"], "HALF": 64, "REST": 0},
            4,
        ),
        (
            "lm_head_confidence_kernel",
            {
                "h_ptr": bf16,
                "w_ptr": bf16,
                "score_ptr": "*fp32",
                "token_ptr": "*i64",
                "n_rows": "i32",
                "hidden": "i32",
                "vocab": "i32",
                "banned": "i32",
            },
            {"KIND": 0, "BLOCK_M": 16, "BLOCK_V": 64, "BLOCK_K": 32, "PRECISION": "tf32"},
            4,
        ),
    ]


def compile_all(target: str) -> list[dict]:
    backend, _, arch = target.partition(":")
    if backend != "cuda" or arch not in TARGETS:
        raise BackendError(f"unknown kernel target {target!r}; supported: {', '.join('cuda:' + a for a in TARGETS)}")
    import triton
    from dinfer_rt.backends.cuda import kernels
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    cc = TARGETS[arch]
    ptxas = get_ptxas(cc).path
    rows = []
    for name, signature, constexprs, warps in _specs(arch):
        fn = getattr(kernels, name)
        src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps})
        with tempfile.TemporaryDirectory() as d:
            ptx = Path(d) / f"{name}.ptx"
            ptx.write_text(compiled.asm["ptx"])
            out = subprocess.run(
                [
                    ptxas,
                    "-v",
                    f"--gpu-name=sm_{cc}a" if cc == 90 else f"--gpu-name=sm_{cc}",
                    str(ptx),
                    "-o",
                    str(Path(d) / "k.cubin"),
                ],
                capture_output=True,
                text=True,
            )
        if out.returncode != 0:
            raise BackendError(f"ptxas failed on {name} for {target}: {out.stderr.strip()[-300:]}")
        log = out.stderr + out.stdout
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        rows.append(
            {
                "kernel": name.removesuffix("_kernel"),
                "target": target,
                "num_warps": warps,
                "constexprs": constexprs,
                "registers": int(regs.group(1)) if regs else None,
                "spill_stores": int(spill.group(1)) if spill else None,
                "spill_loads": int(spill.group(2)) if spill else None,
                "shared_bytes": compiled.metadata.shared,
            }
        )
    return rows
