"""Host-side wrappers: each has its IR op's reference signature, allocates outputs and launches
the Triton kernel with the backend's launch configuration (resolved once, not per call)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
from dinfer_rt.backends.cuda import kernels as k
from dinfer_rt.backends.cuda.launch import row_config


def make_kernels(arch: str | None, launch_config: Callable[[str], dict]) -> dict[str, Callable]:
    """IR op -> wrapper. ``launch_config(kernel)`` (table + plugin overrides) is read once here."""
    tuned = {name: launch_config(name) for name in ("rms_norm", "add_rms_norm", "swiglu", "rope", "lm_head_confidence")}

    def row(name: str, n: int) -> dict:
        return {**row_config(n, arch), **tuned[name]}

    def rms_norm(x, weight, *, eps):
        xc = x.contiguous()
        n = xc.shape[-1]
        rows, y = xc.numel() // n, torch.empty_like(xc)
        cfg = row("rms_norm", n)
        k.rms_norm_kernel[(triton.cdiv(rows, cfg["ROWS"]),)](xc, weight, y, rows, n, eps, **cfg)
        return y

    def add_rms_norm(x, residual, weight, *, eps):
        xc, rc = x.contiguous(), residual.contiguous()
        n = xc.shape[-1]
        rows, y, s = xc.numel() // n, torch.empty_like(xc), torch.empty_like(xc)
        cfg = row("add_rms_norm", n)
        k.add_rms_norm_kernel[(triton.cdiv(rows, cfg["ROWS"]),)](xc, rc, weight, y, s, rows, n, eps, **cfg)
        return y, s

    def swiglu(h):
        hc = h.contiguous()
        inter = hc.shape[-1] // 2
        rows = hc.numel() // hc.shape[-1]
        y = torch.empty((*hc.shape[:-1], inter), dtype=hc.dtype, device=hc.device)
        cfg = tuned["swiglu"]
        grid = (triton.cdiv(rows, cfg["ROWS"]), triton.cdiv(inter, cfg["BLOCK"]))
        k.swiglu_kernel[grid](hc, y, rows, inter, **cfg)
        return y

    def rope(x, positions, *, theta, rotary_dim):
        xc = x.contiguous()
        b, t, heads, d = xc.shape
        # The reference's fp32 inverse frequencies, so the angles match it exactly.
        inv = (theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)).to(xc.device)
        y = torch.empty_like(xc)
        rows = b * t * heads
        rest = triton.next_power_of_2(d - rotary_dim) if d > rotary_dim else 0
        cfg = tuned["rope"]
        k.rope_kernel[(triton.cdiv(rows, cfg["ROWS"]),)](
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
        cfg = {"BLOCK_M": 16, "BLOCK_V": 64, "BLOCK_K": 32, **tuned["lm_head_confidence"]}
        kind_id = {"max": 0, "margin": 1, "entropy": 2}[kind]
        precision = "ieee" if hc.dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs
        k.lm_head_confidence_kernel[(triton.cdiv(rows, cfg["BLOCK_M"]),)](
            hc, wc, score, token, rows, hidden, vocab, banned, KIND=kind_id, PRECISION=precision, **cfg
        )
        return score, token

    return {
        "rms_norm": rms_norm,
        "add_rms_norm": add_rms_norm,
        "swiglu": swiglu,
        "rope": rope,
        "lm_head_confidence": lm_head_confidence,
    }
