"""Serving under load: ``dinfer-rt serve`` on localhost against offline ``LLM.generate``.

Open-loop arrivals (Poisson at each offered rate, seeded; ``inf`` = all at once) of streamed chat
requests on the embedded task, bounded in count and time. Reports requests/s, output tokens/s,
p50/p90/p99 latency and time to the first streamed text per rate and, in the same run, offline
batched throughput (``batch_size`` = the server's ``max_num_seqs``) and a lone offline request's
latency on the same prompts. Targets: at saturation >= 80% of offline batched tokens/s; at low
load p50 latency within 1.2x of a lone offline request.

``--workload shared-prompt``: the block prefix cache (issue #40). One system prompt of 256 tokens
and short distinct user turns, streamed chat requests at one offered rate, on a block-causal
checkpoint (``--model``; default: a random SDAR-layout checkpoint written here, sized so the
forward's compute shows), served twice: ``--no-prefix-cache`` and the cache on. Reports tokens/s,
time to the first final text, the hit rate (prompt tokens reused / prompt tokens), the query
slots the server computed, and whether every answer is the same in both runs.

    python benchmarks/serve_bench.py [--requests 48] [--rates 1,4,16,inf] [--max-num-seqs 16]
    python benchmarks/serve_bench.py --workload shared-prompt [--requests 64] [--rates inf]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
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


def offline(prompts: list[str], batch: int) -> dict:
    llm = LLM()
    params = SamplingParams(**KNOBS, batch_size=batch)
    llm.generate(prompts[:batch], params)  # warm-up: graphs compiled, allocator primed
    lone = []
    for p in prompts[:8]:
        t0 = time.perf_counter()
        llm.generate([p], params)
        lone.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
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
        "tokens_per_s": tokens / wall,
        "engine_tokens_per_s": tokens / engine_wall,
        "accuracy": correct / len(outs),
    }


def _stream_chat(url: str, body: dict, record: dict, timeout: float) -> None:
    """One streamed chat request into ``record``: its text, time to the first final text
    (``ttft``), ``usage``, start and end times (``error`` on a refused request)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    record.update(start=t0, text="", ttft=None)
    with httpx.Client(timeout=timeout) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            record["error"] = f"{r.status_code}: {r.read()[:200]!r}"
            return
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                record["usage"] = ev["usage"]
            for ch in ev["choices"]:
                piece = ch["delta"].get("content") or ""
                if piece and record["ttft"] is None:
                    record["ttft"] = time.perf_counter() - t0
                record["text"] += piece
    record["end"] = time.perf_counter()
    record["latency"] = record["end"] - t0


def _one(url: str, letters: str, record: dict) -> None:
    _stream_chat(url, {"messages": [{"role": "user", "content": letters}], **KNOBS}, record, timeout=120)
    if "usage" in record:
        record["tokens"] = record["usage"]["completion_tokens"]


def load(url: str, items: list, rate: float, seed: int, deadline_s: float) -> dict:
    """Open-loop: request i is sent at its arrival time whatever happened to the others."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in items:
        arrivals.append(t)
        t += 0.0 if rate == float("inf") else rng.expovariate(rate)
    records = [{} for _ in items]
    cpu0 = time.process_time()  # the load generator's own CPU time: it shares the machine's cores
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
    }


SHARED_KNOBS = {"strategy": "threshold", "cache": "dual", "block_length": 16, "gen_length": 32}


def _bench_checkpoint(folder: Path) -> Path:
    """A random SDAR-layout (block-causal) checkpoint, big enough that a 256-token prefill costs
    visibly more than a block's forward on a CPU (~25M parameters)."""
    from dinfer_rt.testing import checkpoints

    if not (folder / "config.json").exists():
        checkpoints.sdar(folder, d=384, layers=6, heads=6, kv_heads=2, head_dim=64, mlp=1024, block_size=16)
    return folder


def _ask(url: str, messages: list[dict], record: dict) -> None:
    """One streamed chat request: its text, time to the first final text, usage."""
    _stream_chat(url, {"messages": messages}, record, timeout=300)


