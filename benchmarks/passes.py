"""Before/after the pass pipeline: node count, kernel launches, peak activation bytes and CPU
forward time, for each family at a small realistic config and for an LLaDA-8B-shaped graph
(shape only: weights on the meta device, nothing allocated).

    python benchmarks/passes.py --out bench-out
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dinfer_rt.config_writers import LLADA_8B
from dinfer_rt.lowering import lower
from dinfer_rt.model_spec import param_plan, parse_spec
from dinfer_rt.passes import reorder
from dinfer_rt.plugins import select_backend

VIEW_OPS = {"view_heads", "merge_heads", "split"}  # no kernel launch: views of their input

CONFIGS = {
    "llada": {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": 512,
        "n_layers": 4,
        "n_heads": 8,
        "n_kv_heads": 8,
        "mlp_hidden_size": 1376,
        "vocab_size": 8192,
        "rope_theta": 500000.0,
        "max_sequence_length": 2048,
        "mask_token_id": 5,
        "eos_token_id": 1,
    },
    "dream": {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1376,
        "vocab_size": 8192,
        "rope_theta": 1e6,
        "max_position_embeddings": 2048,
        "mask_token_id": 5,
        "eos_token_id": 1,
    },
    "llada_moe": {
        "architectures": ["LLaDAMoEModelLM"],
        "model_type": "llada",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "expert_intermediate_size": 256,
        "vocab_size": 8192,
        "rope_theta": 50000.0,
        "max_position_embeddings": 2048,
        "mask_token_id": 5,
        "eos_token_id": 1,
    },
    "llada2": {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "partial_rotary_factor": 0.5,
        "rope_theta": 600000.0,
        "max_position_embeddings": 2048,
        "vocab_size": 8192,
        "first_k_dense_replace": 1,
        "intermediate_size": 1376,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 256,
        "num_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "mask_token_id": 5,
        "eos_token_id": 1,
    },
    "llada-8b-shape": LLADA_8B,
}


def spec_of(cfg: dict):
    return parse_spec(Path("<benchmark config>"), cfg)


def stats(graph, bindings) -> dict:
    order = list(range(len(graph.nodes)))
    return {
        "nodes": len(graph.nodes),
        "launches": sum(n.op not in VIEW_OPS for n in graph.nodes),
        "peak_mb": reorder.peak_bytes(graph, order, bindings) / 2**20,
    }


def forward_ms(backend, graph, weights, bindings, repeats=21) -> float:
    exe = backend.compile(graph, weights)
    b, t = bindings["B"], bindings["T"]
    inputs = {
        "input_ids": torch.randint(0, 100, (b, t)),
        "positions": torch.arange(t).expand(b, t),
        "token_index": torch.arange(t),
        "key_valid": torch.ones(b, t, dtype=torch.bool),
    }
    exe(inputs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        exe(inputs)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = select_backend("cpu")
    rows = []
    jobs = [(name, cfg, "logits") for name, cfg in CONFIGS.items()]
    jobs.append(("llada-8b-shape", CONFIGS["llada-8b-shape"], "confidence"))
    for name, cfg, head in jobs:
        spec = spec_of(cfg)
        shape_only = name.endswith("-shape")
        device = "meta" if shape_only else "cpu"
        weights = {p.name: torch.randn(p.shape, device=device) * 0.02 for p in param_plan(spec)}
        if spec.tie_embeddings:
            weights["lm_head"] = weights["embed"]
        bindings = {"B": 1, "T": 32 if shape_only else 128, "S": 32 if shape_only else 128, "M": 32}

        def graph(spec=spec, head=head):
            return lower(spec, torch.float32, block_size=spec.default_block_size, head=head, mask_id=spec.mask_id)

        before = graph()
        after, counts = cpu.optimize(graph(), dict(weights))
        row = {
            "model": name if head == "logits" else f"{name}, confidence head, 32 masked positions",
            "bindings": bindings,
            "before": stats(before, bindings),
            "after": stats(after, bindings),
            "rewrites": counts,
        }
        if not shape_only:
            row["before"]["forward_ms"] = forward_ms(cpu, before, weights, bindings)
            merged = dict(weights)
            cpu.optimize(graph(), merged)
            row["after"]["forward_ms"] = forward_ms(cpu, after, merged, bindings)
        rows.append(row)
        print(json.dumps(row))
    (args.out / "passes.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| model (B, T) | nodes | kernel launches | peak activations MB | CPU forward ms (median of 21) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        b, a = r["before"], r["after"]
        ms = f"{b['forward_ms']:.1f} -> {a['forward_ms']:.1f}" if "forward_ms" in b else "shape only"
        lines.append(
            f"| {r['model']} ({r['bindings']['B']}, {r['bindings']['T']}) | {b['nodes']} -> {a['nodes']} | "
            f"{b['launches']} -> {a['launches']} | {b['peak_mb']:.1f} -> {a['peak_mb']:.1f} | {ms} |"
        )
    (args.out / "passes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
