"""A/B: static batches through this tree's ``LLM.generate`` against another tree's (issue #37:
the one engine must keep >= 0.95x of the old ``generate_batch`` loop's tokens/s, same accuracy).

Each measurement runs in its own process with one tree first on ``sys.path`` (the backends and
native kernels come from the installed package, the same for both). The trees alternate row by
row, so the machine's drift lands on both alike; per row the median of ``--repeats`` runs.

    python benchmarks/engine_ab.py --other /tmp/main-checkout --limit 50 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROWS = [  # the sweep's rows that exercise each path: lockstep (none/dual/prefix), per-prompt cohorts (the rest)
    dict(strategy="low_confidence", cache="none", block_length=8),
    dict(strategy="threshold", cache="none", block_length=40, threshold=0.9),
    dict(strategy="threshold", cache="dual", block_length=8, threshold=0.9),
    dict(strategy="threshold", cache="prefix", block_length=8, threshold=0.9),
    dict(strategy="threshold", cache="adaptive", block_length=8, threshold=0.9),
    dict(strategy="threshold", cache="anchored", block_length=8, threshold=0.9),
    dict(strategy="threshold", cache="delayed", block_length=8, threshold=0.9),
]


def measure(limit: int, batch: int, row: int) -> dict:
    """This process's tree: one row at one batch size (after one warm-up call)."""
    from dinfer_rt.demo.bench import evaluate
    from dinfer_rt.llm import LLM
    from dinfer_rt.sampling import SamplingParams

    llm = LLM()
    llm.generate(["qwertyuiop"], SamplingParams())
    r = evaluate(llm, SamplingParams(batch_size=batch, early_stop=False, **ROWS[row]), limit=limit)
    return {"accuracy": r.accuracy, "tokens_per_s": r.tokens_per_s}


def run_tree(tree: str | None, limit: int, batch: int, row: int) -> dict:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--child", "--limit", str(limit), "--batches", str(batch), "--row", str(row)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", help="the tree to compare against (a checkout's root)")
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--batches", default="1,50")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--row", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a.child:
        print(json.dumps(measure(a.limit, batches[0], a.row)))
        return
    here = str(Path(__file__).resolve().parents[1])
    print("| batch | rule | cache | block | acc this | acc other | tok/s this | tok/s other | ratio |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for batch in batches:
        for i, row in enumerate(ROWS):
            this, other = [], []
            for _ in range(a.repeats):  # the two trees alternate, row by row
                this.append(run_tree(here, a.limit, batch, i))
                other.append(run_tree(a.other, a.limit, batch, i))
            t = statistics.median(r["tokens_per_s"] for r in this)
            o = statistics.median(r["tokens_per_s"] for r in other)
            print(
                f"| {batch} | {row['strategy']} | {row['cache']} | {row['block_length']} | {this[0]['accuracy']:.3f} "
                f"| {other[0]['accuracy']:.3f} | {t:.0f} | {o:.0f} | {t / o:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
