"""Cost of one forward at batch 1: dinfer-rt against transformers' LlamaForCausalLM on the same weights.

LLaDA is a Llama decoder with a non-causal mask, so an HF ``LlamaForCausalLM`` loaded with the
same (renamed) weights and an all-visible 4-D mask computes what the peers' LLaDA modules
compute. Both run in this process, interleaved, median of ``--repeats`` rounds:

- ``full``: no cache, every position (the HF model returns logits of all N positions, as the
  peers do each step; dinfer-rt runs its scheduler's step: the confidence head at the block,
  which includes the softmax statistics the peers compute afterwards; a second dinfer-rt row
  returns plain logits, like for like with the HF module);
- ``dual``: dual cache, the block's L positions against all N keys (HF: a ``DynamicCache`` of
  the N - L other positions, cropped back after each call).

Models: the embedded model (prompt 12, gen 40, block 8) and a mid-size random LLaDA-layout
checkpoint written here (d 768, 12 layers, vocab 32000, fp32, 134M parameters; prompt 32,
gen 64, block 32). Extra dinfer-rt rows: the interpreted executor (what the generated code
replaced) and, with ``--compile``, ``torch.compile`` of the generated program (off by default
in the runtime: minutes of compilation per shape on this CPU).

    python benchmarks/forward_bench.py --out bench-out
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dinfer_rt import envs
from dinfer_rt.loader import EMBEDDED_MODEL, load_model
from dinfer_rt.testing import checkpoints

HF_NAMES = {
    "wte": "model.embed_tokens",
    "ln_f": "model.norm",
    "ff_out": "lm_head",
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
}


def hf_llama(path: Path):
    """transformers' LlamaForCausalLM (sdpa attention) holding the LLaDA checkpoint's weights."""
    import transformers
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg["embedding_size"],
        hidden_size=cfg["d_model"],
        intermediate_size=cfg["mlp_hidden_size"],
        num_hidden_layers=cfg["n_layers"],
        num_attention_heads=cfg["n_heads"],
        num_key_value_heads=cfg["n_kv_heads"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"],
        max_position_embeddings=cfg["max_sequence_length"],
        tie_word_embeddings=False,
    )
    hf_cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            parts = k.removeprefix("model.transformer.").split(".")
            if parts[0] == "blocks":
                mod = "mlp.down_proj" if parts[2] == "ff_out" else HF_NAMES[parts[2]]
                sd[f"model.layers.{parts[1]}.{mod}.weight"] = v
            else:
                sd[f"{HF_NAMES[parts[0]]}.weight"] = v
    model.load_state_dict(sd, strict=True)
    return model


def hf_calls(model, ids: torch.Tensor, s: int, e: int) -> dict[str, Callable]:
    from transformers import DynamicCache

    n = ids.shape[1]
    full_mask = torch.zeros(1, 1, n, n)
    block_mask = torch.zeros(1, 1, e - s, n)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        rest = n - (e - s)
        model(
            input_ids=ids[:, :rest], attention_mask=torch.zeros(1, 1, rest, rest), past_key_values=cache, use_cache=True
        )
    pos = torch.arange(s, e)[None]

    def full():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=full_mask).logits

    def dual():
        with torch.no_grad():
            out = model(
                input_ids=ids[:, s:e],
                position_ids=pos,
                attention_mask=block_mask,
                past_key_values=cache,
                use_cache=True,
            )
        cache.crop(-(e - s))  # drop the block again: the cache holds the N - L other positions
        return out.logits

    return {"full": full, "dual": dual}


def ours_calls(model, ids: torch.Tensor, s: int, e: int) -> dict[str, Callable]:
    """The scheduler's step at batch 1; both executables are compiled here (under the caller's
    ``DINFER_EXECUTOR``)."""
    n = ids.shape[1]
    cache = model.new_cache(1, n)
    block = torch.arange(s, e)
    model.confidence(ids, select=block)
    model.confidence(ids, select=block, cache=cache, compute=torch.arange(n))  # fill the cache

    def full():
        return model.confidence(ids, select=block)

    def dual():
        return model.confidence(ids, select=block, cache=cache, compute=block)

    return {"full": full, "dual": dual}


def logits_calls(model, ids: torch.Tensor, s: int, e: int) -> dict[str, Callable]:
    """Like for like with the HF module: logits of every position (full) or of the block (dual)."""
    n = ids.shape[1]
    cache = model.new_cache(1, n)
    block = torch.arange(s, e)
    model.forward(ids, cache=cache, compute=torch.arange(n))
    return {"full": lambda: model.forward(ids), "dual": lambda: model.forward(ids, cache=cache, compute=block)}


def timed(fn: Callable, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def measure(systems: dict[str, dict[str, Callable]], repeats: int, calls: int) -> dict[str, dict[str, float]]:
    """Median ms per call of every (system, kind), rounds interleaved so drift hits all alike."""
    for calls_of in systems.values():
        for fn in calls_of.values():
            timed(fn, max(2, calls // 4))  # warm-up
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for name, calls_of in systems.items():
            for kind, fn in calls_of.items():
                times.setdefault((name, kind), []).append(timed(fn, calls))
    out: dict[str, dict[str, float]] = {}
    for (name, kind), ts in times.items():
        out.setdefault(name, {})[kind] = statistics.median(ts)
    return out


@contextlib.contextmanager
def executor_mode(mode: str):
    old = os.environ.get(envs.DINFER_EXECUTOR)
    os.environ[envs.DINFER_EXECUTOR] = mode
    try:
        yield
    finally:
        os.environ.pop(envs.DINFER_EXECUTOR) if old is None else os.environ.__setitem__(envs.DINFER_EXECUTOR, old)


def midsize(folder: Path) -> Path:
    return checkpoints.llada(folder, d=768, layers=12, heads=12, mlp=2048, vocab=32000, max_len=1100, seed=3)


def compiled_calls(model, ids, s, e) -> dict[str, Callable]:
    for cached in (False, True):
        exe = model.executable(cached, head="confidence", score="max")
        exe.run = torch.compile(exe.run, dynamic=False)
    return ours_calls(model, ids, s, e)


def bench_model(label: str, path: Path, prompt: int, gen: int, block: int, args) -> list[dict]:
    n = prompt + gen
    vocab = json.loads((path / "config.json").read_text())["embedding_size"]
    ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    s, e = prompt, prompt + block
    ours = load_model(path)
    systems = {
        "transformers LlamaForCausalLM (sdpa)": hf_calls(hf_llama(path), ids, s, e),
        "dinfer-rt (generated code)": ours_calls(ours, ids, s, e),
        "dinfer-rt logits, as HF returns them (generated code)": logits_calls(ours, ids, s, e),
    }
    with executor_mode("interpreted"):
        systems["dinfer-rt (interpreted executor)"] = ours_calls(load_model(path), ids, s, e)
    if args.compile:
        start = time.perf_counter()
        systems["dinfer-rt (torch.compile)"] = compiled_calls(load_model(path), ids, s, e)
        for fn in systems["dinfer-rt (torch.compile)"].values():
            fn()
        print(f"{label}: torch.compile took {time.perf_counter() - start:.0f} s for two shapes", file=sys.stderr)
    calls = args.calls if n < 100 else max(3, args.calls // 20)
    res = measure(systems, args.repeats, calls)
    hf = res["transformers LlamaForCausalLM (sdpa)"]
    return [
        {
            "model": label,
            "shape": f"N {n}, block {block}",
            "system": name,
            "full_ms": r["full"],
            "dual_ms": r["dual"],
            "full_ratio": r["full"] / hf["full"],
            "dual_ratio": r["dual"] / hf["dual"],
        }
        for name, r in res.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100, help="calls per timing round (embedded model; mid-size: /20)")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the generated program")
    ap.add_argument("--skip-midsize", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = bench_model("embedded", EMBEDDED_MODEL, 12, 40, 8, args)
    if not args.skip_midsize:
        with tempfile.TemporaryDirectory() as tmp:
            rows += bench_model("mid-size 134M", midsize(Path(tmp) / "llada-134m"), 32, 64, 32, args)
    meta = {"torch_threads": torch.get_num_threads(), "repeats": args.repeats}
    (args.out / "forward.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [
        "| model | shape | system | full ms | dual ms | full vs HF | dual vs HF |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['shape']} | {r['system']} | {r['full_ms']:.2f} | {r['dual_ms']:.2f} "
        f"| {r['full_ratio']:.2f}x | {r['dual_ratio']:.2f}x |"
        for r in rows
    ]
    (args.out / "forward.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
