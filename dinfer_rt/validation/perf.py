"""Performance section: per-step latency percentiles, tokens/s and peak memory, with the
warm-up and iteration counts recorded (shared by ``dinfer-rt bench`` and ``validate``)."""

from __future__ import annotations

import resource
import statistics

from dinfer_rt.engine import run_batch
from dinfer_rt.model import Model
from dinfer_rt.sampling import SamplingParams


def measure(
    model: Model, prompts: list[list[int]], params: SamplingParams, warmup: int = 1, iters: int = 3, runner=None
) -> dict:
    """``runner``: what runs the forwards (``model_runner``; None: this process)."""
    for _ in range(warmup):
        run_batch(model, prompts, params, runner=runner)
    steps: list[float] = []
    tokens, wall = 0, 0.0
    for _ in range(iters):
        r = run_batch(model, prompts, params, runner=runner)
        steps += r.step_s
        tokens += int(r.committed.sum())
        wall += r.wall_s
    q = statistics.quantiles(steps, n=100) if len(steps) > 1 else steps * 99
    return {
        "backend": model.backend.describe(),
        "batch_size": len(prompts),
        "warmup": warmup,
        "iters": iters,
        "forwards": len(steps),
        "step_ms_p50": 1e3 * q[49],
        "step_ms_p90": 1e3 * q[89],
        "step_ms_p99": 1e3 * q[98],
        "tokens_per_s": tokens / wall if wall else 0.0,
        "tokens_per_batch_forward": tokens / len(steps),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
