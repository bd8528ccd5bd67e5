"""The accuracy effect of the approximate prefix cache (``--prefix-cache approximate``) on a
bidirectional model: the embedded default model (LLaDA layout) on its held-out task.

Two shared-prompt workloads, each request served alone, one after the other (the way a later
request finds an earlier one's blocks; requests waiting together would merge into one cohort and
look nothing up):

- **shared prefix**: groups of ``--group`` prompts sharing BOS and their first 7 letters (8
  tokens); the other 3 letters differ (drawn, distinct). The first of a group misses and caches
  its prompt blocks; the others hit its first block(s) and decode with them frozen.
- **repeat**: each prompt twice; the second hits every whole block of the prompt.

Each workload runs twice per (cache policy, block length): on a cold engine (no prefix cache: the
default for a bidirectional model) and on an engine with ``prefix_cache="approximate"``, the same
requests in the same order (alternating, request by request, between the two engines).
Reported: accuracy of both (``demo.task.check``: any valid answer),
accuracy over the requests that hit, token agreement (generated ids equal at the same slot, over
the hits), identical answers (over the hits), hit rate (hit tokens / prompt tokens), query slots
computed (approximate / cold) and wall time (approximate / cold; noisy on a shared 2-core CPU).
``anchored`` is a control: the approximate cache leaves it alone (no lookup), so it must read
100% identical with 0 hits.

    .venv/bin/python benchmarks/prefix_approx_accuracy.py            # the table in results/
    .venv/bin/python benchmarks/prefix_approx_accuracy.py --quick     # a smoke run, not written
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import dinfer_rt
from dinfer_rt.demo import task
from dinfer_rt.engine import Engine
from dinfer_rt.sampling import SamplingParams

OUT = Path(__file__).parent / "results" / "prefix_cache_approximate.md"
SHARED = 7  # letters a group shares (with BOS: 8 prompt tokens)


@dataclass
class Served:
    ids: list[int]
    ok: bool
    cached: int


@dataclass
class Row:
    workload: str
    cache: str
    block: int
    n: int
    hits: int
    acc_cold: float
    acc_approx: float
    acc_cold_hits: float
    acc_approx_hits: float
    agreement: float
    identical: float
    hit_rate: float
    computed: float
    wall: float


def workloads(groups: int, group: int, repeats: int, seed: int) -> dict[str, list[str]]:
    """The letters of each request, in serving order, per workload."""
    rng = random.Random(seed)
    items = task.heldout(groups + repeats)
    shared: list[str] = []
    for it in items[:groups]:
        head = it.letters[:SHARED]
        rest = [c for c in task.LETTERS if c not in head]
        shared.append(it.letters)
        for _ in range(group - 1):
            shared.append(head + "".join(rng.sample(rest, task.N_LETTERS - SHARED)))
    repeat = [it.letters for it in items[groups:] for _ in range(2)]
    return {"shared prefix": shared, "repeat": repeat}


def serve(model, llm, letters: list[str], params: SamplingParams):
    """Each request alone, in order, on a cold engine and then on an approximate one (alternating
    request by request, so load drift on a shared machine hits both alike): per engine its
    results, query slots computed and wall seconds; and the approximate engine."""
    engines = (
        Engine(model, max_num_seqs=1, prefix_cache_bytes=0),
        Engine(model, max_num_seqs=1, prefix_cache="approximate"),
    )
    out: tuple[list[Served], list[Served]] = ([], [])
    wall = [0.0, 0.0]
    for s in letters:
        ids = llm.encode(s, True)
        for k, engine in enumerate(engines):
            t0 = time.perf_counter()
            req = engine.submit(ids, params)
            engine.run_until_idle()
            wall[k] += time.perf_counter() - t0
            if req.error is not None:
                raise SystemExit(f"request for {s!r} failed: {req.error}")
            out[k].append(Served(req.output_ids, task.check(s, req.text), req.cached_tokens))
    slots = [e.stats.computed_tokens for e in engines]
    return out, slots, wall, engines[1]


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(slots equal, slots compared): the longer output's length (a missing slot differs)."""
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)), n


