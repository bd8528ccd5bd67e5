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
    # block prefix cache across requests (``prefix_cache.py``): its byte budget; 0 turns it off,
    # None: a default (10% of free CUDA/ROCm memory, else 1 GiB)
    prefix_cache_bytes: int | None = None
    # which models get one (``PREFIX_CACHE_MODES``): "auto" where reuse is exact (block-causal
    # families); "approximate" also bidirectional ones (LLaDA, LLaDA-MoE, Dream), whose prompt K/V
    # depend on the generated tokens, so a hit may change the answer (docs/serving.md)
    prefix_cache: str = "auto"
    # device graphs for lockstep forwards (``backends/triton/graphs.py``): None the backend's
    # default (``DINFER_GRAPHS`` on cuda / ascend), False eager; True where the backend replays none
    # is an error. With graphs, a cohort of b rows runs padded to the smallest bucket >= b
    graphs: bool | None = None
    # the batch-size buckets (None: ``default_graph_batch_sizes(max_num_seqs)``); larger batches run eager
    graph_batch_sizes: tuple[int, ...] | None = None
    # with graphs, a lockstep forward's sequence (its keys, and a window over the whole of
    # it) pads to the next multiple of this many positions (masked keys, dropped queries), so
    # prompts of many lengths share one capture per bucket; 0: exact lengths (a capture per length)
    graph_length_step: int = 256
    # chunked prefill (block-causal models): the most prompt tokens one step computes for a request
    # whose prompt is still being prefilled (whole blocks, at least one); None: what
    # max_num_batched_tokens leaves beside the running rows; 0: off (a long prompt waits for room)
    max_prefill_chunk_tokens: int | None = None
    # the KV-cache pool's byte budget (``kv_pool.kv_pool_plan``): paged, blocks = budget // bytes per
    # block (at most what max_num_seqs rows at max_model_len need); contiguous rows, rows =
    # min(max_num_seqs, budget // bytes per row). None: paged, at most half the free memory;
    # contiguous, max_num_seqs rows whatever they take. At most one of the two: bytes, or
    # a fraction in (0, 1] of the free memory after the weights (CUDA / ROCm: the device's; CPU: MemAvailable)
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float | None = None
    # the KV pool's layout (``kv_blocks.py``): blocks of this many positions, taken per request at
    # admission and shared with the prefix cache (without a budget, at most half the free memory);
    # 0: contiguous rows of max_model_len positions (a static batch's own pool)
    kv_block_size: int = 4

    def validate(self) -> EngineArgs:
        """Each field's type and range, the first problem raised naming the field; returns self."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("graphs", "graph_batch_sizes"):
                _check_graph_field(f.name, v)
                continue
            if f.name == "kv_cache_memory_fraction":
                _check_fraction(v, self.kv_cache_memory)
                continue
            if f.name == "prefix_cache":
                _check_prefix_cache(v, self.prefix_cache_bytes)
                continue
            if f.name == "confidence_head":
                if not isinstance(v, bool):
                    raise GenerationError(f"EngineArgs: confidence_head must be a bool, got {v!r}")
                continue
            nullable = ("max_queue", "max_model_len", "max_forward_tokens", "prefix_cache_bytes", "kv_cache_memory")
            if v is None and f.name in (*nullable, "max_prefill_chunk_tokens"):
                continue
            zero_ok = (
                "max_queue", "prefix_cache_bytes", "max_prefill_chunk_tokens", "graph_length_step", "kv_block_size",
            )  # fmt: skip
            low = 0 if f.name in zero_ok else 1
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


PREFIX_CACHE_MODES = ("auto", "approximate")


def _check_prefix_cache(v, budget) -> None:
    """An approximate prefix cache is asked for on purpose: with the cache off it is a
    contradiction, not something to ignore."""
    if v not in PREFIX_CACHE_MODES:
        raise GenerationError(
            f"EngineArgs: prefix_cache must be one of {', '.join(PREFIX_CACHE_MODES)} (--prefix-cache), got {v!r}"
        )
    if v == "approximate" and budget == 0:
        raise GenerationError(
            "EngineArgs: prefix_cache 'approximate' contradicts prefix_cache_bytes 0 (the cache off; "
            "--prefix-cache approximate, --no-prefix-cache / --prefix-cache-bytes 0); give one of them"
        )


def _check_fraction(v, kv_cache_memory) -> None:
    if v is None:
        return
    if kv_cache_memory is not None:
        raise GenerationError(
            "EngineArgs: kv_cache_memory and kv_cache_memory_fraction both given (--kv-cache-memory, "
            "--kv-cache-memory-fraction); give one of them"
        )
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise GenerationError(f"EngineArgs: kv_cache_memory_fraction must be a number in (0, 1], got {v!r}")


def _check_graph_field(name: str, v) -> None:
    if name == "graphs":
        if v is not None and not isinstance(v, bool):
            raise GenerationError(f"EngineArgs: graphs must be None or a bool, got {v!r}")
        return
    if v is None:
        return
    if (
        not isinstance(v, (tuple, list))
        or not v
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v)
    ):
        raise GenerationError(f"EngineArgs: graph_batch_sizes must be a non-empty list of ints >= 1, got {v!r}")


def default_graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` rounded up (vLLM's capture list:
    ``[1, 2, 4] + range(8, ..., 8)`` up to the padded batch; SGLang's is alike): a batch pads by at
    most 7 rows (at most 2x at the small sizes), and a server with 256 rows captures 35 sizes, not 256."""
    top = max_num_seqs if max_num_seqs <= 2 else 4 if max_num_seqs <= 4 else -(-max_num_seqs // 8) * 8
    return tuple(b for b in (1, 2, 4, *range(8, top + 1, 8)) if b <= top)


def graph_buckets(args: EngineArgs) -> tuple[int, ...]:
    """The engine's batch-size buckets, increasing (``graph_batch_sizes`` sorted, or the default)."""
    sizes = args.graph_batch_sizes
    return tuple(sorted(set(sizes))) if sizes is not None else default_graph_batch_sizes(args.max_num_seqs)


def pool_rows(args: EngineArgs, graphs: bool) -> int:
    """Rows of the KV pool for ``max_num_seqs`` rows decoded at once: with device graphs also the
    padding rows of its bucket (the smallest bucket >= ``max_num_seqs``; none above the largest)."""
    n = args.max_num_seqs
    return next((b for b in graph_buckets(args) if b >= n), n) if graphs else n
