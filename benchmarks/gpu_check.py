"""One device session's checks for a backend (cuda by default; rocm_dcu and ascend through
benchmarks/dcu_check.sh and ascend_check.sh), < 10 minutes on one H200: kernel correctness on
the device, kernel timings against torch eager, and an LLaDA-8B-shaped random-weight bf16 model
(dual cache, block 32, context 1024): ms per denoising forward against the weight-bytes /
bandwidth floor, and tokens/s at a fixed tokens-per-forward.
Writes gpu_check / dcu_check / ascend_check .json and .md to --out.

Status: run on one H200 in session 16 (results: benchmarks/results/h200/). Each section runs even
when another fails (its traceback goes into the JSON), and the JSON is rewritten after each one.
Not yet re-run after that session's last changes: the kernels-only profile filter, the
batch-1 cache policies with graphs, and the engine with graphs per batch-size bucket
(``engine_graph_buckets``; run on the CPU with a stand-in graph API by
``tests/test_graph_buckets.py``). ``--sections a,b`` runs only those sections.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dinfer_rt.config_writers import LLADA_8B
from dinfer_rt.ir import ops
from dinfer_rt.model import Model
from dinfer_rt.model_spec import param_plan, parse_spec
from dinfer_rt.plugins import select_backend

DEV = "cuda"  # the backend's torch device type ("cuda" for NVIDIA and HIP builds, "npu" for Ascend)


def sync() -> None:
    getattr(torch, DEV).synchronize()


def cuda_time(fn, iters: int = 50) -> float:
    """Median milliseconds of ``fn`` after a warm-up, synchronising the device around each call."""
    fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = cuda_time(lambda: y.copy_(x), 20)
    return 2 * x.numel() / (ms * 1e-3) / 1e9


def matmul_tflops() -> float:
    """The bf16 matmul ceiling this device reaches through torch (8192^3)."""
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = cuda_time(lambda: a @ a, 10)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


# Matmul work of the compute-bound cases (FLOPs), so their rows report TFLOP/s against the ceiling.
FLOPS = {
    "attention": 2 * 2 * 2 * 32 * 32 * 1024 * 128,  # batch 2, 32 heads, 32 queries, 1024 keys, QK and PV
    "moe_experts": 2 * 64 * 8 * 3 * 2048 * 1024,  # 64 tokens x top-8, gate/up/down at hidden 2048, width 1024
}


def _cases(k: dict, dtype: torch.dtype) -> dict:
    """kernel -> (ours, torch eager, float64 reference, bytes moved) on LLaDA-8B-sized inputs."""
    x = torch.randn(32, 4096, device=DEV, dtype=dtype)
    r = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(4096, device=DEV)).to(dtype)
    h = torch.randn(32, 2 * 12288, device=DEV, dtype=dtype)
    q = torch.randn(1, 32, 32, 128, device=DEV, dtype=dtype)
    pos = torch.arange(992, 1024, device=DEV)[None]
    rope = {"theta": 500000.0, "rotary_dim": 128}
    size = x.numel() * x.element_size()
    # a dual-cache block step: 32 queries, 8 of 32 heads' worth of KV (GQA 4), a 1024-slot cache
    qa = torch.randn(2, 32, 32, 128, device=DEV, dtype=dtype)
    ka, va = (torch.randn(2, 32, 8, 128, device=DEV, dtype=dtype) for _ in range(2))
    kc, vc = (torch.randn(2, 1024, 8, 128, device=DEV, dtype=dtype) for _ in range(2))
    valid, idx = torch.ones(2, 1024, dtype=torch.bool, device=DEV), torch.arange(992, 1024, device=DEV)
    att = {"scale": 128**-0.5, "block_size": 32}
    # LLaDA-MoE-shaped experts: 64 experts, top-8, hidden 2048, width 1024, 64 tokens
    xm = torch.randn(64, 2048, device=DEV, dtype=dtype)
    gu = (0.02 * torch.randn(64, 2048, 2048, device=DEV)).to(dtype)
    dn = (0.02 * torch.randn(64, 2048, 1024, device=DEV)).to(dtype)
    wm, im = ops.router_softmax_topk(torch.randn(64, 64, device=DEV), k=8, renormalize=False)
    return {
        "attention": (
            lambda: k["attention"](qa, ka, va, valid, idx, kc, vc, **att)[0],
            lambda: ops.attention(qa, ka, va, valid, idx, kc, vc, **att)[0],
            lambda: ops.attention(qa.double(), ka.double(), va.double(), valid, idx, kc.double(), vc.double(), **att)[
                0
            ],
            2 * 2 * kc.numel() * kc.element_size(),
        ),
        "moe_experts": (
            lambda: k["moe_experts"](xm, wm, im, gu, dn),
            lambda: ops.moe_experts(xm, wm, im, gu, dn),
            lambda: ops.moe_experts(xm.double(), wm.double(), im, gu.double(), dn.double()),
            int(im.unique().numel()) * 3 * 2048 * 1024 * xm.element_size(),
        ),
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
    k = {op: fn for op, (fn, _src) in backend.kernel_table().items()}  # ops without a kernel: the fallback
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
                    "tflops": FLOPS.get(name, 0) / (ms * 1e-3) / 1e12,
                }
            )
    return rows


def llada_8b_step(backend_name: str, context: int = 1024, block: int = 32, tpf: float = 4.0) -> dict:
    spec = parse_spec(Path("LLaDA-8B"), LLADA_8B)
    weights = {p.name: (torch.randn(p.shape, device=DEV, dtype=torch.bfloat16) * 0.02) for p in param_plan(spec)}
    backend = select_backend(backend_name)
    model = Model(Path("LLaDA-8B (random)"), spec, weights, None, backend, torch.bfloat16)
    ids = torch.randint(0, spec.vocab, (1, context), device="cpu")
    cache = model.new_cache(1, context)
    model.forward(ids, cache=cache)
    blk = torch.arange(context - block, context)
    step_ms = cuda_time(lambda: model.forward(ids, cache=cache, compute=blk), 20)
    # The generated straight-line program against the step interpreter it replaced, on the device.
    exe = model._compiled[next(k for k in model._compiled if k[0])]
    generated_out = model.forward(ids, cache=cache, compute=blk).float().clone()
    exe.run = exe._interpret
    interpreted = {
        "interpreted_step_ms": cuda_time(lambda: model.forward(ids, cache=cache, compute=blk), 20),
        "generated_vs_interpreted_max_abs": (model.forward(ids, cache=cache, compute=blk).float() - generated_out)
        .abs()
        .max()
        .item(),
    }
    exe.run = exe._program
    profile = step_profile(lambda: model.forward(ids, cache=cache, compute=blk))
    graphs = {}
    if backend.name == "cuda":  # the same step replayed from a CUDA graph (DINFER_GRAPHS=1)
        from dinfer_rt.backends.triton.graphs import GraphedExecutable

        key = next(k for k in model._compiled if k[0])
        eager_out = model.forward(ids, cache=cache, compute=blk).float().clone()
        model._compiled[key] = GraphedExecutable(model._compiled[key])
        graphed_out = model.forward(ids, cache=cache, compute=blk).float()
        graphs = {
            "graph_step_ms": cuda_time(lambda: model.forward(ids, cache=cache, compute=blk), 20),
            "graph_vs_eager_max_abs": (graphed_out - eager_out).abs().max().item(),
        }
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    floor_ms = weight_bytes / (copy_bandwidth_gbs() * 1e9) * 1e3
    start = time.perf_counter()
    model.forward(ids, cache=cache)  # a refresh, then block steps at the fixed tokens-per-forward
    steps = int(256 / tpf)
    for _ in range(steps):
        model.forward(ids, cache=cache, compute=blk)
    sync()
    wall = time.perf_counter() - start
    return {
        "step_ms": step_ms,
        "weight_bytes_floor_ms": floor_ms,
        "ratio_to_floor": step_ms / floor_ms,
        "tokens_per_s_at_tpf": 256 / wall,
        "tokens_per_forward": tpf,
        "generated": 256,
        "forwards": steps + 1,
        **interpreted,
        **graphs,
        "profile": profile,
    }


def step_profile(fn, steps: int = 3, top: int = 15) -> list[dict]:
    """Where a step's device time goes: torch.profiler's kernels, the ``top`` by device time, per
    step (the step is run once first so compiles and allocations stay out)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync()

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    # device-side kernels only: a CPU op (aten::mm) also reports the device time of the kernels
    # it launched, which would count them twice (the first H200 run's table did)
    events = [e for e in prof.key_averages() if device_us(e) > 0 and e.device_type != DeviceType.CPU]
    events.sort(key=device_us, reverse=True)
    total = sum(device_us(e) for e in events)
    rows = [
        {"kernel": e.key[:90], "ms_per_step": device_us(e) / steps / 1e3, "calls_per_step": e.count / steps}
        for e in events[:top]
    ]
    return [{"kernel": "(all device time)", "ms_per_step": total / steps / 1e3, "calls_per_step": 0}] + rows


