"""The engine: request lifecycle over the one decode state machine (``decode.py``).

Every way dinfer-rt decodes goes through :class:`Engine`: ``LLM.generate`` submits a static
batch as one cohort (``run_batch``), the server submits each request as its own cohort as it
arrives. Each :meth:`Engine.step` advances every running cohort by one scheduler step: a lone
cohort runs the lockstep path (one ``compute`` window, static shapes, the device commit
kernel, CFG, precision schedules); several cohorts at different blocks share one forward with
per-row query windows, padded to the longest (``stats.padded_tokens`` counts the padding).
A request's greedy output equals ``LLM.generate`` of its prompt alone whatever runs beside it.

Cohorts hold contiguous rows of the KV-cache pool, in admission order; when a cohort ends, the
last cohort of the same size moves into its rows (else the later ones move down), so the
running rows are always rows 0..B-1. The pool is paged by default (``kv_blocks.py``): a row is a
row of the block table, a request takes the blocks of its own length when admitted (admission
waits for free blocks, evicting prefix-cache blocks nobody holds) and gives them back when it
ends, a move is a table-row move, and a prefix-cache hit points the row at the cached blocks.
With ``kv_block_size`` 0 (a static batch) rows are contiguous ``max_model_len`` buffers.

A request finishes at the step whose committed prefix (the generated tokens up to the first
slot still masked, which can no longer change) holds an EOS (with ``early_stop``), a stop
string or ``max_tokens`` tokens; its row is then filled and takes no more decisions, and a
cohort whose requests all finished ends.

Thread model: ``submit`` and ``abort`` may be called from any thread; ``step`` from one.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dinfer_rt.decode import BatchResult, Cohort, StopCheck, check_token_ids, forward_rows
from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import GenerationError
from dinfer_rt.graph_buckets import GraphBuckets
from dinfer_rt.kv_blocks import KVBlocks, blocks_for
from dinfer_rt.kv_pool import available_memory, check_batch_fits, format_bytes, kv_pool_plan
from dinfer_rt.model import Model, PagedKV
from dinfer_rt.model_runner import ForwardInputs, LocalRunner
from dinfer_rt.prefix_cache import CachedBlock, PrefixCache, default_budget
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.stopping import before_eos, cut_at_stop, first_stop

APPROXIMATE_POLICIES = ("prefix", "dual", "vicinity")
"""Cache policies under which a bidirectional request uses the approximate prefix cache: those
that keep the prompt's K/V between refreshes anyway (``Engine._prefix_approx``)."""


class QueueFull(GenerationError):
    """The wait queue is at its bound (``max_queue``): the server answers 429."""


class EngineClosed(GenerationError):
    """The engine is draining (shutdown): no new requests."""


Listener = Callable[["Request", str], None]
"""``(request, event)`` with event "update" (more tokens became final) or "finish"; called on
the engine's thread, so it must only hand the event on (the server posts it to its loop)."""


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    listener: Listener | None = None
    return_canvas: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    priority: int = 0  # the wait queue is ordered by (priority, arrival): lower first, FIFO within one
    status: str = "waiting"  # waiting | running | finished
    finish_reason: str | None = None  # stop | length | abort | error
    error: BaseException | None = None
    final_ids: list[int] = field(default_factory=list)  # generated ids that can no longer change
    canvas: list[int] | None = None  # the whole generated region after the last step (return_canvas)
    canvas_final: int = 0  # how many leading canvas slots are final (the rest may still change)
    stream_provisional: bool = False  # also publish the provisional tail (an editing rule's open block)
    provisional_ids: list[int] = field(default_factory=list)  # after final_ids, up to the first mask: may change
    edits: int = 0  # token-to-token rewrites (editing rules)
    post_steps: int = 0  # forwards its block started with no mask (editing rules)
    output_ids: list[int] = field(default_factory=list)  # at finish: cut at EOS, stop string, max_tokens
    text: str = ""
    forwards: int = 0  # forwards this request took part in
    cached_tokens: int = 0  # prompt tokens whose K/V were copied from the prefix cache
    # ``params.logprobs``: per final id, its log-probability under the forward that made it final,
    # and its top alternatives [(id, log-probability)] (aligned with final_ids; the output's are
    # the first len(output_ids))
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    admitted: float | None = None
    finished: float | None = None
    cohort: Cohort | None = field(default=None, repr=False)  # its decode state (from submit on)
    row: int = 0  # its row in the cohort

    @property
    def done(self) -> bool:
        return self.status == "finished"


@dataclass
class EngineStats:
    steps: int = 0  # forwards run (one per engine step with running rows)
    row_forwards: int = 0  # sum over steps of the rows in the forward
    committed: int = 0  # tokens committed
    computed_tokens: int = 0  # query slots computed, padding included
    padded_tokens: int = 0  # of which padding
    lockstep_steps: int = 0  # forwards of one cohort alone (static shapes, one compute window)
    per_row_steps: int = 0  # forwards of several cohorts with per-row query windows
    finished: int = 0
    failed: int = 0
    edits: int = 0  # token-to-token rewrites (editing rules)
    post_steps: int = 0  # row-forwards whose block had no mask left (editing rules)
    prefill_chunks: int = 0  # chunked prefill: forwards over prompt blocks of a cohort not decoding yet
    prefill_tokens: int = 0  # of which query slots (also in computed_tokens)
    # prefix cache, requests admitted together: prefill forwards over the prompt blocks a request
    # shares with one waiting behind it, run at its admission and cached at once so the other
    # admits with a hit in the same step (``_prefix_share``; also in prefill_chunks / prefill_tokens)
    shared_prefills: int = 0
    # device graphs (``EngineArgs.graphs``; 0 without them): forwards run at a batch-size bucket
    # (captured or replayed), forwards run eager (outside the buckets, per-row windows, rows after
    # the cohort taken), and the padding rows added to reach a bucket
    graph_forwards: int = 0
    eager_forwards: int = 0
    padded_rows: int = 0
    padded_positions: int = 0  # rows x positions appended to reach a length bucket (graph_length_step)


def check_request(
    prompt: list[int],
    params: SamplingParams,
    max_tokens: int | None,
    *,
    vocab: int,
    max_model_len: int,
    has_tokenizer: bool,
    block_causal: bool = False,
    kv_bytes_per_position: int | None = None,
    kv_block_size: int = 0,
    kv_pool_blocks: int | None = None,
) -> int:
    """The engine's admission checks: a ``GenerationError`` naming the field, else ``max_tokens``
    (default ``params.gen_length``). ``kv_bytes_per_position``: one position's K/V over the layers
    (``kv_row_bytes(..., 1)``), so a request past ``max_model_len`` is also told the memory side.
    ``kv_pool_blocks`` (a paged pool's blocks of ``kv_block_size`` positions a request may hold):
    a request whose blocks exceed the whole pool can never run and is refused with its bytes."""
    params.validate(block_causal=block_causal)
    if not prompt:
        raise GenerationError("prompt: at least one token is needed")
    check_token_ids([prompt], vocab)
    max_tokens = params.gen_length if max_tokens is None else max_tokens
    if not 1 <= max_tokens <= params.gen_length:
        raise GenerationError(f"max_tokens {max_tokens} must be in [1, gen_length {params.gen_length}]")
    if len(prompt) + params.gen_length > max_model_len:
        total = len(prompt) + params.gen_length
        memory = ""
        if kv_bytes_per_position is not None:
            memory = (
                f" (its K/V would need {format_bytes(total * kv_bytes_per_position)}, "
                f"{total * kv_bytes_per_position} bytes: {total} positions x {kv_bytes_per_position} bytes; "
                f"a KV pool row holds {max_model_len} positions, {format_bytes(max_model_len * kv_bytes_per_position)})"
            )
        raise GenerationError(
            f"prompt ({len(prompt)} tokens) + {params.gen_length} generated = {total} "
            f"tokens exceeds the max model length {max_model_len}{memory}"
        )
    if kv_pool_blocks is not None and blocks_for(len(prompt) + params.gen_length, kv_block_size) > kv_pool_blocks:
        total = len(prompt) + params.gen_length
        need = blocks_for(total, kv_block_size)
        per_block = kv_block_size * (kv_bytes_per_position or 0)
        raise GenerationError(
            f"prompt ({len(prompt)} tokens) + {params.gen_length} generated = {total} tokens need {need} KV blocks of "
            f"{kv_block_size} positions ({format_bytes(need * per_block)}, {need * per_block} bytes) but the whole KV "
            f"pool holds {kv_pool_blocks} ({format_bytes(kv_pool_blocks * per_block)}); raise --kv-cache-memory "
            "(or --kv-cache-memory-fraction), or shorten the prompt or gen_length"
        )
    if params.stop and not has_tokenizer:
        raise GenerationError("stop: stop strings need the model's tokenizer (loaded without one)")
    return max_tokens


