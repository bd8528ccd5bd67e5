"""Peak activation memory of dual-cache decoding: dinfer-rt against the Fast-dLLM-style baseline.

Two measures. Heap added while decoding = peak anonymous resident memory minus the anonymous
memory just before decoding: the K/V cache, activations and workspaces, whatever the weights'
pages do (memory-mapped checkpoint weights are file-backed pages, faulted in by a forward only
where it reads them: an embedding table's unused rows never become resident). Activations =
peak RSS - the RSS before loading (torch and, for dinfer-rt, its plugins' libraries: code, not
activations) - the weights' bytes: the issue's measure, exact only when every weight is resident
at the peak (it goes low, even negative, when a forward never touches part of the weights).

Each measurement runs in a fresh process on a mid-size random LLaDA-layout checkpoint (d 768,
12 layers, vocab 32000, fp32, 134M parameters = 536 MB): load, return freed heap to the OS,
then one block of dual-cache decoding (the refresh forward over all N positions and one block
step: every later block repeats these shapes, so the peak is reached here) while a thread
samples the resident set every millisecond. Also reported: peak RSS minus the weights' bytes
(what the issue names; it includes the libraries), and peak minus the RSS just before decoding. Gen 256 / 512 / 1024,
block 32, prompt 32, batch 1 and 8.

dinfer-rt runs its engine's own steps (``Engine.step`` over one cohort: confidence head at the block,
K/V cache buffers spliced in place); the baseline is ``benchmarks/fastdllm_baseline.py``
(logits of every position, then softmax of the block in float64, K/V concatenated per step).

    python benchmarks/memory_bench.py --out bench-out
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_and_anon() -> tuple[int, int]:
    """Resident bytes, and of them the anonymous ones (resident minus file-backed / shared)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    resident, shared = int(fields[1]) * PAGE, int(fields[2]) * PAGE
    return resident, resident - shared


def rss() -> int:
    return rss_and_anon()[0]


class PeakSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.peak_anon = rss_and_anon()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            resident, anon = rss_and_anon()
            self.peak, self.peak_anon = max(self.peak, resident), max(self.peak_anon, anon)
            time.sleep(0.001)


def child(system: str, path: Path, gen: int, batch: int, block: int, prompt: int) -> dict:
    torch.manual_seed(0)
    n = prompt + gen
    if system == "dinfer-rt":
        from dinfer_rt.engine import Engine
        from dinfer_rt.loader import load_model
        from dinfer_rt.plugins import select_backend
        from dinfer_rt.sampling import SamplingParams

        select_backend(None)  # plugins discovered: their libraries are loaded (code, not activations)
        base = rss()
        model = load_model(path, check_weights=False)
        # merged weights and their row views share storage: count each storage once
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.weights.values()}
        weight_bytes = sum(storages.values())
        params = SamplingParams(gen_length=gen, block_length=block, strategy="threshold", cache="dual")
        mask = model.mask_id
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from fastdllm_baseline import PlainLLaDA

        base = rss()
        model = PlainLLaDA(path)
        weight_bytes = sum(t.numel() * t.element_size() for t in model.w.values())
        mask = model.cfg["mask_token_id"]
    x = torch.cat((torch.randint(10, 60, (batch, prompt)), torch.full((batch, gen), mask)), 1)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # loading's freed buffers back to the OS, for both alike
    before, anon_before = rss_and_anon()
    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    s, e = prompt, prompt + block
    with torch.no_grad():
        if system == "dinfer-rt":
            engine = Engine(model, max_num_seqs=batch, max_num_batched_tokens=batch * n, max_model_len=n)
            engine.submit_batch(x[:, :prompt].tolist(), params)
            engine.step()  # refresh: every position, cache filled
            engine.step()  # block step against the cache
        else:
            logits, past = model.forward(x, torch.arange(n))
            logits[:, s:e].double().softmax(-1).max(-1)
            del logits
            logits, _ = model.forward(x[:, s:e], torch.arange(s, e), past=past, replace=(s, e))
            logits.double().softmax(-1).max(-1)
    wall = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    mb = 1 << 20
    return {
        "system": system,
        "gen": gen,
        "batch": batch,
        "weights_mb": weight_bytes / mb,
        "rss_before_mb": before / mb,
        "peak_mb": sampler.peak / mb,
        "base_mb": base / mb,
        "activation_mb": (sampler.peak - base - weight_bytes) / mb,
        "peak_minus_weights_mb": (sampler.peak - weight_bytes) / mb,
        "added_mb": (sampler.peak - before) / mb,
        # Heap the decoding itself allocated (K/V cache, activations, workspaces): weights that
        # are memory-mapped and faulted in by the first forward are file-backed, not counted.
        "anon_added_mb": (sampler.peak_anon - anon_before) / mb,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--gens", default="256,512,1024")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--child", nargs=4, metavar=("SYSTEM", "PATH", "GEN", "BATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        system, path, gen, batch = args.child
        print(json.dumps(child(system, Path(path), int(gen), int(batch), block=32, prompt=32)))
        return
    from tqdm import tqdm

    sys.path.insert(0, str(Path(__file__).parent))
    from forward_bench import midsize

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = midsize(Path(tmp) / "llada-134m")
        runs = [
            (sysname, g, b)
            for g in map(int, args.gens.split(","))
            for b in map(int, args.batches.split(","))
            for sysname in ("dinfer-rt", "baseline")
        ]
        for sysname, g, b in tqdm(runs, desc="memory"):
            cmd = [sys.executable, __file__, "--child", sysname, str(path), str(g), str(b)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            tqdm.write(json.dumps(rows[-1]))
    lines = [
        "| gen | batch | heap added while decoding, dinfer-rt (MB) | baseline (MB) | ratio "
        "| activations (peak RSS - before loading - weights): dinfer-rt / baseline (MB) | ratio "
        "| peak RSS - weights: dinfer-rt / baseline (MB) | of which libraries before loading (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in sorted({r["gen"] for r in rows}):
        for b in sorted({r["batch"] for r in rows}):
            ours = next(r for r in rows if r["system"] == "dinfer-rt" and r["gen"] == g and r["batch"] == b)
            base = next(r for r in rows if r["system"] == "baseline" and r["gen"] == g and r["batch"] == b)
            lines.append(
                f"| {g} | {b} | {ours['anon_added_mb']:.0f} | {base['anon_added_mb']:.0f} "
                f"| {ours['anon_added_mb'] / base['anon_added_mb']:.2f} "
                f"| {ours['activation_mb']:.0f} / {base['activation_mb']:.0f} "
                f"| {ours['activation_mb'] / base['activation_mb']:.2f} "
                f"| {ours['peak_minus_weights_mb']:.0f} / {base['peak_minus_weights_mb']:.0f} "
                f"| {ours['base_mb']:.0f} / {base['base_mb']:.0f} |"
            )
    (args.out / "memory.json").write_text(json.dumps(rows, indent=1))
    (args.out / "memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