def _shared_prompt_run(folder: Path, bodies: list[list[dict]], rate: float, a, cache_flags: list[str]) -> dict:
    knobs = [f"--{k.replace('_', '-')}={v}" for k, v in SHARED_KNOBS.items()]
    server = ServerProcess(
        "--model", str(folder), "--backend", "cpu", "--max-num-seqs", str(a.max_num_seqs), *knobs, *cache_flags,
        lifetime=a.deadline_s + 120,
    )  # fmt: skip
    try:
        _ask(server.url, [{"role": "user", "content": "warmup"}], {})  # an unrelated prompt: nothing shared
        q0, h0 = server.metric("dinfer_prefix_cache_queries_total"), server.metric("dinfer_prefix_cache_hits_total")
        c0 = server.metric("dinfer_computed_tokens_total")
        rng = random.Random(7)
        records = [{} for _ in bodies]
        start, t, threads = time.perf_counter(), 0.0, []
        for messages, rec in zip(bodies, records):
            delay = start + t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=_ask, args=(server.url, messages, rec), daemon=True)
            th.start()
            threads.append(th)
            t += 0.0 if rate == float("inf") else rng.expovariate(rate)
        for th in threads:
            th.join(timeout=max(1.0, start + a.deadline_s - time.perf_counter()))
        hits = server.metric("dinfer_prefix_cache_hits_total") - h0
        queries = server.metric("dinfer_prefix_cache_queries_total") - q0
        computed = server.metric("dinfer_computed_tokens_total") - c0
    finally:
        server.stop()
    done = [r for r in records if "end" in r and "usage" in r]
    span = max(r["end"] for r in done) - start if done else float("nan")
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in done)
    return {
        "completed": len(done),
        "errors": [r["error"] for r in records if "error" in r][:3],
        "tokens_per_s": sum(r["usage"]["completion_tokens"] for r in done) / span,
        "ttft_p50_s": _pct([r["ttft"] for r in done if r["ttft"] is not None] or [float("nan")], 50),
        "ttft_p90_s": _pct([r["ttft"] for r in done if r["ttft"] is not None] or [float("nan")], 90),
        "hit_rate": hits / prompt_tokens if prompt_tokens else 0.0,
        "cached_tokens": sum(r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in done),
        "queries": queries,
        "computed_tokens": computed,
        "texts": [r.get("text") for r in records],
    }


