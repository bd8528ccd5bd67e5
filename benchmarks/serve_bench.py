"""Serving under load: ``dinfer-rt serve`` on localhost against offline ``LLM.generate``.

Open-loop arrivals (Poisson at each offered rate, seeded; ``inf`` = all at once) of streamed chat
requests on the embedded task, bounded in count and time. Reports requests/s, output tokens/s,
p50/p90/p99 latency and time to the first streamed text per rate and, in the same run, offline
batched throughput (``batch_size`` = the server's ``max_num_seqs``) and a lone offline request's
latency on the same prompts, for each process model (``--process-models``: HTTP and the engine
in one process, and ``serve --engine-process``). Targets (#40): at saturation >= 95% of offline
batched tokens/s; at low load p50 latency within 1.1x of a lone offline request.

``--workload prefix-cache``: the block prefix cache (issue #40), two workloads on a block-causal
checkpoint (``--model``; default: a random LLaDA2-layout checkpoint written here, sized so a
256-token prefill shows), each served twice with the same requests, ``--no-prefix-cache`` and the
cache on. **shared prompt**: one 256-token system prompt and 64 short distinct user turns, streamed
chat at one offered rate (default all at once). **multi-turn**: 16 conversations of 4 turns at
once, each turn resending the previous turns (the answers the server gave) plus a new user turn.
Reports tokens/s, time to the first final text (p50, p90), the hit rate (prompt tokens reused /
prompt tokens), the query slots the server computed, and whether every answer is the same in both
runs (the command fails if not). Writes ``serve_prefix_cache.{md,json,png}``; ``--workload
shared-prompt`` / ``multi-turn`` reruns one and keeps the other's results; ``--quick`` is a smoke
run (8 requests, 2 turns) into a temporary folder.

    python benchmarks/serve_bench.py [--requests 48] [--rates 1,4,16,inf] [--max-num-seqs 16]
    python benchmarks/serve_bench.py --workload prefix-cache [--requests 64] [--turns 4] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import lean_client
import torch
from tqdm import tqdm

from dinfer_rt.demo import task
from dinfer_rt.engine import Engine
from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing.serving import ServerProcess

KNOBS = {"strategy": "threshold", "block_length": 8}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def tree_cpu_s(pid: int, descendants: bool = True) -> float | None:
    """CPU seconds (user + system, every thread) of process ``pid`` and its living descendants
    (``serve --engine-process``: the front and its engine process), from ``/proc``; None where
    there is no ``/proc``. CPU time, unlike latency, barely moves when the machine is shared: what
    a server spends per request beyond what ``LLM.generate`` spends is its overhead, and on a
    small machine the cores it takes from the forward (OpenMP threads spin while they wait, so
    an engine's CPU still follows its wall time). ``descendants=False``: the process alone
    (with ``--engine-process``, the front: HTTP, tokenising, SSE, the relay; it runs no forward)."""
    proc = Path("/proc")
    if not (proc / str(pid) / "stat").exists():
        return None
    tick = os.sysconf("SC_CLK_TCK")
    parents, cpu = {}, {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while listed
            continue
        parents[int(stat.parent.name)] = int(fields[1])
        cpu[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / tick
    if not descendants:
        return cpu.get(pid)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += [c for c, parent in parents.items() if parent == p]
    return total


def paced_lone(llm: LLM, prompts: list[str], params: SamplingParams, rate: float, seed: int) -> list[float]:
    """Lone offline requests at open-loop Poisson arrivals (``rate`` per second, ``seed``: the
    seed :func:`load` takes for that rate; here every request, the first too, follows an idle
    gap), one after another: each latency from its arrival to its end (a request that arrives
    while the previous one runs waits, as it would in a server's queue).
    Why: the low-load server requests arrive after an idle gap, and on a small (virtual) machine
    the first forwards after one are slower whatever runs them (idle cores, caches, clocks); this
    is the same request offline under the same gaps, so the server's own share can be told apart."""
    rng = random.Random(seed)
    latencies, start, at = [], time.perf_counter(), 0.0
    for p in prompts:
        at += rng.expovariate(rate)
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        llm.generate([p], params)
        latencies.append(time.perf_counter() - (start + at))
    return latencies


def offline(prompts: list[str], batch: int, paced_rate: float | None = None, paced_requests: int = 12) -> dict:
    """Offline ``LLM.generate`` on ``prompts``: batched throughput (``batch``), a lone request's
    latency back to back (median of 8), and with ``paced_rate`` a lone request's latency at the
    low-load arrivals (:func:`paced_lone`, ``paced_requests`` of them)."""
    llm = LLM()
    params = SamplingParams(**KNOBS, batch_size=batch)
    llm.generate(prompts[:batch], params)  # warm-up: graphs compiled, allocator primed
    lone, lone_cpu = [], []
    for p in prompts[:8]:
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate([p], params)
        lone.append(time.perf_counter() - t0)
        lone_cpu.append(time.process_time() - c0)
    paced = None
    if paced_rate is not None and paced_rate != float("inf"):
        paced = paced_lone(llm, prompts[:paced_requests], params, paced_rate, seed=int(paced_rate))
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    batch_cpu = time.process_time() - c0
    tokens = sum(len(o.token_ids) for o in outs)
    correct = sum(task.check(it.letters, o.text) for it, o in zip(task.heldout(len(prompts)), outs))
    # the same engine the server runs, in this process with no HTTP: where the server's loss lies
    engine = Engine(llm.model, max_num_seqs=batch)
    t0 = time.perf_counter()
    for p in prompts:  # every request its own cohort, as the server submits them
        engine.submit(llm.encode(p, True), params)
    engine.run_until_idle()
    engine_wall = time.perf_counter() - t0
    return {
        "lone_p50_s": statistics.median(lone),
        "lone_paced_p50_s": None if paced is None else statistics.median(paced),
        "paced_rate": paced_rate if paced is not None else None,
        "tokens_per_s": tokens / wall,
        "engine_tokens_per_s": tokens / engine_wall,
        "accuracy": correct / len(outs),
        "lone_cpu_ms": 1e3 * statistics.median(lone_cpu),  # CPU of one lone request, every thread
        "batch_cpu_ms_per_request": 1e3 * batch_cpu / len(prompts),
    }


def _stream_chat(url: str, body: dict, record: dict, timeout: float) -> None:
    """One streamed chat request into ``record``: its text, time to the first final text
    (``ttft``), ``usage``, start and end times (``error`` on a refused request). Sent by
    ``lean_client`` (one asyncio loop, pooled keep-alive connections; it says why not httpx)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    lean_client.stream_chat(url, body, record, timeout)
    if "error" in record:
        return
    record["end"] = time.perf_counter()
    record["latency"] = record["end"] - record["start"]


def _one(url: str, letters: str, record: dict) -> None:
    _stream_chat(url, {"messages": [{"role": "user", "content": letters}], **KNOBS}, record, timeout=120)
    if "usage" in record:
        record["tokens"] = record["usage"]["completion_tokens"]


def load(url: str, items: list, rate: float, seed: int, deadline_s: float, server_pid: int | None = None) -> dict:
    """Open-loop: request i is sent at its arrival time whatever happened to the others.
    ``server_pid``: also the server's CPU per request (``tree_cpu_s``; the idle time between
    arrivals included, a few wake-ups a second)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in items:
        arrivals.append(t)
        t += 0.0 if rate == float("inf") else rng.expovariate(rate)
    records = [{} for _ in items]
    cpu0 = time.process_time()  # the load generator's own CPU time: it shares the machine's cores
    server0 = None if server_pid is None else tree_cpu_s(server_pid)
    front0 = None if server_pid is None else tree_cpu_s(server_pid, descendants=False)
    start = time.perf_counter()
    threads = []
    for item, at, rec in zip(items, arrivals, records):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=_one, args=(url, item.letters, rec), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=max(1.0, start + deadline_s - time.perf_counter()))
    client_cpu = time.process_time() - cpu0
    server1 = None if server0 is None else tree_cpu_s(server_pid)
    front1 = None if front0 is None else tree_cpu_s(server_pid, descendants=False)
    done = [r for r in records if "latency" in r]
    span = max(r["end"] for r in done) - min(r["start"] for r in done)
    lat = [r["latency"] for r in done]
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    return {
        "rate": rate,
        "requests": len(items),
        "completed": len(done),
        "requests_per_s": len(done) / span,
        "tokens_per_s": sum(r.get("tokens", 0) for r in done) / span,
        "p50_s": _pct(lat, 50),
        "p90_s": _pct(lat, 90),
        "p99_s": _pct(lat, 99),
        "ttft_p50_s": _pct(ttft, 50) if ttft else float("nan"),
        "accuracy": sum(task.check(it.letters, r.get("text", "")) for it, r in zip(items, records)) / len(items),
        "client_cores": client_cpu / (time.perf_counter() - start),
        "client_cpu_ms_per_request": 1e3 * client_cpu / len(items),
        "server_cpu_ms_per_request": None if server1 is None else 1e3 * (server1 - server0) / len(items),
        # the server's first process only: with --engine-process the front, without it the whole server
        "front_cpu_ms_per_request": None if front1 is None else 1e3 * (front1 - front0) / len(items),
    }


