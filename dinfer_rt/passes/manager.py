"""The pass manager: named phases, per-backend pipelines, the verifier after every pass,
per-pass match counts, ``DINFER_DUMP_IR`` dumps, and passes disabled by parameter or by
``DINFER_DISABLE_PASSES`` (bisection of a miscompile)."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dinfer_rt import envs
from dinfer_rt.files import check_writable_dir, write_text_atomic
from dinfer_rt.ir import Graph, IRError, Value
from dinfer_rt.passes import cleanup, fusion, reorder
from dinfer_rt.resident_pages import page_out


@dataclass(frozen=True)
class Pass:
    name: str
    phase: str  # "cleanup" | "fusion" | "reorder"
    run: Callable[[Graph, PassContext], int]  # returns how many rewrites it made
    needs_ops: tuple[str, ...] = ()  # fused ops the backend must have kernels for


@dataclass
class PassContext:
    """What passes may touch besides the graph: the model's weights, to which merged
    parameters are added once (derived tensors are cached by name across graph variants)."""

    weights: MutableMapping[str, torch.Tensor]
    counts: dict[str, int] = field(default_factory=dict)
    reports: dict[str, object] = field(default_factory=dict)  # e.g. peak bytes before/after reordering
    priority: Callable | None = None  # the backend's scheduling priority, if it supplies one

    def derive_concat(self, graph: Graph, values: list[Value]) -> Value:
        name = "|".join(v.name for v in values)
        existing = next((p for p in graph.params if p.name == name), None)
        if existing is not None:
            return existing
        if name not in self.weights:
            parts = [self.weights[v.name] for v in values]
            merged = self.weights[name] = fusion.concat_weights(parts)
            # The parts become row views of the merged tensor (same values): graphs that still
            # use them (an unfused variant, another backend) share its memory instead of holding
            # a second copy of every merged weight.
            lo = 0
            for v, t in zip(values, parts):
                self.weights[v.name] = merged[lo : lo + t.shape[0]]
                lo += t.shape[0]
            page_out(parts)  # the sources' memory-mapped pages are not read again: not resident twice
        return graph.param(name, fusion.concat_type(values))


def default_pipeline() -> list[Pass]:
    return [
        Pass("cse", "cleanup", cleanup.common_subexpressions),
        Pass("dce", "cleanup", cleanup.dead_code),
        Pass("merge_gate_up", "fusion", fusion.merge_gate_up, needs_ops=("swiglu",)),
        Pass("merge_projections", "fusion", fusion.merge_projections, needs_ops=("split",)),
        Pass("add_rms_norm", "fusion", fusion.add_rms_norm, needs_ops=("add_rms_norm",)),
        Pass("lm_head_confidence", "fusion", fusion.lm_head_confidence, needs_ops=("lm_head_confidence",)),
        Pass("fold_rope_into_attention", "fusion", fusion.fold_rope_into_attention, needs_ops=("rope_attention",)),
        Pass("fold_routing_into_moe", "fusion", fusion.fold_routing_into_moe, needs_ops=("moe_routed",)),
        Pass("fuse_attention_block", "fusion", fusion.fuse_attention_block, needs_ops=("attention_block",)),
        Pass("fuse_mlp_block", "fusion", fusion.fuse_mlp_block, needs_ops=("mlp_block",)),
        Pass("dce_after_fusion", "cleanup", cleanup.dead_code),
        Pass("reorder_memory", "reorder", reorder.reorder),
    ]


class PassManager:
    def __init__(
        self,
        passes: list[Pass],
        native_ops: set[str] | None = None,
        priority: Callable | None = None,
        disabled: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.priority = priority
        from_env = {p.strip() for p in (envs.get(envs.DINFER_DISABLE_PASSES) or "").split(",") if p.strip()}
        known = {p.name for p in passes} | {p.name for p in default_pipeline()}  # a backend may drop some
        from dinfer_rt.errors import DinferError

        for source, names in ((envs.DINFER_DISABLE_PASSES, from_env), ("disable_passes", set(disabled))):
            if unknown := names - known:
                raise DinferError(
                    f"{source} names unknown pass(es) {sorted(unknown)}; passes: {', '.join(sorted(known))}"
                )
        disabled = from_env | set(disabled)
        self.passes = [
            p
            for p in passes
            if p.name not in disabled and (native_ops is None or all(op in native_ops for op in p.needs_ops))
        ]

    def run(self, graph: Graph, weights: MutableMapping[str, torch.Tensor]) -> tuple[Graph, dict[str, int]]:
        ctx = PassContext(weights, priority=self.priority)
        dump = envs.get(envs.DINFER_DUMP_IR)
        if dump:
            check_writable_dir(dump, envs.DINFER_DUMP_IR)
            write_text_atomic(Path(dump) / f"{graph.name}.00.lowered.ir", str(graph), envs.DINFER_DUMP_IR)
        for i, p in enumerate(self.passes, start=1):
            ctx.counts[p.name] = p.run(graph, ctx)
            try:
                graph.verify()
            except IRError as e:
                raise IRError(f"after pass {p.name!r}: {e}") from None
            if dump:
                name = f"{graph.name}.{i:02d}.{p.phase}.{p.name}.ir"
                write_text_atomic(Path(dump) / name, str(graph), envs.DINFER_DUMP_IR)
        return graph, ctx.counts