def shared_prompt(a) -> None:
    """The shared-system-prompt workload with the prefix cache off, then on (same requests)."""
    folder = a.model or _bench_checkpoint(Path(tempfile.gettempdir()) / "dinfer-rt-sdar-bench")
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    system = "".join(rng.choice(alphabet) for _ in range(255))  # + the template's BOS: 256 tokens
    users = ["".join(rng.choice(alphabet) for _ in range(8)) for _ in range(a.requests)]
    bodies = [[{"role": "system", "content": system}, {"role": "user", "content": u}] for u in users]
    rate = float(a.rates.split(",")[0])
    runs = {}
    for mode, flags in (("off", ["--no-prefix-cache"]), ("on", [])):
        print(f"prefix cache {mode} ...", flush=True)
        runs[mode] = _shared_prompt_run(folder, bodies, rate, a, flags)
    same = runs["on"]["texts"] == runs["off"]["texts"] and None not in runs["on"]["texts"]
    off, on = runs["off"], runs["on"]
    lines = [
        f"Shared system prompt (256 tokens) + {a.requests} distinct 8-letter user turns, streamed chat, offered rate "
        f"{rate:g} req/s; checkpoint {folder.name} (block-causal, random weights), threshold, cache dual, block 16, "
        f"gen 32, max_num_seqs {a.max_num_seqs}, CPU. One run; this machine's cores are shared: timings are noisy.",
        "",
        "| prefix cache | completed | output tok/s | first text p50 s | first text p90 s | hit rate "
        "| computed query slots |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in runs.items():
        lines.append(
            f"| {mode} | {r['completed']}/{a.requests} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.3f} "
            f"| {r['ttft_p90_s']:.3f} | {r['hit_rate']:.1%} | {r['computed_tokens']:.0f} |"
        )
    lines += [
        "",
        f"Throughput on/off: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x; first text p50 on/off: "
        f"{on['ttft_p50_s'] / off['ttft_p50_s']:.2f}x; computed query slots on/off: "
        f"{on['computed_tokens'] / max(off['computed_tokens'], 1):.2f}x; identical outputs: {'yes' if same else 'NO'}.",
    ]
    for mode, r in runs.items():
        if r["errors"]:
            lines.append(f"errors ({mode}): {r['errors']}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "serve_prefix_cache.md").write_text("\n".join(lines) + "\n")
    keep = {m: {k: v for k, v in r.items() if k != "texts"} for m, r in runs.items()}
    (a.out / "serve_prefix_cache.json").write_text(json.dumps({**keep, "identical_outputs": same}, indent=1))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48, help="requests per offered rate")
    ap.add_argument("--rates", default="1,4,16,inf", help="offered loads, requests/s (inf: all at once)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=300, help="bound on one rate's wall time")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--workload", choices=("embedded", "shared-prompt"), default="embedded")
    ap.add_argument("--model", type=Path, default=None, help="shared-prompt: a block-causal checkpoint folder")
    a = ap.parse_args()
    if a.workload == "shared-prompt":
        shared_prompt(a)
        return
    items = task.heldout(a.requests)
    rates = [float(r) for r in a.rates.split(",")]

    print("offline ...", flush=True)
    off = offline([it.letters for it in items], a.max_num_seqs)
    server = ServerProcess("--max-num-seqs", str(a.max_num_seqs), lifetime=a.deadline_s * (len(rates) + 1))
    rows = []
    try:
        load(server.url, items[:4], float("inf"), 0, a.deadline_s)  # warm-up
        for rate in tqdm(rates, desc="offered load", unit="rate"):
            rows.append(
                load(server.url, items, rate, seed=int(rate) if rate != float("inf") else 7, deadline_s=a.deadline_s)
            )
        padded = server.metric("dinfer_padded_tokens_total")
        computed = server.metric("dinfer_computed_tokens_total")
    finally:
        server.stop()

    sat = max(rows, key=lambda r: r["tokens_per_s"])
    low = min(rows, key=lambda r: r["rate"])
    lines = [
        f"Embedded model, {a.requests} streamed chat requests per rate, threshold 0.9, block 8, gen 40, "
        f"max_num_seqs {a.max_num_seqs}; offline batch {a.max_num_seqs}. One run on this machine.",
        "",
        "| offered req/s | completed | req/s | output tok/s | p50 s | p90 s | p99 s | first text p50 s | accuracy "
        "| load generator cores |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']:g} | {r['completed']}/{r['requests']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.0f} "
            f"| {r['p50_s']:.3f} | {r['p90_s']:.3f} | {r['p99_s']:.3f} | {r['ttft_p50_s']:.3f} | {r['accuracy']:.0%} "
            f"| {r['client_cores']:.2f} |"
        )
    pad = padded / computed if computed else 0.0
    lines += [
        "",
        f"Offline `LLM.generate` batch {a.max_num_seqs}: {off['tokens_per_s']:.0f} output tok/s "
        f"(accuracy {off['accuracy']:.0%}); the engine in-process (no HTTP, all prompts at once): "
        f"{off['engine_tokens_per_s']:.0f} tok/s; a lone offline request: {off['lone_p50_s']:.3f} s (median of 8).",
        f"Padding share of the server's computed query slots: {pad:.1%}.",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        f"| saturation >= 80% of offline batched tok/s | {sat['tokens_per_s'] / off['tokens_per_s']:.0%} "
        f"| {'yes' if sat['tokens_per_s'] >= 0.8 * off['tokens_per_s'] else 'no'} |",
        f"| low load ({low['rate']:g} req/s) p50 <= 1.2x lone offline | {low['p50_s'] / off['lone_p50_s']:.2f}x "
        f"| {'yes' if low['p50_s'] <= 1.2 * off['lone_p50_s'] else 'no'} |",
    ]
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
    finite = [r for r in rows if r["rate"] != float("inf")]
    xs = [r["rate"] for r in finite]
    for key, label in (("p50_s", "p50"), ("p90_s", "p90"), ("ttft_p50_s", "first text p50")):
        ax.plot(xs, [r[key] for r in finite], marker="o", label=label)
    ax.axhline(off["lone_p50_s"], color="grey", linestyle="--", label="lone offline request")
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
