"""Token-to-token editing (``joint_threshold``, LLaDA2.1) against the threshold rule (issue #39).

The question: at equal accuracy, how many more tokens per forward does editing buy on our task,
and what does it cost in forwards after the last mask (post steps)? Two models:

- the embedded model on its held-out task (accuracy = the task's checker);
- a block-causal test checkpoint (``dinfer_rt.testing.checkpoints.llada2``, random weights, so
  no task): "accuracy" there is the exact-match rate against one-token-per-step greedy decoding
  (``low_confidence``, steps = gen length), the most careful decode of the same model.

Neither model was trained to rewrite its own tokens (LLaDA2.1 was), so this measures what editing
does to a model that was not: the mechanics and costs, not LLaDA2.1's gains. Writes
``results.json``, ``results.md`` (the table) and ``editing.png`` (accuracy against final tokens
per forward) to ``--out``.

    python benchmarks/editing_bench.py --limit 100 --out bench-out/editing
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dinfer_rt.demo.bench import evaluate
from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing import checkpoints

# (label, rule settings): the threshold rule, the two LLaDA2.1 presets, stricter edit thresholds
CONFIGS = [
    ("threshold 0.9", dict(strategy="threshold", threshold=0.9)),
    ("threshold 0.7", dict(strategy="threshold", threshold=0.7)),
    ("threshold 0.5", dict(strategy="threshold", threshold=0.5)),
    ("joint 0.7 / 0.5 / 16 (quality)", dict(strategy="joint_threshold", threshold=0.7, edit_threshold=0.5)),
    ("joint 0.5 / 0.0 / 16 (speed)", dict(strategy="joint_threshold", threshold=0.5, edit_threshold=0.0)),
    ("joint 0.7 / 0.9 / 16", dict(strategy="joint_threshold", threshold=0.7, edit_threshold=0.9)),
    ("joint 0.5 / 0.99 / 16", dict(strategy="joint_threshold", threshold=0.5, edit_threshold=0.99)),
    ("joint 0.5 / 0.99 / 2", dict(strategy="joint_threshold", threshold=0.5, edit_threshold=0.99, max_post_steps=2)),
    ("joint 0.7 / 1.0 / 1 (never edits)", dict(strategy="joint_threshold", threshold=0.7, edit_threshold=1.0,
                                               max_post_steps=1)),
]  # fmt: skip


def embedded_rows(limit: int, batch: int, block: int) -> list[dict]:
    llm = LLM()
    rows = []
    for label, rule in CONFIGS:
        params = SamplingParams(block_length=block, batch_size=batch, **rule)
        r = evaluate(llm, params, limit)
        rows.append(
            {
                "model": "embedded",
                "config": label,
                "accuracy": r.accuracy,
                "tokens_per_forward": r.tpf,
                "edits_per_forward": r.edits_per_forward,
                "post_steps_per_item": r.post_steps / r.n,
                "tokens_per_s": r.tokens_per_s,
                "items": r.n,
            }
        )
        print(rows[-1], flush=True)
    return rows


def block_causal_rows(limit: int, batch: int, block: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(checkpoints.llada2(Path(tmp) / "llada2"), backend="cpu")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(6, 60, (8,), generator=g).tolist() for _ in range(limit)]
        gen = 4 * block
        careful = SamplingParams(strategy="low_confidence", gen_length=gen, block_length=block, batch_size=batch,
                                 early_stop=False)  # fmt: skip
        want = [o.token_ids for o in llm.generate(prompts, careful)]
        rows = []
        for label, rule in CONFIGS:
            params = SamplingParams(gen_length=gen, block_length=block, batch_size=batch, early_stop=False, **rule)
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - start
            row_forwards = sum(o.stats.nfe for o in outs)
            tokens = sum(o.stats.tokens for o in outs)
            rows.append(
                {
                    "model": "llada2 test checkpoint",
                    "config": label,
                    "accuracy": sum(o.token_ids == w for o, w in zip(outs, want)) / len(outs),
                    "tokens_per_forward": tokens / max(row_forwards, 1),
                    "edits_per_forward": sum(o.stats.edits for o in outs) / max(row_forwards, 1),
                    "post_steps_per_item": sum(o.stats.post_steps for o in outs) / len(outs),
                    "tokens_per_s": tokens / wall if wall > 0 else 0.0,
                    "items": len(outs),
                }
            )
            print(rows[-1], flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| model | config (threshold / edit / post) | accuracy | final tokens/forward | edits/forward "
        "| post steps/item | tokens/s |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['config']} | {r['accuracy']:.3f} | {r['tokens_per_forward']:.2f} | "
            f"{r['edits_per_forward']:.2f} | {r['post_steps_per_item']:.1f} | {r['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in (r for r in rows if r["model"] == model):
            joint = r["config"].startswith("joint")
            ax.scatter(r["tokens_per_forward"], r["accuracy"], marker="o" if joint else "s",
                       color="tab:red" if joint else "tab:blue")  # fmt: skip
            ax.annotate(r["config"], (r["tokens_per_forward"], r["accuracy"]), fontsize=7)
        ax.set_title(model)
        ax.set_xlabel("final tokens per forward")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=100, help="held-out items (and block-causal prompts)")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("bench-out/editing"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = embedded_rows(a.limit, a.batch, a.block) + block_causal_rows(a.limit, a.batch, a.block)
    (a.out / "results.json").write_text(json.dumps({"limit": a.limit, "batch": a.batch, "rows": rows}, indent=1))
    (a.out / "results.md").write_text(table(rows))
    plot(rows, a.out / "editing.png")
    print(table(rows))


if __name__ == "__main__":
    main()
