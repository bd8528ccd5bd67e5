"""EngineArgs: how the engine runs, apart from what a request means (``SamplingParams``).

A request's meaning (rule, thresholds, cache policy, block and generation lengths, temperature,
seed, stop strings, guidance, precision schedule) travels with the request; how the engine gets
there (rows per forward, slices, host syncs, the confidence head) is the operator's choice and
is set once per engine: ``LLM(..., sync_every=4)``, ``dinfer-rt serve --sync-every 4``. None of
these settings changes a greedy answer; they trade memory, syncs and launches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dinfer_rt.errors import GenerationError


@dataclass
class EngineArgs:
    max_num_seqs: int = 16  # rows decoded at once
    max_num_batched_tokens: int = 4096  # query slots one forward may admit (a long prompt waits for room)
    max_queue: int | None = None  # waiting requests before QueueFull (None: unbounded)
    max_model_len: int | None = None  # KV-cache pool length (None: the model's max length)
    # rows x computed positions per forward; a bigger batch runs in row slices (None: no bound)
    max_forward_tokens: int | None = 4096
    sync_every: int = 1  # check block completion every k steps (one host sync; extra forwards count in NFE)
    confidence_head: bool = True  # greedy score-only rules read the model's fused confidence head
    # block prefix cache across requests (block-causal models; ``prefix_cache.py``): its byte
    # budget; 0 turns it off, None: a default (10% of free CUDA/ROCm memory, else 1 GiB)
    prefix_cache_bytes: int | None = None

    def validate(self) -> EngineArgs:
        """Each field's type and range, the first problem raised naming the field; returns self."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "confidence_head":
                if not isinstance(v, bool):
                    raise GenerationError(f"EngineArgs: confidence_head must be a bool, got {v!r}")
                continue
            if v is None and f.name in ("max_queue", "max_model_len", "max_forward_tokens", "prefix_cache_bytes"):
                continue
            low = 0 if f.name in ("max_queue", "prefix_cache_bytes") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise GenerationError(f"EngineArgs: {f.name} must be an int >= {low}, got {v!r}")
        return self

    @classmethod
    def build(cls, args: EngineArgs | None = None, **overrides) -> EngineArgs:
        """``args`` (default: the defaults) with ``overrides`` applied, validated; an unknown
        keyword is an error naming it and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise GenerationError(f"unknown engine argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return dataclasses.replace(args or cls(), **overrides).validate()
