"""Chunked prefill (issue #40 point 4): the step time of running rows while a long prompt
arrives beside them, in-process on a random LLaDA2-layout (block-causal) checkpoint.

Four short requests decode; after their second step a 416-token prompt is submitted. Three
engine configurations, the same requests:

- ``one forward``: chunking off, the default token budget (4096): the long prompt's first forward
  computes its whole sequence in one step beside the running rows (a step-time spike);
- ``chunked``: a 256-token budget, chunking on: its prompt blocks are prefilled over several steps
  within the budget, then it decodes;
- ``waits``: a 256-token budget, chunking off: it waits until the running rows leave room.

Reports, per configuration, the running rows' step times while the long request is in flight
(median and max), the long request's time to its first final token and its latency, and checks
that every answer is the same in the three (greedy; chunked prefill is exact).

    python benchmarks/prefill_bench.py [--repeats 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dinfer_rt.engine import Engine
from dinfer_rt.loader import load_model
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing import checkpoints

CHECKPOINT = dict(d=256, layers=4, heads=8, kv_heads=2, head_dim=32, experts=8, top_k=2, inter=256, dense_inter=512)
CONFIGS = {  # name -> EngineArgs fields
    "one forward": dict(max_num_batched_tokens=4096, max_prefill_chunk_tokens=0),
    "chunked": dict(max_num_batched_tokens=256),
    "waits": dict(max_num_batched_tokens=256, max_prefill_chunk_tokens=0),
}
SHORT = SamplingParams(strategy="low_confidence", steps=16, cache="dual", block_length=16, gen_length=64)
LONG = SamplingParams(strategy="low_confidence", steps=8, cache="dual", block_length=16, gen_length=32)


def run(model, name: str, short: list[list[int]], long: list[int]) -> dict:
    """One configuration: the running rows' step times while the long request is in flight."""
    engine = Engine(model, max_num_seqs=8, **CONFIGS[name])
    try:
        running = [engine.submit(p, SHORT) for p in short]
        for _ in range(2):
            engine.step()
        arrived = time.perf_counter()
        big = engine.submit(long, LONG)
        steps, first = [], None
        while not big.done:
            t0 = time.perf_counter()
            engine.step()
            if any(not r.done for r in running):
                steps.append(time.perf_counter() - t0)
            if first is None and big.final_ids:
                first = time.perf_counter() - arrived
        latency = time.perf_counter() - arrived
        engine.run_until_idle()
        return {
            "step_p50_ms": 1e3 * statistics.median(steps) if steps else 0.0,
            "step_max_ms": 1e3 * max(steps) if steps else 0.0,
            "first_token_s": first if first is not None else latency,
            "latency_s": latency,
            "prefill_chunks": engine.stats.prefill_chunks,
            "outputs": [r.output_ids for r in running] + [big.output_ids],
        }
    finally:
        engine.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(str(checkpoints.llada2(Path(tmp), **CHECKPOINT)), backend="cpu")
        vocab = model.spec.vocab - 8  # ordinary ids (no mask / special ids)
        short = [torch.randint(3, vocab, (32,), generator=g).tolist() for _ in range(4)]
        long = torch.randint(3, vocab, (416,), generator=g).tolist()
        run(model, "chunked", short, long)  # warm-up: every shape once
        results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
        for _ in range(a.repeats):  # configurations interleaved: drift lands on each alike
            for name in CONFIGS:
                results[name].append(run(model, name, short, long))
    same = all(r["outputs"] == results["one forward"][0]["outputs"] for rs in results.values() for r in rs)
    lines = [
        f"Random LLaDA2-layout checkpoint (d 256, 4 layers, 8 experts), CPU, in-process engine; 4 requests "
        f"(32-token prompts, 64 generated) decoding, a 416-token prompt arriving after their second step; "
        f"median of {a.repeats} runs per configuration.",
        "",
        "| configuration | running rows' step p50 ms | step max ms | long request: first final token s "
        "| latency s | prefill chunks |",
        "|---|---|---|---|---|---|",
    ]
    summary = {}
    for name, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "outputs"}
        summary[name] = med
        lines.append(
            f"| {name} | {med['step_p50_ms']:.1f} | {med['step_max_ms']:.1f} | {med['first_token_s']:.3f} "
            f"| {med['latency_s']:.3f} | {med['prefill_chunks']:.0f} |"
        )
    lines += ["", f"Identical answers in every configuration and run: {'yes' if same else 'NO'}."]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "prefill.md").write_text("\n".join(lines) + "\n")
    (a.out / "prefill.json").write_text(json.dumps({"configs": summary, "identical_outputs": same}, indent=1))
    print("\n".join(lines))
    if not same:
        raise SystemExit("answers differ between configurations")


if __name__ == "__main__":
    main()