PREFIX_KNOBS = {"strategy": "low_confidence", "steps": 8, "cache": "dual", "block_length": 16, "gen_length": 32}
"""The prefix-cache workloads' request settings: 4 tokens per forward whatever the (random) weights
predict, so every request costs the same number of forwards with the cache on and off."""
PREFIX_CHECKPOINT = dict(
    d=256, layers=4, heads=8, kv_heads=2, head_dim=32, experts=8, top_k=2, inter=256, dense_inter=512
)
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _bench_checkpoint(folder: Path) -> Path:
    """A random LLaDA2-layout (block-causal, MoE) checkpoint: a lone request (a 256-token prompt,
    32 tokens in 8 forwards) costs on the order of 100 ms on a 2-core CPU, and the 256-token
    prefill a visible share of it."""
    from dinfer_rt.testing import checkpoints

    if not (folder / "config.json").exists():
        checkpoints.llada2(folder, **PREFIX_CHECKPOINT)
    return folder


def _ask(url: str, messages: list[dict], record: dict) -> None:
    """One streamed chat request: its text, time to the first final text, usage."""
    _stream_chat(url, {"messages": messages}, record, timeout=300)


def _shared_prompt_load(url: str, bodies: list[list[dict]], rate: float, deadline: float) -> list[dict]:
    """Open-loop arrivals (Poisson at ``rate``, seeded; ``inf``: all at once) of the chats."""
    rng = random.Random(7)
    records = [{} for _ in bodies]
    start, t, threads = time.perf_counter(), 0.0, []
    for messages, rec in zip(bodies, records):
        delay = start + t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=_ask, args=(url, messages, rec), daemon=True)
        th.start()
        threads.append(th)
        t += 0.0 if rate == float("inf") else rng.expovariate(rate)
    for th in threads:
        th.join(timeout=max(1.0, deadline - time.perf_counter()))
    return records