def measure(model, llm, name: str, letters: list[str], cache: str, block: int, gen: int) -> Row:
    params = SamplingParams(gen_length=gen, block_length=block, strategy="threshold", threshold=0.9, cache=cache)
    (cold, warm), (cold_slots, warm_slots), (cold_wall, warm_wall), engine = serve(model, llm, letters, params)
    prompt_tokens = sum(len(llm.encode(s, True)) for s in letters)
    hits = [i for i, w in enumerate(warm) if w.cached > 0]
    same = total = 0
    for i in hits:
        s, t = agreement(warm[i].ids, cold[i].ids)
        same, total = same + s, total + t

    def acc(rows: list[Served], idx: list[int]) -> float:
        return sum(rows[i].ok for i in idx) / len(idx) if idx else float("nan")

    every = list(range(len(letters)))
    st = engine.prefix_cache.stats
    return Row(
        name, cache, block, len(letters), len(hits),
        acc(cold, every), acc(warm, every), acc(cold, hits), acc(warm, hits),
        same / total if total else float("nan"),
        sum(warm[i].ids == cold[i].ids for i in hits) / len(hits) if hits else float("nan"),
        st.hit_tokens / prompt_tokens, warm_slots / cold_slots, warm_wall / cold_wall,
    )  # fmt: skip


def fmt(v: float, pct: bool = True) -> str:
    if v != v:  # nan: no request hit
        return "-"
    return f"{100 * v:.1f}%" if pct else f"{v:.2f}x"


def table(rows: list[Row], command: str, seconds: float) -> str:
    head = (
        "| workload | cache | block | requests | hits | acc cold | acc approx | acc cold (hits) | "
        "acc approx (hits) | token agreement (hits) | identical (hits) | hit rate | query slots | wall |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r.workload} | {r.cache} | {r.block} | {r.n} | {r.hits} | {fmt(r.acc_cold)} | {fmt(r.acc_approx)} | "
        f"{fmt(r.acc_cold_hits)} | {fmt(r.acc_approx_hits)} | {fmt(r.agreement)} | {fmt(r.identical)} | "
        f"{fmt(r.hit_rate)} | {fmt(r.computed, False)} | {fmt(r.wall, False)} |\n"
        for r in rows
    )
    return (
        "# Approximate prefix cache: accuracy effect on the embedded model\n\n"
        f"`{command}` ({seconds:.0f} s; torch {torch.__version__}, {torch.get_num_threads()} threads). "
        "Embedded default model (LLaDA layout, bidirectional), threshold 0.9, gen 40, each request served "
        'alone and in order on a cold engine (no prefix cache) and on one with `prefix_cache="approximate"` '
        "(alternating request by request). "
        "acc: `demo.task.check` (any valid answer); (hits): over the requests that hit the cache; token "
        "agreement: generated ids equal slot for slot, approximate vs cold; query slots and wall: "
        "approximate / cold (wall is noisy on this shared 2-core CPU). `anchored` is the control: the "
        "approximate cache does not apply to it (no lookup), so it reads 0 hits and identical answers.\n\n"
        + head
        + body
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=15, help="shared-prefix groups")
    ap.add_argument("--group", type=int, default=4, help="prompts per group")
    ap.add_argument("--repeats", type=int, default=20, help="prompts served twice")
    ap.add_argument("--caches", default="prefix,dual,vicinity,anchored")
    ap.add_argument("--blocks", default="1,4,8")
    ap.add_argument("--gen-length", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="3 groups, 4 repeats, blocks 4; print, do not write")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    if a.quick:
        a.groups, a.repeats, a.blocks = 3, 4, "4"
    llm = dinfer_rt.LLM()
    model = llm.model
    loads = workloads(a.groups, a.group, a.repeats, a.seed)
    rows = []
    t0 = time.perf_counter()
    for block in (int(b) for b in a.blocks.split(",")):
        for cache in a.caches.split(","):
            for name, letters in loads.items():
                r = measure(model, llm, name, letters, cache, block, a.gen_length)
                rows.append(r)
                print(table([r], "", 0).splitlines()[-1], flush=True)
    seconds = time.perf_counter() - t0
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python benchmarks/prefix_approx_accuracy.py", *given])
    text = table(rows, command, seconds)
    if a.quick:
        print(text)
        return 0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text, encoding="utf-8")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
