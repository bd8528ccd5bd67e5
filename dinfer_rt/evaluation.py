"""``dinfer-rt eval --data FILE.jsonl``: accuracy of generated answers on any prompt/answer file.

Each line is a JSON object; ``prompt_field`` and ``answer_field`` name its prompt and reference
answer. Metrics: ``exact`` (the output, stripped, equals the answer), ``contains`` (the answer
occurs in the output) and ``regex`` (the pattern's first group, or whole match, found in the
output equals the answer). Accuracy comes with a 95% Wilson score interval, which stays inside
[0, 1] and is honest for small samples and accuracies near 0 or 1.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from dinfer_rt.errors import DinferError
from dinfer_rt.files import check_output_file, write_text_atomic

METRICS = ("exact", "contains", "regex")


@dataclass
class Item:
    line: int
    prompt: str
    answer: str


@dataclass
class DataResult:
    accuracy: float
    ci_low: float
    ci_high: float
    correct: int
    n: int
    nfe: int
    tokens_per_s: float
    wall_s: float
    edits: int = 0  # token-to-token rewrites, all items (editing rules)
    post_steps: int = 0  # forwards after a block's last mask, all items (editing rules)

    def as_dict(self) -> dict:
        return asdict(self)


def read_items(path: Path, prompt_field: str, answer_field: str, limit: int | None = None) -> list[Item]:
    """The file's items; a malformed line or a missing field names the file, line and field."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DinferError(f"{path}: cannot read the data file ({e})") from None
    items = []
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DinferError(f"{path}:{no}: not a JSON object ({e.msg})") from None
        if not isinstance(row, dict):
            raise DinferError(f"{path}:{no}: expected a JSON object, got {type(row).__name__}")
        for name in (prompt_field, answer_field):
            if name not in row:
                raise DinferError(f"{path}:{no}: no field {name!r} (fields: {', '.join(sorted(row)) or 'none'})")
            if not isinstance(row[name], (str, int, float)) or isinstance(row[name], bool):
                raise DinferError(f"{path}:{no}: field {name!r} must be a string or number, got {row[name]!r}")
        items.append(Item(no, str(row[prompt_field]), str(row[answer_field])))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise DinferError(f"{path}: no items")
    return items


def encode_items(llm, items: list[Item], path: Path, chat: bool) -> list[list[int]]:
    """Each item's prompt as token ids; one the model cannot take (empty, text its tokenizer
    lacks, the mask token) is an error naming the file and line, not its index in the batch."""
    ids = []
    for it in items:
        try:
            ids.append(llm.encode(it.prompt, chat, where="the prompt"))
        except DinferError as e:
            raise type(e)(f"{path}:{it.line}: {e}") from None
    return ids


def scorer(metric: str, pattern: str | None = None):
    """``(output, answer) -> (correct, extracted)`` for ``metric``."""
    if metric not in METRICS:
        raise DinferError(f"unknown metric {metric!r}; choose one of: {', '.join(METRICS)}")
    if metric == "exact":
        return lambda out, ans: (out.strip() == ans.strip(), out.strip())
    if metric == "contains":
        return lambda out, ans: (ans.strip() in out, out.strip())
    if pattern is None:
        raise DinferError("metric 'regex' needs --regex PATTERN")
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise DinferError(f"--regex {pattern!r} is not a valid regular expression: {e}") from None

    def score(out: str, ans: str):
        m = rx.search(out)
        got = None if m is None else (m.group(1) if rx.groups else m.group(0))
        return (got is not None and got.strip() == ans.strip(), got)

    return score


def wilson(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion."""
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate_file(
    llm,
    params,
    path: Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    metric: str = "exact",
    pattern: str | None = None,
    limit: int | None = None,
    output: Path | None = None,
    progress: bool = True,
) -> DataResult:
    """Generate for every item, score it, optionally write per-item JSONL to ``output``."""
    import time

    score = scorer(metric, pattern)  # a bad metric or regex fails before any compute
    items = read_items(path, prompt_field, answer_field, limit)
    if output is not None:
        check_output_file(output, "output")
    start = time.perf_counter()
    prompts = encode_items(llm, items, path, params.chat)
    outs = llm.generate(prompts, params, progress=progress)
    wall = time.perf_counter() - start
    records, correct = [], 0
    for it, o in zip(items, outs):
        ok, got = score(o.text, it.answer)
        correct += ok
        records.append(
            {
                "line": it.line,
                "prompt": it.prompt,
                "answer": it.answer,
                "output": o.text,
                "extracted": got,
                "correct": bool(ok),
            }
        )
    if output is not None:
        write_text_atomic(Path(output), "".join(json.dumps(r) + "\n" for r in records))
    lo, hi = wilson(correct, len(items))
    batches = {i // params.batch_size: o.stats.nfe for i, o in enumerate(outs)}
    tokens = sum(o.stats.tokens for o in outs)
    return DataResult(
        correct / len(items),
        lo,
        hi,
        correct,
        len(items),
        sum(batches.values()),
        tokens / wall if wall > 0 else 0.0,
        wall,
        sum(o.stats.edits for o in outs),
        sum(o.stats.post_steps for o in outs),
    )