def wq_tile_sweep(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> list[dict]:
    """linear_wq's launch tiles on this device (one layer shape), fastest first: the data a tuning
    row's gemm_* entries are chosen from."""
    import triton

    from dinfer_rt.backends.triton import kernels as kern

    m, k = x.shape
    n = q.shape[0]
    fp8 = q.dtype == torch.float8_e4m3fn
    qb = q.view(torch.uint8) if fp8 else q
    y = torch.empty(m, n, device=DEV, dtype=x.dtype)
    rows = []
    for bm in (16, 32):
        for bn in (32, 64, 128):
            for bk in (64, 128, 256):
                for warps in (4, 8):
                    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}
                    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))

                    def launch(cfg=cfg, grid=grid):
                        kern.linear_wq_kernel[grid](
                            x, qb, scale, scale, y, m, n, k, HAS_BIAS=False, FP8=fp8, DOT_F32=False, **cfg
                        )

                    try:
                        rows.append({**cfg, "ms": cuda_time(launch, 20)})
                    except Exception as e:  # a tile this arch cannot compile (shared memory, registers)
                        rows.append({**cfg, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
    return sorted(rows, key=lambda r: r.get("ms", float("inf")))


def quant_checks(backend) -> list[dict]:
    """Weight-only dequant GEMMs on LLaDA-8B-shaped layers (32 tokens x 4096 -> 4096 and 12288),
    bf16 activations: the backend's linear_wq kernel for int8 (and fp8 where the arch has it)
    against the bf16 GEMM, correctness against the float64 dequantised product; on NVIDIA also
    torch._scaled_mm (fp8 activations x fp8 weights, per-tensor activation scale) as the candidate
    the issue asks to measure."""
    from dinfer_rt import quant

    kernel = backend.kernel_table()["linear_wq"][0]
    rows = []
    x = torch.randn(32, 4096, device=DEV, dtype=torch.bfloat16)
    for out_f in (4096, 12288):
        w = torch.randn(out_f, 4096, device=DEV, dtype=torch.bfloat16) * 0.02
        bf16_ms = cuda_time(lambda w=w: torch.nn.functional.linear(x, w))
        for fmt in (f for f in quant.WEIGHT_FORMATS if f in backend.capabilities().weight_formats):
            q, scale = quant.quantize(w, fmt)
            want = x.double() @ (q.double() * scale.double()[:, None]).T
            got = kernel(x, q, scale)
            row = {
                "layer": f"{out_f}x4096",
                "format": fmt,
                "max_rel": ((got.double() - want).abs().max() / want.abs().max()).item(),
                "ms": cuda_time(lambda q=q, scale=scale: kernel(x, q, scale)),
                "bf16_ms": bf16_ms,
            }
            row["passed"] = row["max_rel"] <= 2e-2
            if out_f == 4096:
                row["tile_sweep"] = wq_tile_sweep(x, q, scale)[:6]
            if fmt == "fp8" and hasattr(torch, "_scaled_mm") and DEV == "cuda":
                xs = x.abs().max().float() / 448.0
                x8 = (x.float() / xs).to(torch.float8_e4m3fn)
                one = torch.ones((), device=DEV)

                def scaled(q=q, scale=scale, x8=x8, xs=xs, one=one):
                    return torch._scaled_mm(x8, q.t(), scale_a=xs, scale_b=one, out_dtype=torch.bfloat16) * scale

                try:
                    row["scaled_mm_ms"] = cuda_time(scaled)
                    row["scaled_mm_max_rel"] = ((scaled().double() - want).abs().max() / want.abs().max()).item()
                except RuntimeError as e:  # layout / arch constraints of _scaled_mm
                    row["scaled_mm_error"] = str(e).splitlines()[0]
            rows.append(row)
    return rows


def schedule_step_cost(backend_name: str, context: int = 1024, block: int = 32, low_share: float = 0.59) -> dict:
    """The LLaDA-8B-shaped dual-cache step in bf16 and with int8 (fp8) weights over the same model,
    and a schedule's cost per step at the low-precision share the embedded-model benchmark measured
    for int8@0.25 (59%, benchmarks/results/precision.md)."""
    spec = parse_spec(Path("LLaDA-8B"), LLADA_8B)
    weights = {p.name: (torch.randn(p.shape, device=DEV, dtype=torch.bfloat16) * 0.02) for p in param_plan(spec)}
    backend = select_backend(backend_name)
    model = Model(Path("LLaDA-8B (random)"), spec, weights, None, backend, torch.bfloat16)
    ids = torch.randint(0, spec.vocab, (1, context), device="cpu")
    cache = model.new_cache(1, context)
    model.forward(ids, cache=cache)
    blk = torch.arange(context - block, context)
    out = {"bf16_step_ms": cuda_time(lambda: model.forward(ids, cache=cache, compute=blk), 20)}
    for fmt in (f for f in ("int8", "fp8") if f in backend.capabilities().weight_formats):
        out[f"{fmt}_step_ms"] = cuda_time(lambda f=fmt: model.forward(ids, cache=cache, compute=blk, precision=f), 20)
        out[f"{fmt}_schedule_step_ms"] = low_share * out[f"{fmt}_step_ms"] + (1 - low_share) * out["bf16_step_ms"]
    return out


def serving_checks(backend_name: str) -> dict:
    """Continuous batching on the device: per-row query windows (token_index [B, T]) against the
    cpu reference on a block-causal checkpoint, and the engine's tokens/s against offline batched
    ``LLM.generate`` on the embedded task (64 prompts, 16 rows): the paged KV pool (the default:
    per-layer gather / scatter through the block table) and contiguous rows (``kv_block_size=0``),
    each with its outputs compared to offline."""
    import tempfile

    import dinfer_rt
    from dinfer_rt.demo import task
    from dinfer_rt.engine import Engine
    from dinfer_rt.sampling import SamplingParams
    from dinfer_rt.testing import checkpoints, per_row_windows

    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoints.llada2(Path(tmp))
        err = per_row_windows.per_row_error(
            dinfer_rt.load_model(path, backend=backend_name), dinfer_rt.load_model(path, backend="cpu")
        )
    llm = dinfer_rt.LLM(backend=backend_name)
    prompts = [llm.encode(it.letters, True) for it in task.heldout(64)]
    params = SamplingParams(strategy="threshold", block_length=8, batch_size=16)
    llm.generate(prompts[:16], params)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    offline_s = time.perf_counter() - t0

    def serve_all(engine: Engine, ids: list[list[int]]) -> list:
        # submitted together, as a burst reaches the server: equal greedy settings merge into
        # lockstep cohorts of up to max_num_seqs rows (requests arriving later run per-row)
        reqs = [engine.submit(p, params) for p in ids]
        engine.run_until_idle()
        return reqs

    serve_all(Engine(llm.model, max_num_seqs=16), prompts[:16])
    engine = Engine(llm.model, max_num_seqs=16)
    t0 = time.perf_counter()
    reqs = serve_all(engine, prompts)
    engine_s = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    same = sum(r.output_ids == o.token_ids for r, o in zip(reqs, outs))
    rows = Engine(llm.model, max_num_seqs=16, kv_block_size=0)  # contiguous rows: the gather's cost
    serve_all(rows, prompts[:16])
    t0 = time.perf_counter()
    rows_reqs = serve_all(rows, prompts)
    rows_s = time.perf_counter() - t0
    return {
        "engine_rows_tokens_per_s": tokens / rows_s,
        "engine_rows_equal_outputs": f"{sum(r.output_ids == o.token_ids for r, o in zip(rows_reqs, outs))}/{len(outs)}",
        "per_row_max_rel": err,
        "per_row_passed": err <= 1e-4,
        "offline_tokens_per_s": tokens / offline_s,
        "engine_tokens_per_s": tokens / engine_s,
        "engine_equal_outputs": f"{same}/{len(outs)}",
        "engine_lockstep_steps": engine.stats.lockstep_steps,
        "engine_per_row_steps": engine.stats.per_row_steps,
        "engine_padded_share": engine.stats.padded_tokens / max(engine.stats.computed_tokens, 1),
    }


def engine_graph_buckets(
    backend_name: str, model=None, sizes=(1, 3, 5, 16), limit: int = 64, max_num_seqs: int = 16
) -> dict:
    """The engine's lockstep path with device graphs per batch-size bucket (``DINFER_GRAPHS=1``,
    issue #41 point 1): the buckets warmed up (``Engine.capture_graphs``: its time and
    captures), static batches of ``sizes`` rows (tokens against the same engine eager, then
    captures per bucket: a size sharing a bucket adds none), and a burst of ``limit`` embedded-task
    requests (``max_num_seqs`` rows) graphed against eager: tokens/s and equal outputs. ``model``: a model
    whose backend already replays graphs (the CPU test passes one with a stand-in API)."""
    import os

    import dinfer_rt
    from dinfer_rt import envs
    from dinfer_rt.demo import task
    from dinfer_rt.engine import Engine
    from dinfer_rt.sampling import SamplingParams

    if model is None:
        os.environ[envs.DINFER_GRAPHS] = "1"  # read when the model is loaded and each executable compiled
        try:
            model = dinfer_rt.LLM(backend=backend_name).model
        finally:
            os.environ.pop(envs.DINFER_GRAPHS)
    llm = dinfer_rt.LLM(model)
    prompts = [llm.encode(it.letters, True) for it in task.heldout(max(limit, max(sizes)))]
    params = SamplingParams(strategy="threshold", block_length=8)
    graphed = Engine(model, max_num_seqs=max_num_seqs)
    eager = Engine(model, max_num_seqs=max_num_seqs, graphs=False)
    t0 = time.perf_counter()
    warm = graphed.capture_graphs(params, prompt_len=len(prompts[0]))
    warm_s = time.perf_counter() - t0

    def run(engine: Engine, ids: list[list[int]], batch: bool) -> tuple[list, float]:
        sync()
        t0 = time.perf_counter()
        reqs = engine.submit_batch(ids, params) if batch else [engine.submit(p, params) for p in ids]
        engine.run_until_idle()
        sync()
        return [r.output_ids for r in reqs], time.perf_counter() - t0

    rows = []
    for size in sizes:
        before = graphed.graph_stats()["captures"]
        got, wall = run(graphed, prompts[:size], True)
        want, eager_wall = run(eager, prompts[:size], True)
        rows.append(
            {
                "rows": size,
                "bucket": graphed.buckets.bucket_of(size) or "eager",
                "equal": f"{sum(a == b for a, b in zip(got, want))}/{size}",
                "new_captures": graphed.graph_stats()["captures"] - before,
                "graphed_s": wall,
                "eager_s": eager_wall,
            }
        )
    # lone requests whose prompts differ in length (graph_length_step: one capture per length
    # bucket, not per length): after the first, none should capture
    lengths = []
    for cut in (0, 1, 2, 3):
        ids = [prompts[cut][: max(1, len(prompts[cut]) - cut)]]
        before = graphed.graph_stats()["captures"]
        got, _ = run(graphed, ids, False)
        want, _ = run(eager, ids, False)
        lengths.append({"prompt": len(ids[0]), "equal": got == want, "new": graphed.graph_stats()["captures"] - before})
    run(graphed, prompts[:max_num_seqs], False)  # warm both at the burst's shapes
    run(eager, prompts[:max_num_seqs], False)
    got, graphed_s = run(graphed, prompts[:limit], False)
    want, eager_s = run(eager, prompts[:limit], False)
    tokens = sum(len(o) for o in want)
    stats = graphed.graph_stats()
    return {
        "buckets": list(graphed.graph_buckets),
        "warmup_s": warm_s,
        "warmup_captures_by_rows": warm["captures_by_rows"],
        "static_batches": rows,
        "length_step": graphed.args.graph_length_step,
        "lengths_equal": f"{sum(x['equal'] for x in lengths)}/{len(lengths)}",
        "lengths_prompt_tokens": [x["prompt"] for x in lengths],
        "lengths_new_captures_after_first": sum(x["new"] for x in lengths[1:]),
        "burst_equal_outputs": f"{sum(a == b for a, b in zip(got, want))}/{len(want)}",
        "burst_graphed_tokens_per_s": tokens / graphed_s,
        "burst_eager_tokens_per_s": tokens / eager_s,
        "captures_by_rows": stats["captures_by_rows"],
        "captures": stats["captures"],
        "replays": stats["replays"],
        "eager_calls": stats["eager_calls"],
        "evictions": stats["evictions"],
        "graph_bytes": stats["graph_bytes"],
        "graph_forwards": stats["graph_forwards"],
        "eager_forwards": stats["eager_forwards"],
        "padded_rows": stats["padded_rows"],
    }


def editing_checks(backend_name: str) -> dict:
    """LLaDA2.1's token-to-token editing rule (``joint_threshold``, issue #39) on the device:
    tokens against the cpu backend's, tokens/s, edits per forward (embedded model, 64 held-out
    prompts, batch 16; the model was not trained to edit, so accuracy is not the point here)."""
    import dinfer_rt
    from dinfer_rt.demo import task
    from dinfer_rt.sampling import SamplingParams

    prompts = [it.letters for it in task.heldout(64)]
    rows = {}
    for preset, edit in (("quality", 0.5), ("never edits", 1.0)):
        params = SamplingParams(
            strategy="joint_threshold", threshold=0.7, edit_threshold=edit, block_length=8, batch_size=16
        )
        dev, cpu = dinfer_rt.LLM(backend=backend_name), dinfer_rt.LLM(backend="cpu")
        dev.generate(prompts[:16], params)  # warm-up
        t0 = time.perf_counter()
        outs = dev.generate(prompts, params)
        wall = time.perf_counter() - t0
        ref = cpu.generate(prompts, params)
        rows[preset] = {
            "equal_to_cpu": f"{sum(o.token_ids == r.token_ids for o, r in zip(outs, ref))}/{len(outs)}",
            "tokens_per_s": sum(o.stats.tokens for o in outs) / wall,
            "edits_per_forward": sum(o.stats.edits for o in outs) / max(sum(o.stats.nfe for o in outs), 1),
        }
    return rows


def cache_policy_checks(backend_name: str) -> list[dict]:
    """The cache policies on the device: accuracy and tokens/s on the embedded task (200 held-out
    prompts, batch 50, threshold 0.9, block 8), as the CPU sweep measures them."""
    import dinfer_rt
    from dinfer_rt.demo import task
    from dinfer_rt.sampling import SamplingParams

    llm = dinfer_rt.LLM(backend=backend_name)
    items = task.heldout(200)
    rows = []
    # delayed: on a device with the commit kernel it computes the whole block (no host sync)
    for cache in ("none", "dual", "adaptive", "anchored", "delayed"):
        params = SamplingParams(strategy="threshold", threshold=0.9, block_length=8, batch_size=50, cache=cache)
        llm.generate([it.letters for it in items[:50]], params)  # warm-up: compile, allocate
        t0 = time.perf_counter()
        outs = llm.generate([it.letters for it in items], params)
        wall = time.perf_counter() - t0
        correct = sum(task.check(it.letters, o.text) for it, o in zip(items, outs))
        tokens = sum(o.stats.tokens for o in outs)
        rows.append({"cache": cache, "batch": 50, "accuracy": correct / len(items), "tokens_per_s": tokens / wall})
    rows += graphed_batch1_policies(items[:50])
    return rows


def graphed_batch1_policies(items: list) -> list[dict]:
    """Batch 1 with CUDA graphs (DINFER_GRAPHS=1), uncached against cached: the scheduler's caches
    come from the model's pool, so each policy's graphs are captured for the first prompt and
    replayed for the rest (session 16 measured cached 0.15-0.35x of uncached before the pool)."""
    import os

    import dinfer_rt
    from dinfer_rt import envs
    from dinfer_rt.demo import task
    from dinfer_rt.sampling import SamplingParams

    os.environ[envs.DINFER_GRAPHS] = "1"  # read when each executable is compiled
    try:
        llm = dinfer_rt.LLM(backend="cuda")
        rows = []
        for cache in ("none", "dual", "anchored", "delayed"):
            params = SamplingParams(strategy="threshold", threshold=0.9, block_length=8, batch_size=1, cache=cache)
            llm.generate([it.letters for it in items[:2]], params)  # warm-up: compile, capture
            t0 = time.perf_counter()
            outs = llm.generate([it.letters for it in items], params)
            wall = time.perf_counter() - t0
            correct = sum(task.check(it.letters, o.text) for it, o in zip(items, outs))
            tokens = sum(o.stats.tokens for o in outs)
            rows.append(
                {
                    "cache": f"{cache}, graphs",
                    "batch": 1,
                    "accuracy": correct / len(items),
                    "tokens_per_s": tokens / wall,
                }
            )
        return rows
    finally:
        os.environ.pop(envs.DINFER_GRAPHS)


def run_sections(sections: dict, result: dict, out_json: Path) -> None:
    """Run each section in turn; one that raises is recorded with its traceback and the next one
    still runs, and the JSON is rewritten after every section, so a run stopped at its time limit
    (or a crash in one kernel) still leaves everything measured before it."""
    import traceback

    for key, fn in sections.items():
        t0 = time.perf_counter()
        print(f"gpu_check: {key} ...", flush=True)
        try:
            result[key] = fn()
        except Exception as e:  # recorded, reported in the markdown, and the run goes on
            result[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(result[key]["traceback"], flush=True)
        result.setdefault("section_s", {})[key] = round(time.perf_counter() - t0, 1)
        print(f"gpu_check: {key} done in {result['section_s'][key]} s", flush=True)
        out_json.write_text(json.dumps(result, indent=1, default=str))


def failed(section) -> str | None:
    """The error text of a section that raised, else None."""
    return section.get("error") if isinstance(section, dict) else None


def render(result: dict) -> list[str]:
    """The markdown report; a section that raised shows its error instead of its table."""
    lines = [f"# Device check on {result['device']}", ""]
    for key in result.get("section_s", {}):
        if failed(result.get(key)):
            lines += [f"**{key} failed**: `{failed(result[key])}`", ""]
    if result.get("ceilings") and not failed(result["ceilings"]):
        c = result["ceilings"]
        lines += [
            f"ceilings: copy bandwidth {c['copy_gb_s']:.0f} GB/s, bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s",
            "",
        ]
    if isinstance(result.get("kernels"), list):
        ceilings = result.get("ceilings") if not failed(result.get("ceilings")) else None
        copy_gbs = ceilings["copy_gb_s"] if ceilings else float("nan")
        tflops = ceilings["matmul_tflops"] if ceilings else float("nan")
        lines += [
            "| kernel | dtype | max rel err | passed | ms | eager ms | GB/s | % of copy | TFLOP/s | % of matmul |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['kernel']} | {r['dtype']} | {r['max_rel']:.1e} | {r['passed']} | {r['ms']:.3f} | "
            f"{r['eager_ms']:.3f} | {r['gb_s']:.0f} | {100 * r['gb_s'] / copy_gbs:.0f} | "
            f"{r['tflops']:.1f} | {100 * r['tflops'] / tflops:.0f} |"
            for r in result["kernels"]
        ]
    s = result.get("llada_8b_dual_cache_step")
    if s and not failed(s):
        lines += [
            "",
            f"LLaDA-8B-shaped bf16 step (block 32, context 1024): {s['step_ms']:.2f} ms vs weight-bytes floor "
            f"{s['weight_bytes_floor_ms']:.2f} ms ({s['ratio_to_floor']:.2f}x); {s['tokens_per_s_at_tpf']:.0f} tok/s "
            f"at {s['tokens_per_forward']} tokens/forward",
            f"same step through the step interpreter: {s['interpreted_step_ms']:.2f} ms "
            f"(max |generated - interpreted| = {s['generated_vs_interpreted_max_abs']:.2e})",
        ]
        if "graph_step_ms" in s:
            lines.append(
                f"CUDA-graph replay of that step: {s['graph_step_ms']:.2f} ms "
                f"(max |graphed - eager| = {s['graph_vs_eager_max_abs']:.2e})"
            )
        if s.get("profile"):
            lines += ["", "| device time of one step, by kernel | ms per step | calls per step |", "|---|---|---|"]
            lines += [f"| `{r['kernel']}` | {r['ms_per_step']:.3f} | {r['calls_per_step']:.0f} |" for r in s["profile"]]
    v = result.get("serving")
    if v and not failed(v):
        lines.append(
            f"continuous batching: per-row windows max rel err {v['per_row_max_rel']:.1e} "
            f"(passed {v['per_row_passed']}); engine (paged KV) {v['engine_tokens_per_s']:.0f} tok/s, contiguous "
            f"rows {v['engine_rows_tokens_per_s']:.0f} tok/s, vs offline batched {v['offline_tokens_per_s']:.0f} "
            f"tok/s; outputs equal {v['engine_equal_outputs']} (paged), {v['engine_rows_equal_outputs']} (rows)"
        )
    gb = result.get("engine_graph_buckets")
    if gb and not failed(gb):
        lines += [
            "",
            f"engine with device graphs per batch-size bucket {gb['buckets']}: warm-up {gb['warmup_s']:.1f} s "
            f"(captures per rows {gb['warmup_captures_by_rows']}); burst of requests graphed "
            f"{gb['burst_graphed_tokens_per_s']:.0f} tok/s vs eager {gb['burst_eager_tokens_per_s']:.0f} tok/s, "
            f"outputs equal {gb['burst_equal_outputs']}; captures {gb['captures']} per rows {gb['captures_by_rows']}, "
            f"replays {gb['replays']}, eager calls {gb['eager_calls']}, evictions {gb['evictions']}, "
            f"graph memory {gb['graph_bytes'] / 2**20:.0f} MiB, padded rows {gb['padded_rows']}",
            f"prompts of {gb['lengths_prompt_tokens']} tokens alone (length step {gb['length_step']}): outputs "
            f"equal {gb['lengths_equal']}, captures after the first {gb['lengths_new_captures_after_first']}",
            "",
            "| static batch rows | bucket | equal to eager | new captures | graphed s | eager s |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['rows']} | {r['bucket']} | {r['equal']} | {r['new_captures']} | {r['graphed_s']:.3f} | "
            f"{r['eager_s']:.3f} |"
            for r in gb["static_batches"]
        ]
    e = result.get("editing")
    if e and not failed(e):
        lines += ["", "| joint_threshold (0.7, b8, batch 16) | equal to cpu | tokens/s | edits per forward |"]
        lines += ["|---|---|---|---|"]
        lines += [
            f"| edit threshold: {k} | {r['equal_to_cpu']} | {r['tokens_per_s']:.0f} | {r['edits_per_forward']:.2f} |"
            for k, r in e.items()
        ]
    if isinstance(result.get("cache_policies"), list):
        lines += ["", "| cache policy (embedded task, threshold 0.9, b8) | batch | accuracy | tokens/s |"]
        lines += ["|---|---|---|---|"]
        lines += [
            f"| {r['cache']} | {r['batch']} | {r['accuracy']:.3f} | {r['tokens_per_s']:.0f} |"
            for r in result["cache_policies"]
        ]
    if isinstance(result.get("quantized_gemm"), list):
        lines += [
            "",
            "| dequant GEMM | format | max rel err | passed | ms | bf16 GEMM ms | _scaled_mm ms |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['layer']} | {r['format']} | {r['max_rel']:.1e} | {r['passed']} | {r['ms']:.3f} | "
            f"{r['bf16_ms']:.3f} | {r.get('scaled_mm_ms', r.get('scaled_mm_error', '-'))} |"
            for r in result["quantized_gemm"]
        ]
        for r in result["quantized_gemm"]:
            if r.get("tile_sweep"):
                best = ", ".join(
                    f"{t['BLOCK_M']}x{t['BLOCK_N']}x{t['BLOCK_K']}/{t['num_warps']}w {t['ms']:.3f} ms"
                    for t in r["tile_sweep"]
                    if "ms" in t
                )
                lines.append(f"- linear_wq {r['format']} {r['layer']} fastest tiles (M x N x K / warps): {best}")
    p = result.get("precision_schedule_step")
    if p and not failed(p):
        lines.append(f"precision schedule on the LLaDA-8B-shaped step: {p}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--backend", default="cuda", help="cuda, rocm_dcu[:flavour[:arch]] or ascend")
    ap.add_argument("--sections", default="", help="comma-separated sections to run (default: all)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    global DEV
    backend = select_backend(args.backend)  # the standard unavailable-backend error if there is no device
    DEV = backend.device_type
    name = backend.describe()
    stem = {"cuda": "gpu_check", "npu": "ascend_check"}.get(DEV, "gpu_check")
    stem = "dcu_check" if backend.name == "rocm_dcu" else stem
    result = {
        "device": f"{name} ({getattr(torch, DEV).get_device_name()})",
        "backend": name,
        "versions": backend.versions(),
        "torch": torch.__version__,
    }
    sections = {
        "ceilings": lambda: {"copy_gb_s": copy_bandwidth_gbs(), "matmul_tflops": matmul_tflops()},
        "kernels": lambda: kernel_checks(backend),
        "quantized_gemm": lambda: quant_checks(backend),
        "llada_8b_dual_cache_step": lambda: llada_8b_step(args.backend),
        "serving": lambda: serving_checks(args.backend),
        "engine_graph_buckets": lambda: engine_graph_buckets(args.backend),
        "editing": lambda: editing_checks(args.backend),
        "cache_policies": lambda: cache_policy_checks(args.backend),
        "precision_schedule_step": lambda: schedule_step_cost(args.backend),
    }
    if args.sections:
        unknown = sorted(set(args.sections.split(",")) - set(sections))
        if unknown:
            raise SystemExit(f"unknown section(s) {unknown}; known: {', '.join(sections)}")
        sections = {k: v for k, v in sections.items() if k in args.sections.split(",")}
    run_sections(sections, result, args.out / f"{stem}.json")
    lines = render(result)
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    checked = [r for key in ("kernels", "quantized_gemm") if isinstance(result.get(key), list) for r in result[key]]
    errors = [key for key in sections if failed(result.get(key))]
    sv = result.get("serving")
    serving_ok = (
        not isinstance(sv, dict)
        or failed(sv) is not None
        or (
            sv.get("per_row_passed", False)
            and all(
                a == b for a, b in (sv[k].split("/") for k in ("engine_equal_outputs", "engine_rows_equal_outputs"))
            )
        )
    )
    gb = result.get("engine_graph_buckets")
    if isinstance(gb, dict) and not failed(gb):  # graphed tokens must equal eager ones
        equal = [gb["burst_equal_outputs"], gb["lengths_equal"]] + [r["equal"] for r in gb["static_batches"]]
        serving_ok = serving_ok and all(a == b for a, b in (e.split("/") for e in equal))
    if errors or not all(r["passed"] for r in checked) or not serving_ok:
        raise SystemExit(f"{stem}: failed sections {errors}, or a kernel out of its tolerance (see the report)")


if __name__ == "__main__":
    main()