def notify(req: Request, event: str) -> None:
    """Hand an event to the request's listener; a listener that fails (its client's event loop
    gone) must not stop the engine, so its error only detaches it."""
    if req.listener is not None:
        try:
            req.listener(req, event)
        except Exception:
            req.listener = None


class Engine:
    """Continuous batching over one model: ``submit`` requests, call ``step`` until idle.

    ``args`` (:class:`~dinfer_rt.engine_args.EngineArgs`, or its fields as keywords) says how it
    runs: ``max_num_seqs`` rows at once; ``max_num_batched_tokens`` bounds the query slots of one
    forward at admission (a cohort's first forward computes its whole sequence), so a long
    prompt waits for room instead of stalling every running row (block-causal models compute
    its whole prompt blocks in chunks across steps instead: ``_prefill``,
    ``max_prefill_chunk_tokens``); waiting requests are admitted by (``priority``, arrival);
    ``max_queue`` bounds the waiting requests (``QueueFull`` past it); ``max_model_len`` sizes the KV-cache pool
    (default: the model's max length). ``block_length``: the served default block length of a
    block-causal model (LLaDA2; reported to front ends). Cohorts of block-causal models with
    different block lengths (their masks differ) take separate forwards. ``prefix_cache_bytes``:
    the budget of the block prefix cache across requests (``prefix_cache.py``; exact on
    block-causal models; on bidirectional ones only with ``prefix_cache="approximate"``; 0: off,
    None: the default budget)."""

    def __init__(
        self,
        model: Model,
        args: EngineArgs | None = None,
        *,
        block_length: int | None = None,
        scratch_slot: bool = True,
        runner: LocalRunner | None = None,
        **fields,
    ) -> None:
        self.args = args = EngineArgs.build(args, **fields)
        self.model = model
        self.max_num_seqs, self.max_num_batched_tokens = args.max_num_seqs, args.max_num_batched_tokens
        self.max_queue, max_model_len = args.max_queue, args.max_model_len
        if max_model_len is not None and not 1 <= max_model_len <= model.spec.max_length:
            raise GenerationError(
                f"Engine: max_model_len {max_model_len} must be in [1, {model.spec.max_length}] "
                "(the model's max length)"
            )
        self.max_model_len = max_model_len or model.spec.max_length
        if args.max_prefill_chunk_tokens and not model.spec.block_causal:  # it would be ignored
            raise GenerationError(
                f"Engine: max_prefill_chunk_tokens {args.max_prefill_chunk_tokens} needs a block-causal model "
                f"(LLaDA2.x, SDAR); this {model.spec.family} model attends both ways, so every prompt K/V depends "
                "on the whole sequence and its prompt is computed in one forward: leave it unset"
            )
        default = SamplingParams().for_model(model.spec).block_length
        self.block_size = (block_length or default) if model.spec.block_causal else None
        self.mask_id, self.eos = model.mask_id, set(model.eos_ids)
        # + a scratch slot that per-row padding queries write (without it, cohorts never share a
        # forward: what a static batch of one cohort wants, its cache then one contiguous buffer,
        # which the native kernels read in place); from the model's pool, so a static batch's
        # engine writes the buffers of the last one (device graphs bind them)
        self.scratch_slot = scratch_slot
        self.buckets = GraphBuckets(model.backend, args)
        # the pool's rows (``kv_pool_plan``): max_num_seqs, or as many as the KV budget holds
        tp = getattr(model, "tensor_parallel", None)
        self.kv_plan = kv_pool_plan(
            model.spec, model.dtype, args, self.max_model_len, scratch_slot=scratch_slot,
            kv_heads=None if tp is None else tp.kv_heads(model.spec), graphs=self.graphs,
            free=available_memory(model.backend.device())
            if args.kv_cache_memory_fraction is not None or (args.kv_block_size and args.kv_cache_memory is None)
            else None,
        )  # fmt: skip
        if self.kv_plan.rows < self.max_num_seqs:  # the budget holds fewer rows: that many decode at once
            self.args = args = dataclasses.replace(args, max_num_seqs=self.kv_plan.rows)
            self.max_num_seqs = self.kv_plan.rows
            self.buckets = GraphBuckets(model.backend, args)  # the default buckets follow the rows
        self.pool_rows = self.kv_plan.pool_rows
        # the longest sequence a graphed forward pads to: the pool's positions, the model's length
        self._graph_positions = self.max_model_len  # (the scratch slot past it is no bucket's)
        self.kv_pool_bytes = self.kv_plan.nbytes  # what the pool takes (K and V of every layer)
        self.kv_bytes_per_position = self.kv_plan.row_bytes // self.kv_plan.positions
        self.paged = self.kv_plan.paged
        self.blocks: KVBlocks | None = None  # paged: which blocks each row holds
        # paged: the prefix-cache hit ``_fits`` kept room for, taken by ``_prefix_lookup``
        self._admission_plan: tuple[list[CachedBlock], int] | None = None
        if self.paged:
            plan = self.kv_plan
            k, v = model.new_paged_pool(plan.num_blocks, plan.block_size)
            self.cache = PagedKV(k, v, torch.zeros((0, 0), dtype=torch.int32), 0)
            self.blocks = KVBlocks(plan.num_blocks, plan.block_size, self.pool_rows, plan.max_blocks)
        else:
            self.cache = model.cache_pool.acquire(self.pool_rows, self.kv_plan.positions)
        # what runs each forward: in this process, or (tensor parallel) on every rank of the group
        self.runner = runner or LocalRunner(model)
        self.runner.bind(self.cache)
        # where graphs replay, every forward goes through _run_graphed (bucket or eager); else the
        # runner; paged, each cached forward first gets its rows' block table (``_with_blocks``)
        self._inner_runner = self._run_graphed if self.buckets.replays else self.runner
        self._forward_runner = self._run_paged if self.paged else self._inner_runner
        self.prefix_cache = self._prefix_cache(args)
        self._prefix_held: dict[Cohort, list[CachedBlock]] = {}  # the cached blocks each cohort holds
        self._prefix_fresh: list[Cohort] = []  # admitted this step: their prompt blocks are cached after the forward
        self.cohorts: list[Cohort] = []  # row order: cohort i holds the rows after cohort i - 1's
        self.prefilling: list[Cohort] = []  # chunked prefill: prompt not all in the pool yet (rows after cohorts')
        self.waiting: deque[list[Request]] = deque()  # groups admitted together (one cohort each)
        self.stats = EngineStats()
        self.forward_s: list[float] = []  # wall time of every forward run (commit_step indexes them)
        self._lock = threading.Lock()
        self._aborted: set[str] = set()
        self._ids = itertools.count()
        self.closed = False

    # ---------------------------------------------------------------- requests
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        max_tokens: int | None = None,
        request_id: str | None = None,
        listener: Listener | None = None,
        return_canvas: bool = False,
        stream_provisional: bool = False,
        priority: int = 0,
    ) -> Request:
        """Validate and queue a request (ids). ``max_tokens`` cuts the output (default
        ``params.gen_length``, which must hold it). ``stream_provisional``: "update" events also
        when the provisional tail changes (``Request.provisional_ids``: an editing rule's open
        block, which may still be rewritten). ``priority`` (an int, vLLM's meaning): the wait
        queue admits lower values first, FIFO within a priority; running rows are never
        preempted. Raises ``GenerationError`` naming the field."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise GenerationError(f"priority must be an int, got {priority!r}")
        max_tokens = self.check_request(prompt, params, max_tokens)
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt), params, max_tokens, listener, return_canvas)
        req.stream_provisional = bool(stream_provisional)
        req.priority = priority
        self._queue([req], Cohort(self.model, [req.prompt], params, self.args))
        return req

    def submit_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        stop: StopCheck | None = None,
        cohort: Cohort | None = None,
    ) -> list[Request]:
        """Queue a static batch: one cohort, its prompts left-padded into one frame, decoded in
        lockstep block by block (``LLM.generate``). ``stop`` is asked at the end of every block
        for each row still running; a row it stops finishes like one that produced EOS.
        ``cohort``: the batch's cohort if the caller built it already (``run_batch``: built once)."""
        cohort = cohort or Cohort(self.model, prompts, params, self.args)
        if cohort.b > self.max_num_seqs:
            raise GenerationError(f"a batch of {cohort.b} prompts exceeds max_num_seqs {self.max_num_seqs}")
        if cohort.n > self.max_model_len:
            raise GenerationError(f"{cohort.n} tokens exceed the engine's max model length {self.max_model_len}")
        if params.stop and self.model.tokenizer is None:
            raise GenerationError("stop: stop strings need the model's tokenizer (loaded without one)")
        reqs = [Request(f"req-{next(self._ids)}", list(p), params, params.gen_length) for p in prompts]
        groups = batch_groups(cohort, prompts)
        if self.paged:  # a batch runs as one cohort per group: each must fit the whole pool at once
            for rows in groups:
                n = max(len(prompts[i]) for i in rows) + params.gen_length
                need = len(rows) * blocks_for(n, self.blocks.block_size)
                if need > self.blocks.usable:
                    raise GenerationError(
                        f"a batch of {len(rows)} prompts of up to {n} positions needs {need} KV blocks of "
                        f"{self.blocks.block_size} positions at once, the whole KV pool holds {self.blocks.usable}; "
                        "raise --kv-cache-memory, or submit fewer prompts together"
                    )
        if len(groups) == 1:
            cohort.stop = stop
            self._queue(reqs, cohort)
            return reqs
        for rows in groups:
            part = Cohort(self.model, [prompts[i] for i in rows], params, self.args)
            part.stop = None if stop is None else (lambda r, ids, rows=rows: stop(rows[r], ids))
            self._queue([reqs[i] for i in rows], part)
        return reqs

    # ---------------------------------------------------------------- prefix cache
    def _prefix_cache(self, args: EngineArgs) -> PrefixCache | None:
        """The block prefix cache. Exact on a block-causal model (a block's K/V depend only on it
        and the blocks before it) whose block outputs do not read the previous position (no
        shifted logits); approximate on a bidirectional one, only when asked (``prefix_cache``
        "approximate"). A tensor-parallel group gets the exact cache on its paged pool only (hits
        and inserts are block-table entries, which travel with each forward's inputs, and a
        copy-on-write reaches every rank): not the approximate one, nor one over contiguous rows,
        whose copies would have to be sent to every rank. ``prefix_cache_bytes`` 0 turns it off
        (``prefix_cache_summary`` says why there is none)."""
        spec, budget = self.model.spec, args.prefix_cache_bytes
        grouped = type(self.runner) is not LocalRunner
        if budget == 0 or (grouped and not (self.paged and spec.block_causal)):
            return None
        if spec.block_causal and spec.shift_logits:
            return None
        if not spec.block_causal and args.prefix_cache != "approximate":
            return None
        if self.paged:  # its blocks are the pool's: they cost nothing more, and it never holds more than the pool
            plan = self.kv_plan
            size = plan.nbytes if budget is None else min(budget, plan.nbytes)
            return PrefixCache(
                size, approximate=not spec.block_causal, blocks=self.blocks, block_bytes=plan.block_bytes
            )
        size = default_budget(self.model.backend.device()) if budget is None else budget
        return PrefixCache(size, approximate=not spec.block_causal)

    @property
    def prefix_cache_mode(self) -> str:
        """The prefix cache's mode: "exact", "approximate" (a bidirectional model's, asked for) or "off"."""
        return "off" if self.prefix_cache is None else self.prefix_cache.mode

    def prefix_cache_summary(self) -> str:
        """The start-up line on the prefix cache: its mode and budget, or why there is none. An
        approximate cache is never silent: the line says that outputs may differ from a cold run."""
        cache, spec = self.prefix_cache, self.model.spec
        if cache is not None:
            size = f"budget {format_bytes(cache.budget)} ({cache.budget} bytes)"
            if cache.approximate:
                return (
                    "dinfer-rt prefix cache: approximate (bidirectional model; outputs may differ from a cold "
                    f"run: cached prompt K/V are an earlier request's and are never recomputed), {size}"
                )
            return f"dinfer-rt prefix cache: exact (block-causal model: a hit decodes as cold), {size}"
        if self.args.prefix_cache_bytes == 0:
            why = "--no-prefix-cache / --prefix-cache-bytes 0"
        elif type(self.runner) is not LocalRunner and not (self.paged and spec.block_causal):
            why = (
                "tensor-parallel replicas: only the exact cache of a block-causal model on the paged pool runs "
                "there (--kv-block-size > 0)"
            )
        elif spec.block_causal:
            why = "a block-causal family with shifted logits (a hit would not be exact)"
        else:
            why = "bidirectional model: reuse would be approximate; --prefix-cache approximate turns it on"
        return f"dinfer-rt prefix cache: off ({why})"

    def _prefix_writes(self, cohort: Cohort) -> bool:
        """Whether the cohort's pool rows hold K/V worth caching: a cached policy (``none`` writes
        no cache), no precision schedule (low-precision forwards write K/V) and no guidance
        (uncached forwards)."""
        p = cohort.params
        return self.prefix_cache is not None and p.cache != "none" and cohort.schedule is None and p.cfg_scale == 0

    def _prefix_exact(self, cohort: Cohort) -> bool:
        """Whether the cohort's pool rows hold exact K/V of its finished blocks (a block-causal
        model's, ``_prefix_writes``), so it caches them after its first forward and at its end."""
        return self._prefix_writes(cohort) and not self.prefix_cache.approximate

    def _prefix_approx(self, cohort: Cohort) -> bool:
        """Whether the cohort takes part in the approximate cache (a bidirectional model's): a
        policy that already keeps prompt K/V stale between refreshes (``APPROXIMATE_POLICIES``).
        ``anchored`` / ``delayed`` / ``adaptive`` recompute the prompt every step, which is what
        keeps them accurate on the embedded task: freezing it would defeat them, so they neither
        look up nor insert. It caches its prompt blocks after its first forward only (the state a
        cold first forward of the same prompt computes), never at its end (by then the prompt's
        K/V have seen its answer)."""
        return (
            self._prefix_writes(cohort)
            and self.prefix_cache.approximate
            and cohort.params.cache in APPROXIMATE_POLICIES
        )

    def _prefix_block(self, cohort: Cohort) -> int:
        """The cache's block length for the cohort: its block-causal block, else (approximate)
        the request's ``block_length``, blocks aligned to position 0 over the prompt."""
        return cohort.block_size or cohort.params.block_length

    def _prefix_span(self, cohort: Cohort) -> int:
        """The leading positions whose whole blocks the cohort looks up and inserts at
        admission: block-causal, the prompt's blocks before its first decoded block (``s``);
        approximate, the prompt's whole blocks, less its last position for a shifted-logits
        family (Dream: that position's output predicts the first generated slot, so every
        forward computes it)."""
        if self.model.spec.block_causal:
            return cohort.s
        lb = self._prefix_block(cohort)
        return (cohort.p_len - int(self.model.spec.shift_logits)) // lb * lb

    def _prefix_reuses(self, cohort: Cohort) -> bool:
        """Whether the cohort looks its prompt up in the prefix cache at admission: a lone row
        with cacheable K/V and at least one whole prompt block in ``_prefix_span``; exact: not
        under ``vicinity``'s warm-up (its first forwards recompute every position anyway), while
        an approximate hit is never recomputed (``Cohort.cached_prefix``), warm-up or not."""
        if cohort.b != 1:
            return False
        if self._prefix_approx(cohort):
            return self._prefix_span(cohort) > 0
        p = cohort.params
        return (
            self._prefix_exact(cohort)
            and not (p.cache == "vicinity" and p.vicinity_warmup > 0)
            and cohort.s >= cohort.block_size
        )

    def _prefix_lookup(self, cohort: Cohort) -> None:
        """At admission: copy the K/V of the longest cached prefix of the prompt's whole blocks
        (``_prefix_span``; a lone row) into the cohort's pool row, so its first forward computes
        only the rest (``_prefix_reuses`` says which cohorts look up). Approximate: no forward of
        the request recomputes them (``Cohort.cached_prefix``)."""
        if not self._prefix_reuses(cohort):
            return
        req, lb = cohort.requests[0], self._prefix_block(cohort)
        span = self._prefix_span(cohort)
        if self.paged:  # the row's table points at the cached blocks: nothing is copied
            chain, hit = self._admission_plan if self._admission_plan is not None else self._plan(cohort)
            self._admission_plan = None
            self._prefix_held[cohort] = self.prefix_cache.take(chain, hit, span // lb * lb)
            row = cohort.start_row
            self.blocks.allocate(row, cohort.n, shared=[node.pool_block for node in chain])
            # a hit ending inside a pool block: that block is copied now, while the admission's
            # count of free blocks still holds (the first forward writes the rest of it)
            self.runner.copy_blocks(self.blocks.writable(row, hit))
            cohort.cached_prefix = req.cached_tokens = hit
            return
        chain, hit = self.prefix_cache.lookup(req.prompt, lb, span // lb)
        self._prefix_held[cohort] = chain
        if chain:
            cohort.cached_prefix = req.cached_tokens = PrefixCache.copy_into(chain, self.cache, cohort.start_row)

    def _prefix_siblings(self, cohort: Cohort, room: int) -> int:
        """Requests admitted together: the most leading prompt positions (whole blocks before
        the first decoded block) that the cohort being admitted shares with any one of the next
        ``room`` waiting requests (those that may be admitted in this step too) that will look
        the cache up; 0 if none. Its blocks enter the cache only after its first forward, too
        late for a request admitted beside it, so ``_admit`` computes the shared ones first
        (``_prefix_share``). Called with the lock held."""
        if room <= 0 or not self._prefix_exact(cohort) or not self._prefix_reuses(cohort):
            return 0  # approximate: bidirectional prompt blocks cannot be computed apart from the rest
        lb, prompt = cohort.block_size, cohort.requests[0].prompt
        best = 0
        for group in itertools.islice(self.waiting, room):
            other = group[0].cohort
            if len(group) != 1 or other.block_size != lb or not self._prefix_reuses(other):
                continue
            theirs, upto = group[0].prompt, min(cohort.s, other.s)
            if upto <= best or prompt[:lb] != theirs[:lb]:
                continue
            k = upto
            if prompt[:upto] != theirs[:upto]:  # else every block is shared
                k = lb
                while k + lb <= upto and prompt[k : k + lb] == theirs[k : k + lb]:
                    k += lb
            best = max(best, k)
        return best

    def _prefix_share(self, cohort: Cohort, upto: int) -> int:
        """Compute the cohort's prompt positions [cached_prefix, upto) (whole blocks that a
        request waiting behind it shares) in a prefill forward at its admission, as chunked
        prefill does (exact for a block-causal model: its first forward then reads them from the
        pool), and cache them at once, so a sibling admitted next in this step copies them
        instead of computing them again. Returns the query slots computed."""
        width, lb = upto - cohort.cached_prefix, cohort.block_size
        self._prefill_chunk(cohort, width)
        self.stats.shared_prefills += 1
        # its ids from the request (a lone row), not the device: no host sync in the middle of admission
        chain = self._cache_row(cohort.requests[0].prompt, lb, upto, cohort.start_row)
        self._prefix_held.setdefault(cohort, []).extend(chain)
        return cohort.b * width

    def _prefix_insert(self, cohort: Cohort, upto: int) -> None:
        """Cache each row's whole blocks before position ``upto`` (their K/V in the pool must be
        exact: computed over these final tokens, or approximate: a first forward's); the cohort
        holds them until it ends. Only unpadded rows: a padded row's prompt sits at other positions."""
        lb = self._prefix_block(cohort)
        rows = [r for r in range(cohort.b) if cohort.pads[r] == 0]
        if not rows or upto < lb:
            return
        x = cohort.x[:, :upto].cpu()
        held = self._prefix_held.setdefault(cohort, [])
        for r in rows:
            held += self._cache_row(x[r].tolist(), lb, upto, cohort.start_row + r)

    def _cache_row(self, tokens: list[int], lb: int, upto: int, row: int) -> list[CachedBlock]:
        """Cache pool row ``row``'s whole blocks before ``upto``; contiguous rows: copies of their
        K/V. Paged, exact (block-causal): the row's own blocks by reference (it never writes below
        ``upto`` again; copy-on-write would keep them if it did). Paged, approximate: copies into
        free blocks, as far as there are any (the row goes on refreshing its prompt, so sharing its
        blocks would only move the copy to its next refresh, where no free block may be left)."""
        if not self.paged:
            return self.prefix_cache.insert(tokens, lb, upto // lb, self.cache, row)
        blocks, units = self.blocks, upto // lb * lb // self.blocks.block_size
        own = blocks.row_blocks(row, units)
        if not self.prefix_cache.approximate:
            chain = self.prefix_cache.insert_blocks(tokens, lb, own)
            blocks.mark_shared(row, units)
            return chain
        have = len(self.prefix_cache.match(tokens, lb, units))  # cached already: nothing to copy
        with self._lock:  # what the request waiting first needs stays free
            head = self.waiting[0][0].cohort if self.waiting else None
        spare = blocks.free - (0 if head is None else head.b * blocks_for(head.n, blocks.block_size))
        fresh = [blocks.take() for _ in range(max(0, min(units - have, spare)))]
        self.runner.copy_blocks(list(zip(own[have:], fresh)))
        existing = [node.pool_block for node in self.prefix_cache.match(tokens, lb, have)]
        try:
            return self.prefix_cache.insert_blocks(tokens, lb, existing + fresh)
        finally:
            for blk in fresh:  # the cache holds what it kept; the rest is free again
                blocks.unref(blk)

    def _prefix_release(self, cohort: Cohort) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(self._prefix_held.pop(cohort, []))

    def _retire(self, cohort: Cohort) -> None:
        """A cohort leaves the pool: its prefix-cache holds and (paged) its rows' blocks go back."""
        self._prefix_release(cohort)
        if self.paged:
            for r in range(cohort.b):
                self.blocks.release(cohort.start_row + r)

    def _on_forward(self, wall: float) -> int:
        self.forward_s.append(wall)
        return len(self.forward_s) - 1

    def _wire(self, group: list[Request], cohort: Cohort) -> None:
        for row, req in enumerate(group):
            req.cohort, req.row = cohort, row
        cohort.requests = group
        cohort.on_forward = self._on_forward
        cohort.run = self._forward_runner

    def _queue(self, group: list[Request], cohort: Cohort) -> None:
        self._wire(group, cohort)
        with self._lock:
            if self.closed:
                raise EngineClosed("the engine is shutting down and admits no new requests")
            if self.max_queue is not None and self.num_waiting >= self.max_queue:
                raise QueueFull(f"the wait queue is full ({self.num_waiting} of max_queue {self.max_queue})")
            # ordered by (priority, arrival): after every group of the same or a lower priority
            at, priority = len(self.waiting), group[0].priority
            while at and self.waiting[at - 1][0].priority > priority:
                at -= 1
            self.waiting.insert(at, group)

    def check_request(self, prompt: list[int], params: SamplingParams, max_tokens: int | None) -> int:
        """What ``submit`` refuses, without queueing (a front end over replicas checks it before
        routing): a ``GenerationError`` naming the field, else the request's ``max_tokens``."""
        return check_request(
            prompt, params, max_tokens, vocab=self.model.spec.vocab, max_model_len=self.max_model_len,
            has_tokenizer=self.model.tokenizer is not None, block_causal=self.model.spec.block_causal,
            kv_bytes_per_position=self.kv_bytes_per_position, kv_block_size=self.kv_plan.block_size,
            kv_pool_blocks=self.blocks.usable if self.paged else None,
        )  # fmt: skip

    def abort(self, request_id: str) -> None:
        """Cancel a request (a client went away): its row stops at the next step; a waiting one
        stops counting against ``max_queue`` at once."""
        with self._lock:
            self._aborted.add(request_id)

    def close(self) -> None:
        """Stop admitting: ``submit`` raises ``EngineClosed``; queued requests are failed with it."""
        with self._lock:
            self.closed = True
            queued, self.waiting = [r for g in self.waiting for r in g], deque()
        for req in queued:
            self._finish(req, "abort", EngineClosed("the server shut down before this request started"))

    def release(self) -> None:
        """Hand the KV cache back to the model's pool (an engine for one static batch)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.cache is not None:
            if not self.paged:  # a paged pool is this engine's own
                self.model.cache_pool.release(self.cache)
            self.cache = None
            self.runner.bind(None)

    @property
    def num_waiting(self) -> int:
        """Waiting requests not aborted or finished (an aborted one leaves the queue at the next
        step; one aborted from a waiting batch is finished there, its batch left queued)."""
        aborted = self._aborted
        return sum(1 for g in self.waiting for r in g if not r.done and r.id not in aborted)

    @property
    def num_running(self) -> int:
        return sum(1 for c in self.cohorts + self.prefilling for r in c.requests if not r.done)

    def has_work(self) -> bool:
        return bool(self.cohorts or self.prefilling or self.waiting)

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self) -> list[Request]:
        """Admit, run one forward for every running cohort, apply each cohort's rule, finish
        requests. Returns the requests finished in this step. An exception inside the step
        fails only the requests of this step."""
        finished: list[Request] = []
        self._drop_aborted(finished)
        for cohort in list(self.cohorts):  # cohorts past their last block end now
            try:
                if not cohort.prepare():
                    self._end_cohort(cohort, "length", finished)
            except Exception as err:
                self._end_cohort(cohort, "error", finished, err)
        self._admit(finished)
        if not self.cohorts:
            return finished
        fresh, self._prefix_fresh = self._prefix_fresh, []
        try:
            self._forward_and_decide()
        except Exception as err:  # fail this step's requests, keep serving
            for cohort in list(self.cohorts):
                self._end_cohort(cohort, "error", finished, err)
            return finished
        for cohort in fresh:  # their first forward computed the prompt's whole blocks: shared from now on
            self._prefix_insert(cohort, self._prefix_span(cohort))
        for cohort in list(self.cohorts):
            self._check_final(cohort, finished)
        return finished

    def _drop_aborted(self, finished: list[Request]) -> None:
        with self._lock:
            aborted, self._aborted = self._aborted, set()
            gone = [r for g in self.waiting for r in g if r.id in aborted]
            if gone:
                self.waiting = deque(g for g in self.waiting if not all(r.id in aborted for r in g))
        for req in gone:
            if req.cohort is not None and len(req.cohort.requests) > 1:
                req.cohort.finish_row(req.row)
            self._finish(req, "abort")
            finished.append(req)
        for cohort in [c for c in self.cohorts + self.prefilling if any(r.id in aborted for r in c.requests)]:
            for req in cohort.requests:
                if req.id in aborted and not req.done:
                    cohort.finish_row(req.row)
                    self._finish(req, "abort")
                    finished.append(req)
            if all(r.done for r in cohort.requests):
                if cohort in self.prefilling:  # its rows are the last ones: nothing moves
                    self.prefilling.remove(cohort)
                    self._retire(cohort)
                else:
                    self._end_cohort(cohort, "abort", finished)

    def _admit(self, finished: list[Request]) -> None:
        rows = sum(c.b for c in self.cohorts + self.prefilling)
        used = sum(c.b * len(c.window.compute) for c in self.cohorts)
        budget = self.max_num_batched_tokens
        used = self._prefill(finished, used)
        while True:
            if self.prefilling:  # FIFO: nothing is admitted past a prompt still prefilling
                return
            with self._lock:
                if not self.waiting:
                    return
                group = self.waiting[0]
                cohort = group[0].cohort
                need = cohort.b * cohort.n  # its first forward computes everything
                chunked = self._chunkable(cohort)
                if chunked:  # it starts when a block per row fits (a prefill chunk or its first window)
                    need = cohort.b * cohort.block_size
                if rows + cohort.b > self.max_num_seqs or (self.cohorts and used + need > budget):
                    return
                if self.paged and not self._fits(cohort):
                    return  # FIFO: it waits for running requests to give blocks back
                self.waiting.popleft()
                group, cohort = self._merge_waiting(group, cohort, rows, used)
                # prompt blocks a request that may be admitted next in this step shares with it
                shared = self._prefix_siblings(cohort, self.max_num_seqs - rows - cohort.b)
            cohort.start_row = rows
            try:
                if self.prefix_cache is not None:
                    self._prefix_lookup(cohort)  # paged: a lone row with a hit is allocated here
                if self.paged:
                    for r in range(cohort.start_row, cohort.start_row + cohort.b):
                        if not self.blocks.allocated[r]:
                            self.blocks.allocate(r, cohort.n)
                if chunked and self._first_width(cohort) > self._prefill_room(used):
                    # its first forward would not fit this step: its prompt blocks are computed
                    # in chunks over the next steps, beside the running rows
                    for req in group:
                        req.status, req.admitted = "running", time.perf_counter()
                    self.prefilling.append(cohort)
                    rows += cohort.b
                    used = self._prefill(finished, used)
                    continue
                if shared > cohort.cached_prefix:  # computed and cached now: the sibling copies them
                    used += self._prefix_share(cohort, shared)
                if not cohort.prepare():
                    raise GenerationError("nothing to generate")
            except Exception as err:
                self._retire(cohort)
                for req in group:
                    self._finish(req, "error", err)
                    finished.append(req)
                continue
            now = time.perf_counter()
            for req in group:
                req.status, req.admitted = "running", now
            self.cohorts.append(cohort)
            if self._prefix_exact(cohort) or self._prefix_approx(cohort):
                self._prefix_fresh.append(cohort)
            rows += cohort.b
            used += cohort.b * len(cohort.window.compute)

    # ---------------------------------------------------------------- chunked prefill
    def _chunkable(self, cohort: Cohort) -> bool:
        """Whether the cohort's prompt may be prefilled in chunks across steps: a block-causal
        model (a prompt block's K/V depend only on it and the blocks before it, so whole blocks
        computed chunk by chunk, each reading the earlier ones from the pool, are those of one
        forward over them: what a prefix-cache hit relies on too), a first forward that writes
        the cache (not ``cache: "none"``, not ``vicinity``'s warm-up, no guidance) in full
        precision (no precision schedule), chunking not turned off. Bidirectional families
        (every prompt K/V depends on the whole sequence) keep one first forward."""
        p = cohort.params
        return (
            self.args.max_prefill_chunk_tokens != 0
            and self.model.spec.block_causal
            and cohort.block_size is not None
            and p.cache != "none"
            and not (p.cache == "vicinity" and p.vicinity_warmup > 0)
            and p.cfg_scale == 0
            and cohort.schedule is None
            and not cohort.started
        )

    @staticmethod
    def _first_width(cohort: Cohort) -> int:
        """Query slots of a block-causal cohort's first forward: its rows x the positions from
        the first one not in the pool to the end of its first decoded block."""
        return cohort.b * (min(cohort.s + cohort.block_size, cohort.n) - cohort.cached_prefix)

    def _prefill_room(self, used: int) -> int:
        """Query slots a step may still spend on a prefilling prompt: what the token budget
        leaves beside ``used``, at most ``max_prefill_chunk_tokens``."""
        room = self.max_num_batched_tokens - used
        cap = self.args.max_prefill_chunk_tokens
        return room if cap is None else min(room, cap)

    def _prefill(self, finished: list[Request], used: int) -> int:
        """One step of chunked prefill: each prefilling cohort computes its next whole prompt
        blocks within what the budget leaves (at least one block when nothing else runs, so it
        always progresses), and joins the running cohorts once its prompt blocks are all in the
        pool and its first window (one block) fits. Returns the budget used."""
        for cohort in list(self.prefilling):
            lb, b = cohort.block_size, cohort.b
            try:
                left = cohort.s - cohort.cached_prefix
                if left > 0:
                    cap = self.args.max_prefill_chunk_tokens
                    per_row = (self.max_num_batched_tokens - used) // b
                    if cap is not None:
                        per_row = min(per_row, max(cap // b, lb))
                    width = min(left, per_row // lb * lb)
                    if width == 0 and used == 0 and not self.cohorts:
                        width = min(left, lb)
                    if width > 0:
                        self._prefill_chunk(cohort, width)
                        used += b * width
                if cohort.cached_prefix < cohort.s:
                    continue
                first = self._first_width(cohort)
                if used and used + first > self.max_num_batched_tokens:
                    continue  # joins at a later step
                if not cohort.prepare():
                    raise GenerationError("nothing to generate")
                if self._prefix_exact(cohort):
                    # its prompt blocks are all in the pool (exact): cached now, not after its first
                    # forward, so the requests that waited behind it (FIFO) admit with a hit at once
                    self._prefix_insert(cohort, cohort.s)
            except Exception as err:
                self.prefilling.remove(cohort)
                self._retire(cohort)
                for req in cohort.requests:
                    if not req.done:
                        self._finish(req, "error", err)
                        finished.append(req)
                continue
            self.prefilling.remove(cohort)
            self.cohorts.append(cohort)  # its rows are right after the running ones
            used += cohort.b * len(cohort.window.compute)
        return used

    def _prefill_chunk(self, cohort: Cohort, width: int) -> None:
        """Compute the K/V of the prompt positions [cached_prefix, cached_prefix + width) (whole
        blocks) into the cohort's pool rows: a cached forward over them reading the blocks
        before them from the pool, as a prefix-cache hit's first forward does. Its output is not
        used: the confidence head at one position, so the LM head costs nothing. Eager where
        graphs replay: its shape depends on the prompt, which no batch-size bucket bounds."""
        lo = cohort.cached_prefix
        compute = torch.arange(lo, lo + width)
        rows = (cohort.start_row, cohort.b, cohort.n)
        select, bs = compute[-1:], cohort.block_size
        chunk = ForwardInputs(cohort.x, cohort.attn, compute=compute, cache=rows, select=select, block_size=bs)
        self.runner(self._with_blocks(dataclasses.replace(chunk, graph=False)))
        cohort.cached_prefix = lo + width  # the first forward computes from here (``Cohort._spans``)
        self.stats.prefill_chunks += 1
        self.stats.prefill_tokens += cohort.b * width
        self.stats.computed_tokens += cohort.b * width

    def _merge_waiting(self, group: list[Request], cohort: Cohort, rows: int, used: int):
        """Requests waiting together with the same settings decode as one cohort, left-padded
        like a static batch: one lockstep forward instead of padded per-row windows (at
        saturation the engine then runs at offline speed), and the same tokens (a static batch
        decodes each prompt as alone). Only where that holds without conditions: single-request
        groups of a bidirectional family, greedy and draw-free (a cohort's rows share one random
        generator), whose window does not depend on its rows. Called with the lock held. A merged
        cohort's rows stay taken until its last request ends."""
        p = group[0].params
        draws = p.temperature > 0 or p.strategy == "random"
        if len(group) != 1 or self.model.spec.block_causal or cohort.row_dependent or draws:
            return group, cohort
        params, merged = group[0].params, [group[0]]
        longest = len(group[0].prompt)
        while self.waiting and rows + len(merged) < self.max_num_seqs:
            nxt = self.waiting[0]
            if len(nxt) != 1 or nxt[0].params != params or nxt[0].priority != group[0].priority:
                break
            n = max(longest, len(nxt[0].prompt)) + params.gen_length
            if n > self.max_model_len or used + (len(merged) + 1) * n > self.max_num_batched_tokens:
                break
            if self.paged and not self._blocks_free((len(merged) + 1) * blocks_for(n, self.blocks.block_size)):
                break
            longest = max(longest, len(nxt[0].prompt))
            merged.append(self.waiting.popleft()[0])
        if len(merged) == 1:
            return group, cohort
        together = Cohort(self.model, [r.prompt for r in merged], params, self.args)
        self._wire(merged, together)
        return merged, together

    def _forward_and_decide(self) -> None:
        cohorts, st = self.cohorts, self.stats
        # a lone cohort, or any that needs its own forward (guidance, a precision schedule, another
        # block-causal mask): lockstep
        alone = any(c.window.guided or c.schedule is not None for c in cohorts) or not self.scratch_slot
        if len(cohorts) == 1 or alone or len({c.block_size for c in cohorts}) > 1:
            for c in cohorts:
                commit = c.decide(c.forward(c.window))
                st.steps += 1
                st.lockstep_steps += 1
                st.row_forwards += c.b
                st.computed_tokens += c.b * len(c.window.compute)
                self._count(c, commit)
            return
        b = sum(c.b for c in cohorts)
        uncached = not self.model.spec.block_causal and all(c.params.cache == "none" for c in cohorts)
        t0 = time.perf_counter()
        outs, width, real = forward_rows(cohorts, self._forward_runner, cached=not uncached)
        wall = time.perf_counter() - t0
        st.steps += 1
        st.per_row_steps += 1
        st.row_forwards += b
        st.computed_tokens += b * width
        st.padded_tokens += b * width - real
        index = self._on_forward(wall)
        for c, out in zip(cohorts, outs):
            c.step_s.append(wall)
            c.last_forward = index
            self._count(c, c.decide(out))

    # ---------------------------------------------------------------- device graphs (graph_buckets.py)
    @property
    def graphs(self) -> bool:
        """Whether lockstep forwards pad to batch-size buckets and replay device graphs."""
        return self.buckets.enabled

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        return self.buckets.sizes

    def _run_graphed(self, inputs: ForwardInputs):
        """A forward where the backend replays device graphs: at its bucket, or eager."""
        used = sum(c.b for c in self.cohorts) + sum(c.b for c in self.prefilling)
        return self.buckets.run(
            self.runner, inputs, used=used, pool_rows=self.pool_rows, positions=self._graph_positions, stats=self.stats
        )

    def graph_stats(self) -> dict:
        """Captures per bucket, replays, eager calls and graph memory (``GraphBuckets.report``)."""
        return self.buckets.report(self.model, self.stats)

    def capture_graphs(self, params: SamplingParams, prompt_len: int = 16) -> dict:
        """Warm-up (a server's start-up): each bucket's window shapes for ``params`` captured
        before the first request (``GraphBuckets.warm_up``). The engine's counters and prefix
        cache are reset after it; returns :meth:`graph_stats`. Nothing to do without graphs."""
        if not self.graphs:
            return self.graph_stats()
        self.buckets.warm_up(self, params, prompt_len)
        self.stats = EngineStats(
            graph_forwards=self.stats.graph_forwards, eager_forwards=self.stats.eager_forwards,
            padded_rows=self.stats.padded_rows, padded_positions=self.stats.padded_positions,
        )  # fmt: skip
        self.forward_s.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return self.graph_stats()

    def _count(self, cohort: Cohort, commit: torch.Tensor) -> None:
        self.stats.committed += int(commit.sum()) if commit.device.type == "cpu" else 0
        for req in cohort.requests:
            if not req.done:
                req.forwards += 1

    # ---------------------------------------------------------------- finishing
    def _check_final(self, cohort: Cohort, finished: list[Request]) -> None:
        """Publish each request's newly final tokens; finish it on EOS (with ``early_stop``), a
        stop string or max_tokens; end the cohort when none of its requests runs. What is final
        is the cohort's word (``Cohort.final_lengths``): with an editing rule the open block's
        tokens are provisional, so an EOS, a stop string or max_tokens only counts once final."""
        self.stats.edits += cohort.unreported[0]
        self.stats.post_steps += cohort.unreported[1]
        cohort.unreported = [0, 0]
        if cohort.step % cohort.sync_every:
            return  # read on the host where the cohort syncs: every sync_every steps
        if not any(_watched(req) for req in cohort.requests):
            return  # nothing to publish or stop on before the cohort ends (``_end_cohort`` reads it then)
        gen = cohort.generated().cpu()
        lengths = cohort.final_lengths(gen)
        for req in cohort.requests:
            if req.done:
                continue
            row = gen[req.row]
            if lengths[req.row] == len(req.final_ids) and not (req.return_canvas or req.stream_provisional):
                continue  # nothing new is final (the common step inside a block): no list, no event
            final = row[: lengths[req.row]].tolist()
            if cohort.editing:  # only editing rules count edits and post steps
                req.edits, req.post_steps = int(cohort.edits[req.row]), int(cohort.post_steps[req.row])
            if req.return_canvas:
                req.canvas, req.canvas_final = row.tolist(), len(final)
            revised = False
            if req.stream_provisional:
                rest = row[len(final) :]
                masked = (rest == self.mask_id).nonzero()
                tail = rest[: int(masked[0]) if len(masked) else len(rest)].tolist()
                revised, req.provisional_ids = tail != req.provisional_ids, tail
            grew = len(final) > len(req.final_ids)
            req.final_ids = final
            _take_logprobs(cohort, req)
            if grew or req.return_canvas or revised:
                notify(req, "update")
            if not grew:
                continue
            kept = before_eos(final, self.eos)
            eos = len(kept) < min(len(final), req.max_tokens)  # an EOS within the output
            reason = None
            if eos and (req.params.early_stop or len(final) >= req.max_tokens):
                reason = "stop"
            elif len(final) >= req.max_tokens:
                reason = "length"
            elif req.params.stop and first_stop(self.model.tokenizer.decode(kept), req.params.stop) >= 0:
                reason = "stop"
            if reason is not None:
                cohort.finish_row(req.row)
                self._finish(req, reason)
                finished.append(req)
        if all(r.done for r in cohort.requests):
            self._end_cohort(cohort, "length", finished)

    def _end_cohort(
        self, cohort: Cohort, reason: str, finished: list[Request], err: BaseException | None = None
    ) -> None:
        """Finish the cohort's running requests and free its rows (later cohorts move in)."""
        gen = cohort.generated().cpu()
        lengths = cohort.final_lengths(gen)
        for req in cohort.requests:
            if req.done:
                continue
            req.edits, req.post_steps = int(cohort.edits[req.row]), int(cohort.post_steps[req.row])
            req.provisional_ids = []
            if err is None:
                req.final_ids = gen[req.row, : lengths[req.row]].tolist()  # the final prefix
                _take_logprobs(cohort, req)
            kept = before_eos(req.final_ids, self.eos)
            stopped = reason == "length" and len(kept) < min(len(req.final_ids), req.max_tokens)
            self._finish(req, "stop" if stopped else reason, err)
            finished.append(req)
        if cohort not in self.cohorts:
            self._retire(cohort)
            return
        if err is None and self._prefix_exact(cohort) and cohort.nfe > 0:
            # every block before the last one decoded was recomputed from its final tokens at that
            # block's first forward (the block-causal window starts at the previous block): exact
            self._prefix_insert(cohort, cohort.block_start)
        self._retire(cohort)  # before any move: the rows that move in must find theirs free
        i = self.cohorts.index(cohort)
        self.cohorts.pop(i)
        last = self.cohorts[-1] if self.cohorts else None
        if last is not None and i < len(self.cohorts) and last.b == cohort.b:
            self.cohorts.pop()  # the last cohort of the same size takes the freed rows
            self.cohorts.insert(i, last)
        self._pack()

    def _pack(self) -> None:
        """Move cohorts whose rows changed (their K/V copied; rows are only ever moved down)."""
        row, moves = 0, []
        for c in self.cohorts + self.prefilling:
            if c.start_row != row:
                moves.append((row, c.start_row, c.b, c.n))
                c.start_row = row
            row += c.b
        if moves and self.paged:  # the blocks stay; only the table rows move
            for dst, src, b, _ in moves:
                self.blocks.move(dst, src, b)
        elif moves:
            self.runner.move_rows(moves)

    # ---------------------------------------------------------------- paged KV blocks (kv_blocks.py)
    def _blocks_free(self, need: int, keep: list[CachedBlock] = ()) -> bool:
        """Whether ``need`` blocks are free, evicting prefix-cache blocks nobody holds as needed
        (never those of ``keep``: the hit of the request being admitted)."""
        if self.blocks.free >= need:
            return True
        if self.prefix_cache is None:
            return False
        self.prefix_cache.acquire(keep)
        try:
            return self.prefix_cache.evict_for(need)
        finally:
            self.prefix_cache.release(keep)

    def _plan(self, cohort: Cohort) -> tuple[list[CachedBlock], int]:
        """A lone row's prefix-cache hit as the cache holds it now: the entries and the positions."""
        lb, size = self._prefix_block(cohort), self.blocks.block_size
        chain = self.prefix_cache.match(cohort.requests[0].prompt, lb, self._prefix_span(cohort) // size)
        return self.prefix_cache.cut(chain, lb)

    def _fits(self, cohort: Cohort) -> bool:
        """Paged admission: whether the cohort's blocks are free (or can be freed by evicting
        prefix-cache blocks nobody holds). A lone row with a prefix-cache hit needs fewer: its
        whole cached blocks are referenced (a block its hit ends inside is copied at admission, so
        it still counts). Where the whole hit cannot be kept, shorter ones are tried, down to
        none: a request that fits the pool is never kept waiting by its own hit. The hit chosen is
        the one ``_prefix_lookup`` takes (``_admission_plan``)."""
        size = self.blocks.block_size
        total = cohort.b * blocks_for(cohort.n, size)
        self._admission_plan = None
        if self.prefix_cache is None or not self._prefix_reuses(cohort):
            return self._blocks_free(total)
        chain, hit = self._plan(cohort)
        lb = self._prefix_block(cohort)
        for upto in range(hit, -1, -lb):
            keep, got = self.prefix_cache.cut(chain, lb, upto)
            if self._blocks_free(total - got // size, keep):
                self._admission_plan = (keep, got)
                return True
        return False

    def _run_paged(self, inputs: ForwardInputs):
        return self._inner_runner(self._with_blocks(inputs))

    def _with_blocks(self, inputs: ForwardInputs) -> ForwardInputs:
        """A cached forward on the paged pool: its rows' block table, after copy-on-write of every
        shared block (a prefix-cache hit, a block the cache took) it is about to write."""
        if not self.paged or inputs.cache is None:
            return inputs
        a, b, n = inputs.cache
        blocks = self.blocks
        if any(blocks.shared[a : a + b]):
            pairs = []
            for i, first in enumerate(_first_writes(inputs, b, self.model.spec.shift_logits)):
                shared = blocks.shared[a + i] - first // blocks.block_size
                if shared > 0:
                    self._blocks_free(shared)  # best effort: writable names the shortage if any is left
                pairs += blocks.writable(a + i, first)
            if pairs:
                self.runner.copy_blocks(pairs)
        table = blocks.table[a : a + b, : blocks_for(n, blocks.block_size)].clone()
        return dataclasses.replace(inputs, block_table=table)

    def cached_kv(self, node: CachedBlock) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A prefix-cache entry's K and V per layer ([positions, kv_heads, head_dim]): its pool
        block (paged) or its own copies. For tests and debugging."""
        if node.pool_block < 0:
            return node.k, node.v
        return [k[node.pool_block] for k in self.cache.k], [v[node.pool_block] for v in self.cache.v]

    def kv_usage(self) -> dict:
        """The paged pool's blocks: in all, used by rows or the prefix cache, free, copied on write."""
        if not self.paged:
            return {"paged": False}
        b = self.blocks
        return {
            "paged": True, "block_size": b.block_size, "blocks": b.usable, "used": b.used, "free": b.free,
            "copied_on_write": b.copied_blocks,
        }  # fmt: skip

    def _finish(self, req: Request, reason: str, err: BaseException | None = None) -> None:
        ids = before_eos(req.final_ids, self.eos)[: req.max_tokens]
        tok = self.model.tokenizer
        text = tok.decode(ids) if tok is not None else ""
        if req.params.stop and tok is not None:
            if reason == "length" and first_stop(text, req.params.stop) >= 0:
                reason = "stop"  # max_tokens and a stop string in the same step: the stop cut the answer
            keep, text = cut_at_stop(tok.decode, ids, text, req.params.stop)
            ids = ids[:keep]
        req.output_ids, req.text = ids, text
        req.finish_reason, req.error, req.status, req.finished = reason, err, "finished", time.perf_counter()
        if reason == "error":
            self.stats.failed += 1
        else:
            self.stats.finished += 1
        notify(req, "finish")

    # ---------------------------------------------------------------- in-process use
    def run_until_idle(self, max_steps: int | None = None) -> None:
        steps = 0
        while self.has_work():
            self.step()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                return


def _first_writes(inputs: ForwardInputs, rows: int, shift: bool) -> list[int]:
    """The first position each row of a cached forward writes: per-row windows' smallest slot
    (their padding queries write a slot past every real one), a lockstep window's first computed
    position, one earlier for a shifted-logits family (``shift``: Dream's forward also runs the
    position before each one it predicts, ``Model._inputs``); 0 when it computes everything, or
    where the window lives on a device (assume the worst)."""
    if inputs.rows is not None:
        return inputs.rows.token_index.min(dim=1).values.tolist()
    c = inputs.compute
    first = 0 if c is None or c.device.type != "cpu" or not len(c) else max(0, int(c.min()) - int(shift))
    return [first] * rows


def _take_logprobs(cohort: Cohort, req: Request) -> None:
    """``params.logprobs``: extend the request's log-probabilities to its final ids (final
    tokens never change, so neither do theirs)."""
    if cohort.logprobs is not None and len(req.final_ids) > len(req.logprobs):
        lps, top = cohort.logprobs_of(req.row, len(req.logprobs), len(req.final_ids))
        req.logprobs += lps
        req.top_logprobs += top


def _watched(req: Request) -> bool:
    """Whether a running request needs its final tokens read after every step: someone listens
    (streaming, a server), or it may end before its cohort does (early stop on EOS, a stop
    string, ``max_tokens`` below the generation length). A static batch with none of these
    (``early_stop=False``: benchmarks, validation) is read once, when its cohort ends."""
    p = req.params
    return not req.done and (
        req.listener is not None
        or p.early_stop
        or bool(p.stop)
        or req.max_tokens < p.gen_length
        or req.return_canvas
        or req.stream_provisional
    )


def batch_groups(cohort: Cohort, prompts: list[list[int]]) -> list[list[int]]:
    """How a static batch is split into cohorts (indices into ``prompts``): one cohort, unless a
    step's window would depend on which rows share it (one per prompt: each decodes as alone) or
    block-causal prompts differ in length (one per length: left padding would move their blocks
    off position 0)."""
    if cohort.row_dependent:
        return [[i] for i in range(len(prompts))]
    if cohort.model.spec.block_causal:
        by_length: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_length.setdefault(len(p), []).append(i)
        return list(by_length.values())
    return [list(range(len(prompts)))]


def run_batch(
    model: Model,
    prompts: list[list[int]],
    params: SamplingParams,
    stop: StopCheck | None = None,
    runner: LocalRunner | None = None,
    args: EngineArgs | None = None,
) -> BatchResult:
    """Decode a static batch through the engine (one cohort, lockstep): what ``LLM.generate``,
    the validation runner and the benchmarks run. The first error of a request is raised.
    ``runner``: what runs the forwards (default: this process; see ``model_runner``); ``args``:
    the engine settings that apply to one batch (``sync_every``, ``max_forward_tokens``,
    ``confidence_head``; its row and token bounds are the batch's own)."""
    params = params.for_model(model.spec)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GenerationError("every prompt must have at least one token")
    n = min(max(len(p) for p in prompts) + params.gen_length, model.spec.max_length)
    tp = getattr(model, "tensor_parallel", None)
    kv_heads = None if tp is None else tp.kv_heads(model.spec)
    pool = getattr(model, "cache_pool", None)  # idle caches kept for reuse count as room
    held = pool.idle_bytes() if pool is not None else 0
    check_batch_fits(model.spec, model.dtype, model.backend.device(), len(prompts), n + 1, kv_heads, held)
    block = params.block_length if model.spec.block_causal else None
    args = EngineArgs.build(
        args, max_num_seqs=len(prompts), max_num_batched_tokens=2**62, max_model_len=n, prefix_cache_bytes=0,
        prefix_cache="auto", kv_cache_memory=None, kv_cache_memory_fraction=None, kv_block_size=0,
    )  # fmt: skip  # one batch: nothing to share across requests; its pool is the batch's own (contiguous, no budget)
    cohort = Cohort(model, prompts, params, args)
    shared = len(batch_groups(cohort, prompts)) > 1  # cohorts that share forwards
    engine = Engine(model, args, block_length=block, scratch_slot=shared, runner=runner)
    try:
        reqs = engine.submit_batch(prompts, params, stop=stop, cohort=cohort)
        start = time.perf_counter()
        engine.run_until_idle()
        wall = time.perf_counter() - start
    finally:
        engine.release()
    for req in reqs:
        if req.error is not None:
            raise req.error
    cohorts = list(dict.fromkeys(r.cohort for r in reqs))  # one, or several (see submit_batch)
    precision: dict[str, int] = {}
    for c in cohorts:
        for name, count in c.precision_forwards.items():
            precision[name] = precision.get(name, 0) + count

    def rows(field) -> torch.Tensor:  # the prompts' rows in their order
        return torch.stack([field(r.cohort)[r.row].cpu() for r in reqs])

    return BatchResult(
        rows(Cohort.generated),
        rows(lambda c: c.committed),
        len(engine.forward_s),
        wall,
        engine.forward_s,
        rows(lambda c: c.commit_step),
        precision,
        reqs,
    )
