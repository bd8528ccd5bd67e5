"""Held-out evaluation of the embedded model: accuracy, NFE, tokens per forward, tokens/s."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from dinfer_rt.demo import task
from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams


@dataclass
class EvalResult:
    accuracy: float
    nfe: int  # forwards summed over batches
    tpf: float  # committed tokens per forward (per row: tokens / forwards of its batch)
    tokens_per_s: float
    wall_s: float
    n: int
    forwards_by_precision: dict[str, int] = field(default_factory=dict)  # summed over batches
    edits: int = 0  # token-to-token rewrites over all items (editing rules)
    edits_per_forward: float = 0.0  # per row-forward, as tpf
    post_steps: int = 0  # row-forwards after a block's last mask (editing rules)

    def as_dict(self) -> dict:
        return asdict(self)


def evaluate(llm: LLM, params: SamplingParams, limit: int = task.HELDOUT_SIZE, progress: bool = False) -> EvalResult:
    items = task.heldout(limit)
    start = time.perf_counter()
    outs = llm.generate([it.letters for it in items], params, progress=progress)
    wall = time.perf_counter() - start
    correct = sum(task.check(it.letters, o.text) for it, o in zip(items, outs))
    tokens = sum(o.stats.tokens for o in outs)
    nfe_batches, by_precision = {}, {}
    for i, o in enumerate(outs):
        nfe_batches[i // params.batch_size] = o.stats.nfe
        by_precision[i // params.batch_size] = o.stats.precision_forwards
    per: dict[str, int] = {}
    for batch in by_precision.values():
        for k, v in batch.items():
            per[k] = per.get(k, 0) + v
    nfe = sum(nfe_batches.values())
    row_forwards = sum(o.stats.nfe for o in outs)
    return EvalResult(
        accuracy=correct / len(items),
        nfe=nfe,
        tpf=tokens / max(row_forwards, 1),
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        wall_s=wall,
        n=len(items),
        forwards_by_precision=per,
        edits=sum(o.stats.edits for o in outs),
        edits_per_forward=sum(o.stats.edits for o in outs) / max(row_forwards, 1),
        post_steps=sum(o.stats.post_steps for o in outs),
    )
