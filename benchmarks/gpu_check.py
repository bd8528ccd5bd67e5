"""One GPU session's checks for the cuda backend (run by benchmarks/gpu_check.sh, < 10 minutes on
one H200): kernel correctness on the GPU, kernel timings against torch eager, and an
LLaDA-8B-shaped random-weight bf16 model (dual cache, block 32, context 1024): ms per denoising
forward against the weight-bytes / bandwidth floor, and tokens/s at a fixed tokens-per-forward.
Writes gpu_check.json and gpu_check.md to --out.

Status: written without a GPU (none was lent to the session that wrote it); not yet run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from dinfer_rt.ir import ops

from dinfer_rt.layouts import LLADA_8B
from dinfer_rt.model import Model
from dinfer_rt.plugins import select_backend
from dinfer_rt.spec import param_plan, parse_spec


def cuda_time(fn, iters: int = 50) -> float:
    """Median milliseconds of ``fn`` with CUDA events, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_time(lambda: y.copy_(x), 20)
    return 2 * x.numel() / (ms * 1e-3) / 1e9


def _cases(k: dict, dtype: torch.dtype) -> dict:
    """kernel -> (ours, torch eager, float64 reference, bytes moved) on LLaDA-8B-sized inputs."""
    x = torch.randn(32, 4096, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(dtype)
    h = torch.randn(32, 2 * 12288, device="cuda", dtype=dtype)
    q = torch.randn(1, 32, 32, 128, device="cuda", dtype=dtype)
    pos = torch.arange(992, 1024, device="cuda")[None]
    rope = {"theta": 500000.0, "rotary_dim": 128}
    size = x.numel() * x.element_size()
    return {
        "rms_norm": (
            lambda: k["rms_norm"](x, w, eps=1e-5),
            lambda: ops.rms_norm(x, w, eps=1e-5),
            lambda: ops.rms_norm(x.double(), w.double(), eps=1e-5),
            2 * size,
        ),
        "add_rms_norm": (
            lambda: k["add_rms_norm"](x, r, w, eps=1e-5)[0],
            lambda: ops.add_rms_norm(x, r, w, eps=1e-5)[0],
            lambda: ops.add_rms_norm(x.double(), r.double(), w.double(), eps=1e-5)[0],
            4 * size,
        ),
        "swiglu": (
            lambda: k["swiglu"](h),
            lambda: ops.swiglu(h),
            lambda: ops.swiglu(h.double()),
            1.5 * h.numel() * h.element_size(),
        ),
        "rope": (
            lambda: k["rope"](q, pos, **rope),
            lambda: ops.rope(q, pos, **rope),
            lambda: ops.rope(q.float(), pos, **rope).double(),
            2 * q.numel() * q.element_size(),
        ),
    }


def kernel_checks(backend) -> list[dict]:
    k = backend.kernels()
    rows = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for name, (ours, eager, ref, nbytes) in _cases(k, dtype).items():
            want = ref()
            err = ((ours().double() - want).abs().max() / want.abs().max()).item()
            ms, eager_ms = cuda_time(ours), cuda_time(eager)
            rows.append(
                {
                    "kernel": name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "max_rel": err,
                    "passed": err <= tol,
                    "ms": ms,
                    "eager_ms": eager_ms,
                    "gb_s": nbytes / (ms * 1e-3) / 1e9,
                }
            )
    return rows


def llada_8b_step(backend_name: str, context: int = 1024, block: int = 32, tpf: float = 4.0) -> dict:
    spec = parse_spec(Path("LLaDA-8B"), LLADA_8B)
    weights = {p.name: (torch.randn(p.shape, device="cuda", dtype=torch.bfloat16) * 0.02) for p in param_plan(spec)}
    backend = select_backend(backend_name)
    model = Model(Path("LLaDA-8B (random)"), spec, weights, None, backend, torch.bfloat16)
    ids = torch.randint(0, spec.vocab, (1, context), device="cpu")
    cache = model.new_cache(1, context)
    model.forward(ids, cache=cache)
    blk = torch.arange(context - block, context)
    step_ms = cuda_time(lambda: model.forward(ids, cache=cache, compute=blk), 20)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    floor_ms = weight_bytes / (copy_bandwidth_gbs() * 1e9) * 1e3
    start = time.perf_counter()
    model.forward(ids, cache=cache)  # a refresh, then block steps at the fixed tokens-per-forward
    steps = int(256 / tpf)
    for _ in range(steps):
        model.forward(ids, cache=cache, compute=blk)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return {
        "step_ms": step_ms,
        "weight_bytes_floor_ms": floor_ms,
        "ratio_to_floor": step_ms / floor_ms,
        "tokens_per_s_at_tpf": 256 / wall,
        "tokens_per_forward": tpf,
        "generated": 256,
        "forwards": steps + 1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible")
    backend = select_backend("cuda")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gb_s": copy_bandwidth_gbs(),
        "kernels": kernel_checks(backend),
        "llada_8b_dual_cache_step": llada_8b_step("cuda"),
    }
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# GPU check on {result['device']}",
        "",
        f"copy bandwidth {result['copy_gb_s']:.0f} GB/s",
        "",
        "| kernel | dtype | max rel err | passed | ms | eager ms | GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['kernel']} | {r['dtype']} | {r['max_rel']:.1e} | {r['passed']} | {r['ms']:.3f} | "
        f"{r['eager_ms']:.3f} | {r['gb_s']:.0f} |"
        for r in result["kernels"]
    ]
    s = result["llada_8b_dual_cache_step"]
    lines += [
        "",
        f"LLaDA-8B-shaped bf16 step (block 32, context 1024): {s['step_ms']:.2f} ms vs weight-bytes floor "
        f"{s['weight_bytes_floor_ms']:.2f} ms ({s['ratio_to_floor']:.2f}x); {s['tokens_per_s_at_tpf']:.0f} tok/s at "
        f"{s['tokens_per_forward']} tokens/forward",
    ]
    (args.out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not all(r["passed"] for r in result["kernels"]):
        raise SystemExit("gpu_check: a kernel failed its tolerance")


if __name__ == "__main__":
    main()
