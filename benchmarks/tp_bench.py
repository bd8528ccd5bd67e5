"""Tensor parallelism on this CPU: per-forward time, per-rank weight bytes and the all-reduce
volume of TP 1 and 2 on a mid-size random LLaDA-layout checkpoint (134M parameters, written here).

    python benchmarks/tp_bench.py [--tokens 96] [--iters 5] [--out benchmarks/results]

The forward is the scheduler's step: the fused confidence head over every computed position. The
collective volume is measured (bytes each rank all-reduced per forward) and compared with the
analytic minimum: 2 all-reduces of [tokens x hidden] per layer, plus the vocabulary-parallel
confidence head's 4 numbers per position (max, argmax, sum exp; the logits would be
[tokens x vocab], all-gathered: shown for comparison). On a
2-core machine TP 2 gives each rank one core, and gloo moves the partial sums through loopback
TCP: it is not expected to be faster here; the numbers show the cost structure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dinfer_rt import parallel
from dinfer_rt.ir import ops
from dinfer_rt.testing import checkpoints


def bench_worker(rank: int, world: int, path: str, tokens: int, iters: int) -> dict:
    model = parallel.load_sharded(path, rank, world) if world > 1 else _load(path)
    ids = torch.randint(0, model.spec.vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    select = torch.arange(tokens)

    def step():
        return model.confidence(ids, select=select)

    step()  # warm-up
    ops.COLLECTIVE_BYTES.clear()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    held = sum(w.numel() * w.element_size() for k, w in model.weights.items() if "|" not in k)
    return {
        "ms": 1000 * statistics.median(times),
        "bytes_read": model.bytes_read,
        "bytes_held": held,
        "allreduce_bytes_per_forward": ops.COLLECTIVE_BYTES.get("tp", 0) / iters,
        "lm_head_bytes_per_forward": ops.COLLECTIVE_BYTES.get("tp/lm_head", 0) / iters,
        "threads": torch.get_num_threads(),
    }


def persistent(path: str, tokens: int) -> dict:
    """``LLM`` at TP 1 and TP 2 (workers that stay up): the time to start, the first and the
    second ``generate`` call (the second starts no process and reads no weight), and the engine's
    wall time per forward, next to the bare forward above: the cost of the seam (rank 0 sends
    each forward's inputs, the other rank runs them)."""
    from dinfer_rt.llm import LLM
    from dinfer_rt.sampling import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 32000, (2, tokens - 16), generator=g).tolist()
    params = SamplingParams(gen_length=16, block_length=16, strategy="low_confidence", steps=8, early_stop=False)
    out = {}
    for tp in (1, 2):
        t0 = time.perf_counter()
        llm = LLM(path, backend="cpu", tensor_parallel_size=tp)
        start = time.perf_counter() - t0
        calls = []
        for _ in range(2):
            t0 = time.perf_counter()
            res = llm.generate(prompts, params)
            calls.append((time.perf_counter() - t0, res[0].stats.nfe))
        llm.close()
        out[tp] = {
            "start_s": start,
            "first_s": calls[0][0],
            "second_s": calls[1][0],
            "ms_per_forward": 1000 * calls[1][0] / calls[1][1],
        }
    return out


def _load(path: str):
    from dinfer_rt.loader import load_model

    return load_model(path, backend="cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(
            checkpoints.llada(Path(tmp), d=768, layers=12, heads=12, mlp=2048, vocab=32000, max_len=1100, seed=3)
        )
        rows = {1: bench_worker(0, 1, path, a.tokens, a.iters)}
        rows[2] = parallel.launch(2, bench_worker, path, a.tokens, a.iters, timeout=900)
        kept = persistent(path, a.tokens)
    # 2 all-reduces of [tokens x hidden] fp32 per layer + the confidence head's 4 numbers per position
    minimum = 2 * 12 * a.tokens * 768 * 4 + 4 * a.tokens * 4
    logits_gather = a.tokens * 32000 * 4  # what gathering the logits instead would move
    lines = [
        f"Mid-size random LLaDA (134M, d 768, 12 layers, vocab 32000, fp32), one forward of {a.tokens} tokens, "
        f"median of {a.iters}; rank 0's numbers. One run on this 2-core machine.",
        "",
        "| TP | ms per step | threads per rank | weight bytes read | weight bytes held | collective bytes / step "
        "| of which the LM head | analytic minimum |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tp, r in rows.items():
        lines.append(
            f"| {tp} | {r['ms']:.1f} | {r['threads']} | {r['bytes_read'] / 1e6:.1f} MB "
            f"| {r['bytes_held'] / 1e6:.1f} MB | {r['allreduce_bytes_per_forward'] / 1e6:.3f} MB "
            f"| {r['lm_head_bytes_per_forward'] / 1e3:.1f} kB | {(minimum if tp > 1 else 0) / 1e6:.3f} MB |"
        )
    lines += ["", f"Gathering the logits instead of the head's statistics would move {logits_gather / 1e6:.1f} MB."]
    lines += [
        "",
        f"`LLM(tensor_parallel_size=N)`, 2 prompts of {a.tokens - 16} tokens + 16 generated (8 forwards), rank 0 "
        "running the engine and sending each forward's inputs to the other rank (`model_runner`):",
        "",
        "| TP | start (spawn + load) s | first generate s | second generate s | engine ms per forward "
        "| bare forward ms (above) |",
        "|---|---|---|---|---|---|",
    ]
    for tp, r in kept.items():
        lines.append(
            f"| {tp} | {r['start_s']:.2f} | {r['first_s']:.2f} | {r['second_s']:.2f} | {r['ms_per_forward']:.1f} "
            f"| {rows[tp]['ms']:.1f} |"
        )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "tp.md").write_text("\n".join(lines) + "\n")
    record = {"rows": rows, "analytic_allreduce_bytes": minimum, "persistent": kept}
    (a.out / "tp.json").write_text(json.dumps(record, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
