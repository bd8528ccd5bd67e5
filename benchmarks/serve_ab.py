"""Serving overhead, A/B: ``dinfer-rt serve`` from several checkouts (or settings) against offline.

The targets of issue #40: at saturation >= 95% of offline batched tokens/s, and a lone request at
low load within 1.1x of a lone offline request's latency. ``serve_bench.py`` measures one server
once; this runs several server configurations in turn, ``--repeats`` times, each repeat against
the offline figures measured in the same repeat (in this process, with this checkout), and
reports the medians of the per-repeat ratios. A configuration is a checkout to run the server
from (``.``: this one; e.g. ``git archive HEAD | tar -x -C /tmp/base`` for the committed tree)
and environment variables for the server process (``SERVE_ARGS``: flags for ``serve`` itself, e.g.
``SERVE_ARGS=--engine-process``); the configurations' order rotates from one
repeat to the next, so a drift of the machine does not favour one.

``--profile DIR``: instead of timing, sample each server with py-spy (``pip install py-spy``)
during each offered rate and write, per configuration and rate, the raw samples and a summary:
samples per thread, the hottest functions by their own samples and by inclusive samples. A
sampled server runs slower; use the profiles for where the time goes, the timed runs for how
much.

    python benchmarks/serve_ab.py --config base /tmp/base --config this . [--repeats 3]
    python benchmarks/serve_ab.py --config this . --config uvloop . PYTHONPATH=/opt/uv --rates 1
    python benchmarks/serve_ab.py --config this . --profile /tmp/prof --repeats 1
    python benchmarks/serve_ab.py --config in . --config split . SERVE_ARGS=--engine-process
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import serve_bench as sb  # noqa: E402 (the benchmark's load generator and offline reference)

from dinfer_rt.demo import task  # noqa: E402
from dinfer_rt.testing.serving import ServerProcess  # noqa: E402


def _config(spec: list[str]) -> dict:
    """``NAME TREE [VAR=VALUE ...]`` -> a configuration."""
    if len(spec) < 2:
        raise SystemExit(f"--config needs NAME TREE [VAR=VALUE ...], got {' '.join(spec)}")
    name, tree, *pairs = spec
    env = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise SystemExit(f"--config {name}: {pair!r} is not VAR=VALUE")
        env[key] = value
    path = Path(tree).resolve()
    if not (path / "dinfer_rt" / "__init__.py").exists():
        raise SystemExit(f"--config {name}: {path} is not a dinfer-rt checkout (no dinfer_rt/__init__.py)")
    args = env.pop("SERVE_ARGS", "").split()  # server flags, e.g. SERVE_ARGS=--engine-process
    return {"name": name, "tree": str(path), "env": env, "args": args}


def summarize(raw: Path, top: int = 25) -> str:
    """A py-spy raw (collapsed stacks) file: samples per thread; per thread the functions with
    the most samples of their own and the most samples inclusive."""
    threads: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        thread = re.sub(r"\s*\(\d+\)", "", frames[0]).removeprefix("thread").strip(" :") or "?"
        calls = [re.sub(r":\d+\)$", ")", f) for f in frames[1:]]
        threads[thread] += int(n)
        if calls:
            own[(thread, calls[-1])] += int(n)
        for f in set(calls):
            incl[(thread, f)] += int(n)
    total = sum(threads.values()) or 1
    lines = ["samples per thread: " + ", ".join(f"{t} {n} ({n / total:.0%})" for t, n in threads.most_common())]
    for title, table in (("own samples", own), ("inclusive samples", incl)):
        lines += ["", f"{title} (share of all samples):"]
        lines += [f"  {n:6d} {n / total:6.1%}  [{t}] {f}" for (t, f), n in table.most_common(top)]
    return "\n".join(lines) + "\n"


def _spy(pid: int, out: Path) -> subprocess.Popen | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    cmd = [exe, "record", "-p", str(pid), "--threads", "--nonblocking", "-r", "250", "-f", "raw", "-o", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    return proc


def run_config(cfg: dict, items: list, rates: list[float], a, profile: Path | None, tag: str) -> list[dict]:
    launcher, env = None, dict(cfg["env"])
    if a.pin:  # the server on the engine's CPU with one thread, as offline ran
        launcher = ["taskset", "-c", str(a.cpus[0]), sys.executable, "-m", "dinfer_rt"]
        env.setdefault("OMP_NUM_THREADS", "1")
    server = ServerProcess(
        "--max-num-seqs", str(a.max_num_seqs), *cfg.get("args", ()), cwd=Path(cfg["tree"]), env=env, launcher=launcher,
        lifetime=a.deadline_s * (len(rates) + 1),
    )  # fmt: skip
    rows = []
    try:
        sb.load(server.url, items[:4], float("inf"), 0, a.deadline_s)  # warm-up
        for rate in rates:
            spy = None
            if profile is not None:
                raw = profile / f"{cfg['name']}-rate{rate:g}{tag}.txt"
                spy = _spy(server.proc.pid, raw)
            seed = int(rate) if rate != float("inf") else 7
            row = sb.load(server.url, items, rate, seed=seed, deadline_s=a.deadline_s, server_pid=server.proc.pid)
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
                if raw.exists():
                    raw.with_suffix(".summary.txt").write_text(summarize(raw))
            rows.append({"config": cfg["name"], **row})
    finally:
        server.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--config", nargs="+", action="append", metavar="NAME TREE [VAR=VALUE]",
        help="a server configuration: a name, the checkout to run it from (. = this one), environment variables",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48, help="requests per offered rate")
    ap.add_argument("--rates", default="1,inf", help="offered loads, requests/s (inf: all at once)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=300, help="bound on one rate's wall time")
    ap.add_argument(
        "--pin", action="store_true",
        help="offline and the servers on one CPU with one thread, the load generator on the others",
    )  # fmt: skip
    ap.add_argument("--profile", type=Path, default=None, help="sample the servers with py-spy into this folder")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--name", default="serve_overhead", help="results file stem")
    a = ap.parse_args()
    configs = [_config(c) for c in (a.config or [["this", "."]])]
    if len({c["name"] for c in configs}) != len(configs):
        raise SystemExit("--config: the names must differ")
    rates = [float(r) for r in a.rates.split(",")]
    items = task.heldout(a.requests)
    a.cpus = sorted(os.sched_getaffinity(0))
    if a.pin and len(a.cpus) < 2:
        raise SystemExit("--pin needs 2 CPUs (one for the engine, one for the load generator)")
    if a.profile is not None:
        a.profile.mkdir(parents=True, exist_ok=True)
        for k in range(a.repeats):
            for cfg in configs:
                run_config(cfg, items, rates, a, a.profile, f"-{k}" if a.repeats > 1 else "")
        print(f"profiles: {a.profile}")
        return
    runs = []
    for k in range(a.repeats):
        print(f"repeat {k + 1}/{a.repeats}: offline ...", flush=True)
        if a.pin:
            os.sched_setaffinity(0, {a.cpus[0]})
            torch.set_num_threads(1)
        off = sb.offline([it.letters for it in items], a.max_num_seqs, paced_rate=min(rates))
        if a.pin:
            os.sched_setaffinity(0, set(a.cpus[1:]))
        order = configs[k % len(configs) :] + configs[: k % len(configs)]
        rows = []
        for cfg in order:
            print(f"repeat {k + 1}/{a.repeats}: server {cfg['name']} ...", flush=True)
            rows += run_config(cfg, items, rates, a, None, "")
        runs.append({"offline": off, "rows": rows})
        lines = report(runs, configs, rates, a)  # written after every repeat: a cut-short run keeps its repeats
        out = a.out or Path(__file__).parent / "results"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{a.name}.md").write_text("\n".join(lines) + "\n")
        (out / f"{a.name}.json").write_text(json.dumps({"configs": configs, "runs": runs}, indent=1))
    print("\n".join(lines))


def report(runs: list[dict], configs: list[dict], rates: list[float], a) -> list[str]:
    med = statistics.median
    sat_rate, low_rate = max(rates), min(rates)
    pinned = "; offline and the servers pinned to one CPU, one thread, the clients on the other" if a.pin else ""
    lines = [
        f"Embedded model, {a.requests} streamed chat requests per rate, threshold 0.9, block 8, gen 40, "
        f"max_num_seqs {a.max_num_seqs}; offline batch {a.max_num_seqs}{pinned}. {len(runs)} repeats; in each, offline "
        "then every server configuration (order rotating), each ratio against that repeat's offline figures; "
        "medians over the repeats.",
        "",
        "| server | checkout, environment | saturation tok/s | of offline batched | low-load p50 s "
        "| of a lone offline request | of one at the same arrivals | first text p50 s | accuracy "
        "| per-repeat saturation | per-repeat low load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cpu_rows: list[str] = []
    front_rows: list[str] = []  # --engine-process: the front's own CPU (no forward, no OpenMP spinning)
    for cfg in configs:
        shares, slows, sat_tps, low_p50, ttft, acc, low_cpu, sat_cpu = [], [], [], [], [], [], [], []
        paced = []  # low-load p50 against a lone offline request at the same arrivals (sb.paced_lone)
        low_front, sat_front = [], []
        for run in runs:
            mine = [r for r in run["rows"] if r["config"] == cfg["name"]]
            sat = next(r for r in mine if r["rate"] == sat_rate)
            low = next(r for r in mine if r["rate"] == low_rate)
            shares.append(sat["tokens_per_s"] / run["offline"]["tokens_per_s"])
            slows.append(low["p50_s"] / run["offline"]["lone_p50_s"])
            if run["offline"].get("lone_paced_p50_s"):
                paced.append(low["p50_s"] / run["offline"]["lone_paced_p50_s"])
            sat_tps.append(sat["tokens_per_s"])
            low_p50.append(low["p50_s"])
            ttft.append(low["ttft_p50_s"])
            acc.append(min(r["accuracy"] for r in mine))
            off = run["offline"]
            if low.get("server_cpu_ms_per_request") is not None and "lone_cpu_ms" in off:
                low_cpu.append(low["server_cpu_ms_per_request"] - off["lone_cpu_ms"])
                sat_cpu.append(sat["server_cpu_ms_per_request"] - off["batch_cpu_ms_per_request"])
            if "--engine-process" in cfg.get("args", ()) and low.get("front_cpu_ms_per_request") is not None:
                low_front.append(low["front_cpu_ms_per_request"])
                sat_front.append(sat["front_cpu_ms_per_request"])
        where = (
            cfg["tree"]
            + "".join(f", {k}={v}" for k, v in cfg["env"].items())
            + "".join(f" {f}" for f in cfg.get("args", ()))
        )
        lines.append(
            f"| {cfg['name']} | `{where}` | {med(sat_tps):.0f} | {med(shares):.0%} | {med(low_p50):.4f} "
            f"| {med(slows):.2f}x | {f'{med(paced):.2f}x' if paced else '-'} | {med(ttft):.4f} | {min(acc):.0%} "
            f"| {', '.join(f'{s:.0%}' for s in shares)} "
            f"| {', '.join(f'{s:.2f}x' for s in slows)} |"
        )
        if low_cpu:
            cpu_rows.append(
                f"| {cfg['name']} | {med(low_cpu):+.2f} | {', '.join(f'{c:+.2f}' for c in low_cpu)} "
                f"| {med(sat_cpu):+.2f} | {', '.join(f'{c:+.2f}' for c in sat_cpu)} |"
            )
        if low_front:
            front_rows.append(
                f"| {cfg['name']} | {med(low_front):.2f} | {', '.join(f'{c:.2f}' for c in low_front)} "
                f"| {med(sat_front):.2f} | {', '.join(f'{c:.2f}' for c in sat_front)} |"
            )
    offs = [r["offline"] for r in runs]
    tps = ", ".join(f"{o['tokens_per_s']:.0f}" for o in offs)
    lone = ", ".join(f"{o['lone_p50_s']:.4f}" for o in offs)
    lines += [
        "",
        f"Offline `LLM.generate` batch {a.max_num_seqs}: {med([o['tokens_per_s'] for o in offs]):.0f} output tok/s "
        f"(per repeat: {tps}); the engine in-process (no HTTP, all prompts at once): "
        f"{med([o['engine_tokens_per_s'] for o in offs]):.0f} tok/s; a lone offline request: "
        f"{med([o['lone_p50_s'] for o in offs]):.4f} s (per repeat: {lone})"
        + (
            f"; a lone offline request at the low-load arrivals (after the same idle gaps, `serve_bench.paced_lone`): "
            f"{med([o['lone_paced_p50_s'] for o in offs]):.4f} s (per repeat: "
            + ", ".join(f"{o['lone_paced_p50_s']:.4f}" for o in offs)
            + ")"
            if all(o.get("lone_paced_p50_s") for o in offs)
            else ""
        )
        + ".",
        f"Saturation: offered rate {sat_rate:g}; low load: offered rate {low_rate:g} req/s.",
    ]
    if cpu_rows:
        low_off = med([o["lone_cpu_ms"] for o in offs])
        sat_off = med([o["batch_cpu_ms_per_request"] for o in offs])
        lines += [
            "",
            "**Server CPU per request beyond offline's** (ms, every thread of the server's processes; CPU time "
            "repeats where wall time does not on a shared machine): low load against a lone offline request "
            f"({low_off:.1f} ms of CPU), saturation against a request of the offline batch ({sat_off:.1f} ms).",
            "",
            "| server | low load, median | per repeat | saturation, median | per repeat |",
            "|---|---|---|---|---|",
            *cpu_rows,
        ]
    if front_rows:
        lines += [
            "",
            "**The front's CPU per request** (ms; `--engine-process` configurations: the HTTP process alone, which "
            "runs no forward, so no OpenMP spin-waiting: HTTP, tokenising, SSE, the relay from the engine process):",
            "",
            "| server | low load, median | per repeat | saturation, median | per repeat |",
            "|---|---|---|---|---|",
            *front_rows,
        ]
    return lines


if __name__ == "__main__":
    main()