def _multi_turn_load(url: str, openings: list[str], follow_ups: list[list[str]], deadline: float) -> list[dict]:
    """Every conversation at once, each on its own thread; a conversation's turns one after the
    other, each resending the previous turns (the answers this server gave) plus a new user turn.
    Records in (conversation, turn) order."""
    turns = 1 + len(follow_ups[0])
    records = [{} for _ in range(len(openings) * turns)]

    def talk(c: int) -> None:
        messages = [{"role": "user", "content": openings[c]}]
        for t in range(turns):
            rec = records[c * turns + t]
            _ask(url, list(messages), rec)
            if "end" not in rec or time.perf_counter() > deadline:
                return
            if t + 1 < turns:
                messages += [
                    {"role": "assistant", "content": rec["text"]},
                    {"role": "user", "content": follow_ups[c][t]},
                ]

    threads = [threading.Thread(target=talk, args=(c,), daemon=True) for c in range(len(openings))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=max(1.0, deadline - time.perf_counter()))
    return records


def _prefix_run(folder: Path, a, cache_flags: list[str], drive) -> dict:
    """One server (``cache_flags``), a warm-up, then ``drive(url, deadline)`` -> records."""
    knobs = [f"--{k.replace('_', '-')}={v}" for k, v in PREFIX_KNOBS.items()]
    server = ServerProcess(
        "--model", str(folder), "--backend", "cpu", "--max-num-seqs", str(a.max_num_seqs), *knobs, *cache_flags,
        lifetime=a.deadline_s + 120,
    )  # fmt: skip
    try:
        # warm-up, a lone request then a concurrent burst (the multi-row forwards): unrelated prompts
        _ask(server.url, [{"role": "user", "content": "warmup"}], {})
        burst = [[{"role": "user", "content": f"warmup{i}"}] for i in range(4)]
        _shared_prompt_load(server.url, burst, float("inf"), time.perf_counter() + 120)
        q0, h0 = server.metric("dinfer_prefix_cache_queries_total"), server.metric("dinfer_prefix_cache_hits_total")
        c0 = server.metric("dinfer_computed_tokens_total")
        start = time.perf_counter()
        records = drive(server.url, start + a.deadline_s)
        hits = server.metric("dinfer_prefix_cache_hits_total") - h0
        queries = server.metric("dinfer_prefix_cache_queries_total") - q0
        computed = server.metric("dinfer_computed_tokens_total") - c0
        cache_bytes = server.metric("dinfer_prefix_cache_bytes")
    finally:
        server.stop()
    done = [r for r in records if "end" in r and "usage" in r]
    span = max(r["end"] for r in done) - start if done else float("nan")
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in done)
    ttft = [r["ttft"] for r in done if r["ttft"] is not None] or [float("nan")]
    return {
        "requests": len(records),
        "completed": len(done),
        "errors": [r["error"] for r in records if "error" in r][:3],
        "wall_s": span,
        "tokens_per_s": sum(r["usage"]["completion_tokens"] for r in done) / span,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "prompt_tokens": prompt_tokens,
        "hit_rate": hits / prompt_tokens if prompt_tokens else 0.0,
        "cached_tokens": sum(r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in done),
        "queries": queries,
        "computed_tokens": computed,
        "cache_bytes": cache_bytes,
        "texts": [r.get("text") if "end" in r else None for r in records],
    }


def _prefix_workloads(a) -> dict:
    """Each workload's description and its load (``drive``), from ``a``'s sizes (seeded)."""
    rng = random.Random(0)
    out = {}
    if a.workload in ("prefix-cache", "shared-prompt"):
        n = a.requests
        system = "".join(rng.choice(ALPHABET) for _ in range(255))  # + the template's BOS: 256 tokens
        users = ["".join(rng.choice(ALPHABET) for _ in range(8)) for _ in range(n)]
        bodies = [[{"role": "system", "content": system}, {"role": "user", "content": u}] for u in users]
        rate = float(a.rates.split(",")[0])
        out["shared_prompt"] = (
            f"one 256-token system prompt + {n} distinct 8-letter user turns, streamed chat, "
            f"offered rate {rate:g} req/s",
            lambda url, deadline: _shared_prompt_load(url, bodies, rate, deadline),
        )
    if a.workload in ("prefix-cache", "multi-turn"):
        convs, turns = max(1, a.requests // a.turns), a.turns
        openings = ["".join(rng.choice(ALPHABET) for _ in range(64)) for _ in range(convs)]
        follow = [["".join(rng.choice(ALPHABET) for _ in range(8)) for _ in range(turns - 1)] for _ in range(convs)]
        out["multi_turn"] = (
            f"{convs} conversations x {turns} turns, all conversations at once, each turn resending the previous "
            "turns (its 64-letter opening, the answers, 8-letter follow-ups) plus a new user turn",
            lambda url, deadline: _multi_turn_load(url, openings, follow, deadline),
        )
    return out


def _prefix_report(results: dict, out: Path) -> list[str]:
    """``serve_prefix_cache.{md,json,png}`` from ``results`` (workload -> its runs); returns the md."""
    lines = []
    for name, w in results.items():
        if name == "setup":
            continue
        off, on = w["off"], w["on"]
        lines += [
            f"## {name.replace('_', ' ')}",
            "",
            f"{w['description']}; {results['setup']['text']}",
            "",
            "| prefix cache | completed | output tok/s | first text p50 s | first text p90 s | hit rate "
            "| computed query slots |",
            "|---|---|---|---|---|---|---|",
        ]
        for mode in ("off", "on"):
            r = w[mode]
            lines.append(
                f"| {mode} | {r['completed']}/{r['requests']} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.3f} "
                f"| {r['ttft_p90_s']:.3f} | {r['hit_rate']:.1%} | {r['computed_tokens']:.0f} |"
            )
        lines += [
            "",
            f"Throughput on/off: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x; first text p50 on/off: "
            f"{on['ttft_p50_s'] / off['ttft_p50_s']:.2f}x; computed query slots on/off: "
            f"{on['computed_tokens'] / max(off['computed_tokens'], 1):.2f}x; identical outputs: "
            f"{'yes' if w['identical_outputs'] else 'NO'}.",
            "",
        ]
        for mode in ("off", "on"):
            if w[mode]["errors"]:
                lines += [f"errors ({mode}): {w[mode]['errors']}", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_prefix_cache.md").write_text("# Block prefix cache: on vs off\n\n" + "\n".join(lines))
    (out / "serve_prefix_cache.json").write_text(json.dumps(results, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        lines.append("(matplotlib not installed: no plot)")
        return lines
    names = [n for n in results if n != "setup"]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    for k, (mode, color) in enumerate((("off", "tab:grey"), ("on", "tab:blue"))):
        xs = [i + (k - 0.5) * width for i in range(len(names))]
        ys = [results[n][mode]["tokens_per_s"] for n in names]
        ax.bar(xs, ys, width, label=f"prefix cache {mode}", color=color)
    for i, n in enumerate(names):
        off, on = results[n]["off"]["tokens_per_s"], results[n]["on"]["tokens_per_s"]
        hit = results[n]["on"]["hit_rate"]
        ax.annotate(f"{on / off:.2f}x\n(hit {hit:.0%})", (i + 0.5 * width, on), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), [n.replace("_", " ") for n in names])
    ax.set_ylabel("output tokens/s")
    ax.set_title("dinfer-rt serve: block prefix cache on vs off")
    ax.margins(y=0.2)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(out / "serve_prefix_cache.png", dpi=120)
    plt.close(fig)
    lines.append(f"plot: {out / 'serve_prefix_cache.png'}")
    return lines


def prefix_cache(a) -> None:
    """The prefix-cache workloads (shared system prompt, multi-turn), each served with the cache
    off then on (the same requests); fails when any answer differs between the two."""
    folder = a.model or _bench_checkpoint(Path(tempfile.gettempdir()) / "dinfer-rt-llada2-bench")
    knobs = ", ".join(f"{k} {v}" for k, v in PREFIX_KNOBS.items())
    text = (
        f"checkpoint {folder.name} (block-causal, random weights); {knobs}; max_num_seqs {a.max_num_seqs}; CPU. "
        "One run; this machine's cores may be shared: timings are noisy."
    )
    path = a.out / "serve_prefix_cache.json"
    results = {}
    if a.workload != "prefix-cache" and path.exists():  # one workload rerun: keep the other's results
        old = json.loads(path.read_text())
        results = {k: v for k, v in old.items() if isinstance(v, dict) and "on" in v and "off" in v}
    results["setup"] = {"text": text, "checkpoint": str(folder), "knobs": PREFIX_KNOBS, "quick": a.quick}
    for name, (description, drive) in _prefix_workloads(a).items():
        runs = {}
        for mode, flags in (("off", ["--no-prefix-cache"]), ("on", [])):
            print(f"{name}: prefix cache {mode} ...", flush=True)
            runs[mode] = _prefix_run(folder, a, flags, drive)
        texts = runs["on"].pop("texts"), runs["off"].pop("texts")
        same = texts[0] == texts[1] and None not in texts[0]
        speedup = runs["on"]["tokens_per_s"] / runs["off"]["tokens_per_s"]
        results[name] = {"description": description, **runs, "identical_outputs": same, "speedup": speedup}
    print("\n".join(_prefix_report(results, a.out)))
    differ = [n for n, w in results.items() if n != "setup" and not w["identical_outputs"]]
    if differ:
        raise SystemExit(f"error: answers differ with the prefix cache on and off (or failed): {', '.join(differ)}")


def _paced_text(off: dict) -> str:
    """The offline paced-lone figure in words, for the reports ('' without one)."""
    if not off.get("lone_paced_p50_s"):
        return ""
    return (
        f"a lone offline request at the low-load arrivals ({off['paced_rate']:g} req/s, after the same idle "
        f"gaps): {off['lone_paced_p50_s']:.3f} s (median of its requests). "
    )


# the server's process models (issue #40): HTTP and the engine in one process, or the engine apart
PROCESS_MODELS = {"in-process": (), "engine-process": ("--engine-process",)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=None, help="requests per offered rate / workload (48; 64)")
    ap.add_argument("--rates", default="1,4,16,inf", help="offered loads, requests/s (inf: all at once)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=300, help="bound on one rate's wall time")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    ap.add_argument(
        "--workload", choices=("embedded", "prefix-cache", "shared-prompt", "multi-turn"), default="embedded",
        help="prefix-cache: the shared-prompt and multi-turn workloads, cache off vs on",
    )  # fmt: skip
    ap.add_argument(
        "--process-models", default="in-process,engine-process",
        help="embedded workload: the server's process models to measure, comma-separated (in-process: HTTP and the "
        "engine in one process; engine-process: `serve --engine-process`)",
    )  # fmt: skip
    ap.add_argument(
        "--pin", action="store_true",
        help="embedded workload: offline and the server on one CPU with one thread, the load generator on the "
        "others (on a small machine the clients otherwise take the engine's cores)",
    )  # fmt: skip
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    ap.add_argument("--model", type=Path, default=None, help="prefix-cache workloads: a block-causal checkpoint")
    ap.add_argument(
        "--quick", action="store_true",
        help="prefix-cache workloads: a smoke run (8 requests, 2 turns; results in a temporary folder unless --out)",
    )  # fmt: skip
    a = ap.parse_args()
    if a.workload != "embedded":
        if a.quick:
            a.requests, a.turns, a.rates = a.requests or 8, 2, "inf"
            a.out = a.out or Path(tempfile.mkdtemp(prefix="dinfer-serve-bench-quick-"))
        a.requests = a.requests or 64
        a.out = a.out or Path(__file__).parent / "results"
        if a.rates == "1,4,16,inf":  # the embedded workload's default: the shared prompt is sent all at once
            a.rates = "inf"
        prefix_cache(a)
        return
    a.requests = a.requests or 48
    a.out = a.out or Path(__file__).parent / "results"
    items = task.heldout(a.requests)
    rates = [float(r) for r in a.rates.split(",")]

    launcher, env = None, None
    if a.pin:  # the engine's CPU apart from the load generator's: offline and the server on CPU 0, clients on 1
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin needs 2 CPUs (one for the engine, one for the load generator)")
        os.sched_setaffinity(0, {cpus[0]})
        torch.set_num_threads(1)
        launcher, env = ["taskset", "-c", str(cpus[0]), sys.executable, "-m", "dinfer_rt"], {"OMP_NUM_THREADS": "1"}
    print("offline ...", flush=True)
    off = offline([it.letters for it in items], a.max_num_seqs, paced_rate=min(rates))
    if a.pin:
        os.sched_setaffinity(0, set(cpus[1:]))
    modes = a.process_models.split(",")
    unknown = sorted(set(modes) - set(PROCESS_MODELS))
    if unknown:
        raise SystemExit(f"--process-models: unknown {', '.join(unknown)}; known: {', '.join(PROCESS_MODELS)}")
    rows, padded, computed = [], 0.0, 0.0
    for mode in modes:
        server = ServerProcess(
            "--max-num-seqs", str(a.max_num_seqs), *PROCESS_MODELS[mode], lifetime=a.deadline_s * (len(rates) + 1),
            launcher=launcher, env=env,
        )  # fmt: skip
        try:
            load(server.url, items[:4], float("inf"), 0, a.deadline_s)  # warm-up
            for rate in tqdm(rates, desc=f"offered load ({mode})", unit="rate"):
                seed = int(rate) if rate != float("inf") else 7
                row = load(server.url, items, rate, seed=seed, deadline_s=a.deadline_s, server_pid=server.proc.pid)
                rows.append({"process_model": mode, **row})
            padded += server.metric("dinfer_padded_tokens_total")
            computed += server.metric("dinfer_computed_tokens_total")
        finally:
            server.stop()

    pinned = "; offline and the server pinned to one CPU, one thread, the clients on the other" if a.pin else ""
    lines = [
        f"Embedded model, {a.requests} streamed chat requests per rate, threshold 0.9, block 8, gen 40, "
        f"max_num_seqs {a.max_num_seqs}; offline batch {a.max_num_seqs}{pinned}. One run on this machine.",
        "",
        "| process model | offered req/s | completed | req/s | output tok/s | p50 s | p90 s | p99 s "
        "| first text p50 s | accuracy | load generator cores | server CPU ms / request |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['process_model']} | {r['rate']:g} | {r['completed']}/{r['requests']} | {r['requests_per_s']:.2f} "
            f"| {r['tokens_per_s']:.0f} | {r['p50_s']:.3f} | {r['p90_s']:.3f} | {r['p99_s']:.3f} "
            f"| {r['ttft_p50_s']:.3f} | {r['accuracy']:.0%} | {r['client_cores']:.2f} "
            f"| {r['server_cpu_ms_per_request'] or float('nan'):.1f} |"
        )
    pad = padded / computed if computed else 0.0
    lines += [
        "",
        f"Offline `LLM.generate` batch {a.max_num_seqs}: {off['tokens_per_s']:.0f} output tok/s "
        f"(accuracy {off['accuracy']:.0%}); the engine in-process (no HTTP, all prompts at once): "
        f"{off['engine_tokens_per_s']:.0f} tok/s; a lone offline request: {off['lone_p50_s']:.3f} s (median of 8)"
        + (f"; {_paced_text(off)}" if _paced_text(off) else ". ")
        + f"Offline CPU per request (every thread): {off['lone_cpu_ms']:.1f} ms alone, "
        f"{off['batch_cpu_ms_per_request']:.1f} ms in the batch.",
        f"Padding share of the server's computed query slots: {pad:.1%}.",
        "",
        "| process model | target (#40) | measured | met |",
        "|---|---|---|---|",
    ]
    for mode in modes:
        mine = [r for r in rows if r["process_model"] == mode]
        sat = max(mine, key=lambda r: r["tokens_per_s"])
        low = min(mine, key=lambda r: r["rate"])
        share, slow = sat["tokens_per_s"] / off["tokens_per_s"], low["p50_s"] / off["lone_p50_s"]
        lines += [
            f"| {mode} | saturation >= 95% of offline batched tok/s | {share:.0%} "
            f"| {'yes' if share >= 0.95 else 'no'} |",
            f"| {mode} | low load ({low['rate']:g} req/s) p50 <= 1.1x lone offline | {slow:.2f}x "
            f"| {'yes' if slow <= 1.1 else 'no'} |",
        ]
        if off.get("lone_paced_p50_s") and off["paced_rate"] == low["rate"]:
            paced = low["p50_s"] / off["lone_paced_p50_s"]
            lines.append(
                f"| {mode} | (not a target) low load p50 against a lone offline request at the same arrivals "
                f"| {paced:.2f}x | - |"
            )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "serve.md").write_text("\n".join(lines) + "\n")
    (a.out / "serve.json").write_text(json.dumps({"offline": off, "rates": rows, "padding_share": pad}, indent=1))
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, style in zip(modes, ("-", ":")):
        finite = [r for r in rows if r["rate"] != float("inf") and r["process_model"] == mode]
        xs = [r["rate"] for r in finite]
        for key, label in (("p50_s", "p50"), ("p90_s", "p90"), ("ttft_p50_s", "first text p50")):
            ax.plot(xs, [r[key] for r in finite], marker="o", linestyle=style, label=f"{label} ({mode})")
    ax.axhline(off["lone_p50_s"], color="grey", linestyle="--", label="lone offline request")
    if off.get("lone_paced_p50_s"):
        ax.axhline(off["lone_paced_p50_s"], color="grey", linestyle=":", label="lone offline, same arrivals")
    ax.set_xscale("log")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("latency (s)")
    ax.set_title("dinfer-rt serve, embedded model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out / "serve_latency.png", dpi=120)
    print(f"plot: {a.out / 'serve_latency.png'}")


if __name__ == "__main__":
    main()
