"""``dinfer-rt serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

FastAPI + uvicorn (the ``serve`` extra). The engine steps on its own thread; each request is a
listener whose events (tokens became final, finished) are posted to the asyncio loop. Streaming
is server-sent events in OpenAI's chunk format: a chunk carries only text that can no longer
change (tokens up to the first position still masked, held back while they could still be part of
a stop string or a split character), so the concatenated chunks equal the non-streamed text.

Back-pressure and faults: at most the KV pool's rows + ``max_queue`` requests at once, a batch
admitted whole or not at all (429 past it; a batch that could never fit: 400), a client that goes away
cancels its row, a step that raises fails only the requests of that step (500 naming the error),
SIGTERM stops admitting and finishes the running rows within ``drain_timeout`` seconds.

Process model: by default the engine is in this process. With ``--engine-process`` (always with
replicas or ranks) it runs in a worker process (``dinfer_rt.workers``) and this one is only the
HTTP front; a dead engine process fails its requests with a 503 naming it and the server exits 1.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the endpoints' annotations
# (``fastapi.Request``) at runtime, and ``fastapi`` is imported inside ``build_app`` only.
import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

import dinfer_rt
from dinfer_rt import asgi
from dinfer_rt.engine import Engine, EngineClosed, QueueFull, Request
from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import DinferError, GenerationError
from dinfer_rt.kv_pool import available_memory, kv_pool_plan, pool_summary
from dinfer_rt.model import Model
from dinfer_rt.openai_protocol import (
    SHOWN_CHARS,
    ApiError,
    Submission,
    choice_logprobs,
    chunk,
    new_id,
    parse,
    response,
    usage,
    usage_chunk,
)
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.stopping import before_eos, streamable
from dinfer_rt.strategies import EDITING
from dinfer_rt.workers import ReplicaError, freeze_startup_heap

MASK_MARK = "\u2591"  # how a still-masked position is drawn in a streamed canvas
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


def _need_serve_extra():
    try:
        import fastapi
        import prometheus_client
        import uvicorn
    except ImportError as e:
        raise DinferError(
            f"dinfer-rt serve needs the 'serve' extra ({e.name} is missing): pip install 'dinfer-rt[serve]' "
            "or bash scripts/setup.sh"
        ) from None
    return fastapi, uvicorn, prometheus_client


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "dinfer-rt"
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    max_queue: int = 256
    max_model_len: int | None = None
    drain_timeout: float = 30.0
    body_timeout: float = 30.0  # a request body that stops arriving for this long is a 408
    shutdown_after_requests: int | None = None  # exit once this many requests were answered (tests)
    shutdown_after_s: float | None = None  # exit after this many seconds (tests)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a bigger body is a 413 before it is parsed
    # engine settings beyond the row bounds above (EngineArgs fields: sync_every, max_forward_tokens, ...)
    engine_args: dict = dataclasses.field(default_factory=dict)

    def check(self) -> "ServeConfig":
        """Every value's type and range (the CLI flag named), before a model is loaded or any
        memory allocated; nothing is clamped. Returns ``self``."""
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_request_bytes"):
            _check_int(name, getattr(self, name), 1)
        _check_int("max_queue", self.max_queue, 0)
        _check_int("port", self.port, 0, 65535)
        for name in ("max_model_len", "shutdown_after_requests"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        _check_seconds("drain_timeout", self.drain_timeout, 0.0, MAX_DRAIN_S)
        _check_seconds("body_timeout", self.body_timeout, 0.0, MAX_DRAIN_S, low_open=True)
        EngineArgs.build(**self.engine_args)  # an unknown or out-of-range engine setting, named
        if self.shutdown_after_s is not None:
            _check_seconds("shutdown_after_s", self.shutdown_after_s, 0.0, MAX_LIFETIME_S, low_open=True)
        return self


MAX_DRAIN_S = 24 * 3600.0  # --drain-timeout: a day
MAX_LIFETIME_S = 365 * 24 * 3600.0  # --shutdown-after-s: a year (threading timers overflow far above)


def _flag(name: str) -> str:
    return f"{name} (--{name.replace('_', '-')})"


def _check_int(name: str, v, low: int, high: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise DinferError(f"serve: {_flag(name)} must be an integer, got {type(v).__name__} {v!r}")
    if v < low or (high is not None and v > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise DinferError(f"serve: {_flag(name)} must be {span}, got {v}")


def _check_seconds(name: str, v, low: float, high: float, low_open: bool = False) -> None:
    span = f"{'(' if low_open else '['}{low:.0f}, {high:.0f}] seconds"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise DinferError(f"serve: {_flag(name)} must be a number in {span}, got {type(v).__name__} {v!r}")
    if not math.isfinite(v) or v < low or (low_open and v == low) or v > high:
        raise DinferError(f"serve: {_flag(name)} must be a finite number in {span}, got {v!r}")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_pool(spec, dtype, device, config: ServeConfig, replicas: int = 1, graphs: bool = False) -> int:
    """The serving length (``--max-model-len``, else the model's ``max_sequence_length``) and the
    KV pool it implies, before the pool is allocated, sized by the engine's own arithmetic
    (``kv_pool.kv_pool_plan``: ``--max-num-seqs`` rows, or as many as ``--kv-cache-memory`` /
    ``--kv-cache-memory-fraction`` hold; ``graphs``: with the padding rows of the device-graph
    buckets). A length past the model's, a budget below one row, or a pool larger than the free
    memory is an error naming the sizes and the flags to change. Returns the length."""
    length = config.max_model_len if config.max_model_len is not None else spec.max_length
    if length > spec.max_length:
        raise DinferError(f"serve: --max-model-len {length} exceeds the model's max_sequence_length {spec.max_length}")
    if device is None:  # the length only
        return length
    free = available_memory(device)
    args = EngineArgs.build(**{"max_num_seqs": config.max_num_seqs, **config.engine_args})
    try:
        # a paged pool without a budget takes a share of the free memory: on the CPU the replicas share it
        share = free if free is None or device.type != "cpu" else free // replicas
        plan = kv_pool_plan(spec, dtype, args, length, graphs=graphs, free=share)
    except GenerationError as e:
        raise DinferError(f"serve: {e}") from None
    need = replicas * plan.nbytes
    if free is not None and need > free:
        each = (
            f"{plan.num_blocks} blocks x {plan.block_bytes} bytes + a block table of {plan.pool_rows} rows x "
            f"{plan.max_blocks} int32 entries" if plan.paged
            else f"{plan.pool_rows} rows x {plan.row_bytes} bytes"
        )  # fmt: skip
        shape = f"{f'{replicas} replicas x ' if replicas > 1 else ''}{each} ({plan.shape})"
        source = "--max-model-len" if config.max_model_len is not None else "the model's max_sequence_length"
        if args.kv_cache_memory is not None:
            rows = f"--kv-cache-memory ({args.kv_cache_memory} bytes)"
        elif args.kv_cache_memory_fraction is not None:
            rows = f"--kv-cache-memory-fraction ({args.kv_cache_memory_fraction} of the free memory, per replica)"
        else:
            rows = f"--max-num-seqs ({config.max_num_seqs})"
        raise DinferError(
            f"serve: the KV pool would need {_gib(need)} ({shape}) but {device.type} has {_gib(free)} free; "
            f"lower {rows} or --max-model-len ({length}, from {source})"
        )
    return length


def kv_pool_summary(engine: Engine, max_num_seqs: int) -> str:
    """The start-up line on the engine's KV pool (``kv_pool.pool_summary``)."""
    return pool_summary(engine.kv_plan, engine.max_model_len, max_num_seqs)


def check_before_load(config: ServeConfig, path=None, backend: str | None = None, dtype=None, replicas: int = 1):
    """``dinfer-rt serve``'s checks before any weight is read: the configuration's values, the
    serving length against the model's config.json, and on the CPU the KV pool(s) against the
    free memory (on a device that is checked once the model is loaded, before the pool is)."""
    from dinfer_rt.dtypes import resolve_dtype
    from dinfer_rt.loader import auto_dtype, default_model_path
    from dinfer_rt.model_spec import parse_spec
    from dinfer_rt.plugins import select_backend

    config.check()
    spec = parse_spec(path or default_model_path())
    chosen = select_backend(backend)
    device = chosen.device()
    if device.type != "cpu":  # reading a device's free memory would start its runtime in this process
        check_pool(spec, None, None, config, replicas)
        return
    dt = auto_dtype(spec, chosen) if dtype in (None, "auto") else resolve_dtype(dtype)
    check_pool(spec, dt, device, config, replicas)


def chars_per_token(tok) -> int | None:
    """The most characters one token's text has (a prompt of more than ``max_len`` times this
    is refused before it is tokenised); None without a tokenizer."""
    if tok is None:
        return None
    longest = 1
    for i in range(tok.vocab_size):
        longest = max(longest, len(tok.decode([i], skip_special_tokens=False)))
    return longest


RATE_WINDOW_S = 5.0
"""The window of ``/metrics``' per-second rates (``dinfer_forwards_per_second``, ...)."""

IDLE_WAIT_S = 1.0
"""How long an idle engine loop sleeps between checks when nothing wakes it: every event that
gives it work sets ``EngineLoop.wake``, so this only bounds a missed one (an idle server wakes
once a second, not 20 times: its CPU between requests is what a low load pays per request)."""


class EngineLoop:
    """Steps the engine while there is work and sleeps on an event otherwise.

    ``dinfer-rt serve`` runs it on the main thread and the HTTP server on another: torch's
    intra-op (OpenMP) pool is fastest on the thread that loaded the model, measured at 1.8x the
    step time on a fresh thread. ``build_app(..., engine_thread=True)`` starts it on its own
    thread instead (in-process use, e.g. a test client)."""

    def __init__(self, engine: Engine, metrics: "Metrics", relay: "EventRelay | None" = None) -> None:
        self.engine, self.metrics = engine, metrics
        self.relay = relay or EventRelay()  # the step's events, handed to the HTTP loop when it ends
        self.failure: str | None = None  # why the loop stopped on its own (every replica died)
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.watch: threading.Thread | None = None  # stop when this thread (the HTTP server) ends

    def start_thread(self) -> None:
        self.thread = threading.Thread(target=self.run, name="dinfer-engine", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return not self.stopped.is_set()

    def run(self) -> None:
        while not self.stopped.is_set():
            if self.watch is not None and not self.watch.is_alive():
                break
            replicas = getattr(self.engine, "alive", None)  # worker processes (replicas / TP ranks)
            if replicas is not None and not any(replicas):
                self.failure = "every engine replica has died: " + self.engine.death_reason()
                break
            if not self.engine.has_work() and replicas is None:  # a replica pool's step waits for events itself
                self.wake.wait(IDLE_WAIT_S)  # a submit, a signal, a drain or the HTTP thread's end sets it
                self.wake.clear()
                continue
            t0 = time.perf_counter()
            before, steps = self.engine.stats.committed, self.engine.stats.steps
            with self.relay.holding():  # the step's events leave together, after it
                finished = self.engine.step()
            if self.engine.stats.steps != steps:  # a forward ran (a replica pool's step may only relay events)
                self.metrics.on_step(time.perf_counter() - t0, self.engine, self.engine.stats.committed - before)
            for req in finished:
                self.metrics.on_finish(req)
        self.stopped.set()

    def drain(self, timeout: float) -> None:
        """Stop admitting, let the running rows finish (at most ``timeout`` s), stop the loop."""
        self.engine.close()
        end = time.perf_counter() + timeout
        while self.engine.num_running and time.perf_counter() < end and self.alive:
            time.sleep(0.02)
        self.stopped.set()
        self.wake.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        self.relay.close()
        shutdown = getattr(self.engine, "shutdown", None)  # a replica pool: stop its processes
        if shutdown is not None:
            shutdown()


class Metrics:
    """Prometheus metrics (text format at /metrics) and rates over the last few seconds."""

    def __init__(self) -> None:
        import prometheus_client as pc

        self.registry = r = pc.CollectorRegistry()
        self.waiting = pc.Gauge("dinfer_waiting_requests", "requests waiting for a slot", registry=r)
        self.running = pc.Gauge("dinfer_running_requests", "rows decoding", registry=r)
        self.forwards = pc.Counter("dinfer_forwards", "engine forwards (steps)", registry=r)
        self.tokens = pc.Counter("dinfer_committed_tokens", "tokens committed", registry=r)
        self.computed = pc.Counter("dinfer_computed_tokens", "query slots computed, padding included", registry=r)
        self.padded = pc.Counter("dinfer_padded_tokens", "query slots that were padding", registry=r)
        self.requests = pc.Counter("dinfer_requests", "finished requests", ["finish_reason"], registry=r)
        self.forwards_per_s = pc.Gauge("dinfer_forwards_per_second", "forwards/s, last 5 s", registry=r)
        self.tokens_per_s = pc.Gauge("dinfer_tokens_per_second", "committed tokens/s, last 5 s", registry=r)
        self.tokens_per_forward = pc.Gauge("dinfer_tokens_per_forward", "tokens per row-forward, last 5 s", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.latency = pc.Histogram("dinfer_request_latency_seconds", "arrival to finish", buckets=buckets, registry=r)
        self.ttft = pc.Histogram(
            "dinfer_time_to_first_token_seconds", "arrival to first final text", buckets=buckets, registry=r
        )
        self.step_time = pc.Histogram("dinfer_step_seconds", "one engine step", buckets=buckets, registry=r)
        self.edits = pc.Counter("dinfer_edits", "token-to-token rewrites (editing rules)", registry=r)
        self.post_steps = pc.Counter(
            "dinfer_post_steps", "row-forwards after a block's last mask (editing rules)", registry=r
        )
        self._edits_seen = (0, 0)  # engine.stats (edits, post_steps) at the last step
        self.prefill_chunks = pc.Counter(
            "dinfer_prefill_chunks", "prefill forwards over a prompt's blocks before it decodes (chunked prefill, "
            "and blocks shared with requests admitted together)", registry=r,
        )  # fmt: skip
        self.shared_prefills = pc.Counter(
            "dinfer_shared_prefills", "of which run at admission for requests admitted together (prefix cache)",
            registry=r,
        )  # fmt: skip
        self._prefill_seen = (0, 0)  # engine.stats (prefill_chunks, shared_prefills) at the last step
        self.prefix_queries = pc.Counter(
            "dinfer_prefix_cache_queries", "prefix cache lookups (admitted requests that may reuse blocks)", registry=r
        )
        self.prefix_hits = pc.Counter(
            "dinfer_prefix_cache_hits", "prompt tokens whose K/V came from the prefix cache", registry=r
        )
        self.prefix_bytes = pc.Gauge("dinfer_prefix_cache_bytes", "bytes the prefix cache holds", registry=r)
        self.prefix_budget = pc.Gauge(
            "dinfer_prefix_cache_budget_bytes", "the prefix cache's byte budget (0: off)", registry=r
        )
        self.prefix_approximate = pc.Gauge(
            "dinfer_prefix_cache_approximate",
            "1: the prefix cache is approximate (a bidirectional model under --prefix-cache approximate: a hit "
            "may change the answer); 0: exact or none",
            registry=r,
        )
        self._prefix_seen = (0, 0)  # prefix cache (queries, hit tokens) at the last read
        # the engine's KV pool (set once at start-up; 0 where the engine runs in other processes)
        self.kv_pool_rows = pc.Gauge(
            "dinfer_kv_pool_rows", "rows decoding at once: --max-num-seqs, or what --kv-cache-memory holds", registry=r
        )
        self.kv_pool_bytes = pc.Gauge("dinfer_kv_pool_bytes", "bytes of the engine's KV-cache pool", registry=r)
        # the paged pool's blocks (an in-process engine; 0 with contiguous rows or engines elsewhere)
        self.kv_blocks = pc.Gauge(
            "dinfer_kv_blocks", "blocks of the paged KV pool (the trash block not counted)", registry=r
        )
        self.kv_blocks_used = pc.Gauge(
            "dinfer_kv_blocks_used", "paged KV blocks held by running requests or the prefix cache", registry=r
        )
        self._prefix_lock = threading.Lock()  # read from the engine thread and from /metrics
        self.clock = time.perf_counter
        self._rates_lock = threading.Lock()  # the window: appended by the engine thread, read by /metrics
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, committed, rows) of each forward
        self._window_tokens = self._window_rows = 0  # sums of _recent's committed and rows
        self._first_step: float | None = None  # when the first forward started (a window shorter than RATE_WINDOW_S)
        self._seen = (0, 0)  # engine.stats (computed, padded) at the last step
        # device graphs per batch-size bucket (``Engine.graph_stats``; absent without graphs)
        self.graphs = {
            key: pc.Gauge(f"dinfer_graph_{key}", doc, registry=r)
            for key, doc in (
                ("captures", "device graphs captured (all executables)"),
                ("replays", "device graph replays"),
                ("eager_forwards", "engine forwards run eager on a graph backend (outside the buckets)"),
                ("padded_rows", "rows added to reach a batch-size bucket"),
                ("bytes", "device memory the captured graphs hold"),
            )
        }

    def read_graphs(self, engine: Engine) -> None:
        if getattr(engine, "graphs", False):
            st = engine.graph_stats()
            for key, gauge in self.graphs.items():
                gauge.set(st["graph_bytes" if key == "bytes" else key])

    def on_step(self, seconds: float, engine: Engine, committed: int) -> None:
        """One forward's numbers (engine thread, after every step: kept cheap, a counter that did
        not move is not touched)."""
        now = self.clock()
        self.forwards.inc()
        if committed:
            self.tokens.inc(committed)
        self.step_time.observe(seconds)
        st = engine.stats
        self._seen = self._advance(self._seen, (st.computed_tokens, st.padded_tokens), (self.computed, self.padded))
        self._edits_seen = self._advance(
            self._edits_seen, (getattr(st, "edits", 0), getattr(st, "post_steps", 0)), (self.edits, self.post_steps)
        )
        self._prefill_seen = self._advance(
            self._prefill_seen,
            (getattr(st, "prefill_chunks", 0), getattr(st, "shared_prefills", 0)),
            (self.prefill_chunks, self.shared_prefills),
        )
        self.read_prefix_cache(engine)
        self.read_graphs(engine)
        # the rates' window (RATE_WINDOW_S): running sums, a forward adds, an old one leaves; the
        # rates themselves are computed when /metrics is read (an idle server's fall to 0)
        running = engine.num_running
        with self._rates_lock:
            if self._first_step is None:
                self._first_step = now - seconds
            self._recent.append((now, committed, running))
            self._window_tokens += committed
            self._window_rows += running
            self._expire(now)
        self.waiting.set(engine.num_waiting)
        self.running.set(running)

    def _expire(self, now: float) -> None:
        """Drop the forwards older than the window (the rates' lock held)."""
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            _, c, n = self._recent.popleft()
            self._window_tokens -= c
            self._window_rows -= n

    def read_rates(self) -> None:
        """``dinfer_forwards_per_second``, ``dinfer_tokens_per_second`` and
        ``dinfer_tokens_per_forward`` over the last RATE_WINDOW_S seconds as of now (since the
        first forward, when that is more recent): an idle server's rates fall to 0."""
        now = self.clock()
        with self._rates_lock:
            self._expire(now)
            forwards, toks, rows = len(self._recent), self._window_tokens, self._window_rows
            start = now - RATE_WINDOW_S if self._first_step is None else max(now - RATE_WINDOW_S, self._first_step)
        span = max(now - start, 1e-6)
        self.forwards_per_s.set(forwards / span)
        self.tokens_per_s.set(toks / span)
        self.tokens_per_forward.set(toks / rows if rows else 0.0)

    @staticmethod
    def _advance(seen: tuple, now: tuple, counters: tuple) -> tuple:
        """Add to each counter what its engine total grew by since ``seen``; returns ``now``."""
        for old, new, counter in zip(seen, now, counters):
            if new > old:
                counter.inc(new - old)
        return now

    def on_finish(self, req: Request) -> None:
        self.requests.labels(req.finish_reason or "unknown").inc()
        if req.finished is not None:
            self.latency.observe(req.finished - req.arrival)

    def read_prefix_cache(self, engine: Engine) -> None:
        """The prefix cache's counters since the last read (an engine without one: zeros; a
        :class:`~dinfer_rt.workers.ReplicaPool`, i.e. replicas or ``--engine-process``: the sums of
        what its engine processes last relayed, ``workers.RelayedPrefixCache``)."""
        cache = getattr(engine, "prefix_cache", None)
        if cache is None:
            self.prefix_budget.set(0)
            self.prefix_approximate.set(0)
            return
        st = cache.stats
        with self._prefix_lock:
            queries, hits = st.queries, st.hit_tokens
            self.prefix_queries.inc(max(0, queries - self._prefix_seen[0]))
            self.prefix_hits.inc(max(0, hits - self._prefix_seen[1]))
            self._prefix_seen = (queries, hits)
        self.prefix_bytes.set(st.bytes)
        self.prefix_budget.set(cache.budget)
        self.prefix_approximate.set(int(getattr(cache, "approximate", False)))

    def text(self, engine: Engine) -> bytes:
        import prometheus_client as pc

        self.read_prefix_cache(engine)
        self.read_rates()
        blocks = getattr(engine, "blocks", None)  # read now: an abort frees blocks without a forward
        if blocks is not None:
            self.kv_blocks_used.set(blocks.used)
        self.waiting.set(engine.num_waiting)
        self.running.set(engine.num_running)
        return pc.generate_latest(self.registry)


class DrainReport:
    """The two lines a shutdown prints: when draining starts (what is running and waiting) and when
    the server stopped (how many of the requests in flight then, or sent after, were answered,
    and how many were cancelled: queued ones, or rows past ``--drain-timeout``)."""

    def __init__(self, engine, held: list[Request]) -> None:
        self.engine, self.held = engine, held
        self.since: list[Request] | None = None  # in flight when draining started, and submitted after
        self._lock = threading.Lock()

    def begin(self, why: str, drain_timeout: float) -> str | None:
        """The "draining" line, the first time (None after)."""
        with self._lock:
            if self.since is not None:
                return None
            self.since = [r for r in self.held if not r.done]
        running, waiting = self.engine.num_running, self.engine.num_waiting
        return (
            f"dinfer-rt: {why}: draining: {running} running, {waiting} waiting; admitting no new requests, running "
            f"rows finish within {drain_timeout:g} s (--drain-timeout)"
        )

    def submitted(self, reqs: list[Request]) -> None:
        with self._lock:
            if self.since is not None:
                self.since.extend(reqs)

    def end(self) -> str:
        """The "stopped" line."""
        reqs = self.since or []
        answered = sum(1 for r in reqs if r.done and r.finish_reason not in ("abort", "error"))
        return (
            f"dinfer-rt stopped: {answered} of the {len(reqs)} requests in flight while draining were answered, "
            f"{len(reqs) - answered} cancelled or failed"
        )


def _deliver(items: list) -> None:  # on the asyncio loop
    for queue, item in items:
        queue.put_nowait(item)


class EventRelay:
    """Hands engine events to the asyncio loops that wait for them.

    Waking a loop from another thread (``call_soon_threadsafe``) writes to its self-pipe, which
    releases the GIL: the HTTP thread it wakes then holds the engine thread up for its whole burst
    of SSE work (0.3-0.4 ms a wake-up at low load, measured). So the events the engine thread posts
    inside :meth:`holding` (one step) wait for the step's end and leave together: one wake-up per
    loop and step, not one per event. Events posted from any other thread (a drain closing the
    engine) leave at once. Each queue gets its events in the order they were posted."""

    def __init__(self) -> None:
        self._pending: deque[tuple[asyncio.AbstractEventLoop, asyncio.Queue, tuple]] = deque()
        self._send = threading.Lock()  # one flush at a time: batches reach a loop in posting order
        self._holder: int | None = None  # the thread whose events wait for the end of its step
        self.batches = 0  # call_soon_threadsafe calls made (tests)

    @contextlib.contextmanager
    def holding(self):
        self._holder = threading.get_ident()
        try:
            yield
        finally:
            self._holder = None
            self.flush()

    def post(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item: tuple) -> None:
        self._pending.append((loop, queue, item))  # atomic: no lock for the engine thread to wait on
        if self._holder != threading.get_ident():
            self.flush()

    def flush(self) -> None:
        """Hand every pending event to its loop now, one call per loop."""
        with self._send:
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            while self._pending:
                loop, queue, item = self._pending.popleft()
                by_loop.setdefault(loop, []).append((queue, item))
            for loop, items in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_deliver, items)
                except RuntimeError:  # that loop is closed (its server is gone): nobody waits for these
                    continue
                self.batches += 1

    close = flush  # what is pending leaves; later events leave at once (no holder after the loop ends)


class _Stream:
    """Bridges engine requests to the asyncio side: engine events land in an asyncio queue (through
    ``relay``), each tagged with its request's ``index`` (its choice; the requests of a completions
    batch share one queue)."""

    def __init__(
        self,
        relay: EventRelay,
        loop: asyncio.AbstractEventLoop,
        updates: bool,
        index: int = 0,
        queue: asyncio.Queue | None = None,
    ) -> None:
        self.relay, self.loop, self.updates, self.index = relay, loop, updates, index
        self.queue = asyncio.Queue() if queue is None else queue

    def __call__(self, req: Request, event: str) -> None:  # engine thread
        if event == "update" and not self.updates:  # a non-streamed answer waits for the finish only
            return
        canvas = None if req.canvas is None else list(req.canvas)
        snapshot = (self.index, event, list(req.final_ids), canvas, list(req.provisional_ids))
        self.relay.post(self.loop, self.queue, snapshot)


def engine_kwargs(config: ServeConfig, defaults: SamplingParams) -> dict:
    """The :class:`Engine` keywords a server's configuration gives (also each replica's)."""
    return {
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_queue": config.max_queue,
        "max_model_len": config.max_model_len,
        "block_length": defaults.block_length,
        **config.engine_args,
    }


def build_app(model, defaults: SamplingParams, config: ServeConfig, engine_thread: bool = True):
    """The FastAPI application over one model (a :class:`Model`: one engine in this process) or a
    :class:`~dinfer_rt.workers.ReplicaPool` (data-parallel replicas in worker processes, which
    offers the engine's interface and the model's tokenizer / eos / mask ids). ``app.state.loop``
    is its :class:`EngineLoop`, started on its own thread with the app's lifespan when
    ``engine_thread`` (else the caller runs ``app.state.loop.run()``)."""
    fastapi, _, _ = _need_serve_extra()
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    config.check()
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:  # a template that does not parse would fail every chat request as a 400
        try:
            tokenizer.compiled_chat_template()
        except DinferError as e:
            raise DinferError(f"serve: {e} (fix it, or pick another with --chat-template-name)") from None
    if isinstance(model, Model):  # the pool is checked before it is allocated (replicas: in cmd_serve)
        graphs = model.backend.replays_graphs() and config.engine_args.get("graphs") is not False
        check_pool(model.spec, model.dtype, model.backend.device(), config, graphs=graphs)
    # in this process the front bounds the requests in flight (``admit``), as it does for engine
    # processes: the engine's own bound would count only its waiting ones, and prompt by prompt
    engine = (
        Engine(model, **{**engine_kwargs(config, defaults), "max_queue": None}) if isinstance(model, Model) else model
    )
    if getattr(engine, "paged", False):  # a pool too small for any default request: say so now
        try:
            engine.check_request([0], defaults.for_model(model.spec), None)
        except GenerationError as e:
            raise DinferError(f"serve: every request would be refused with these defaults: {e}") from None
    if getattr(engine, "graphs", False):  # device graphs: each batch-size bucket captured before serving
        engine.capture_graphs(defaults)
    metrics = Metrics()
    metrics.read_graphs(engine)  # the warm-up's captures, before the first step
    if isinstance(engine, Engine):
        metrics.kv_pool_rows.set(engine.max_num_seqs)
        if engine.blocks is not None:
            metrics.kv_blocks.set(engine.blocks.usable)
        metrics.kv_pool_bytes.set(engine.kv_pool_bytes)
    elif hasattr(engine, "kv_pool_rows"):  # replicas / --engine-process: what their engines reported
        metrics.kv_pool_rows.set(engine.kv_pool_rows)
        metrics.kv_pool_bytes.set(engine.kv_pool_bytes)
        if engine.blocks is not None:
            metrics.kv_blocks.set(engine.blocks.usable)
    relay = EventRelay()
    loop_holder = EngineLoop(engine, metrics, relay)
    tok = model.tokenizer
    per_token = chars_per_token(tok)
    mask_id = getattr(model, "mask_id", None)  # refused in prompts unless a request sets allow_mask_in_prompt
    eos = set(model.eos_ids)
    stop_ids = frozenset(eos)  # a request's stop_token_ids of these asks for nothing new
    answered = {"n": 0}
    state = {"server": None, "shutdown": None}  # serve(): its uvicorn server, and how a shutdown starts
    started = int(time.time())  # /v1/models' ``created``
    held: list[Request] = []  # the requests submitted here and maybe in flight (pruned at each submit)
    # of those, the ones this front cancelled (their client went away): their rows free at the engine's
    # next step, their room in the server now, so a client that reconnects at once is not a 429
    cancelled: set[str] = set()
    app_drain = DrainReport(engine, held)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if engine_thread:
            loop_holder.start_thread()
        yield
        await asyncio.get_running_loop().run_in_executor(None, loop_holder.drain, config.drain_timeout)

    def error(e: ApiError, headers: dict | None = None) -> Response:
        # ASCII JSON: a client's lone surrogate echoed in a message stays encodable
        return Response(json.dumps(e.body()), status_code=e.status, media_type="application/json", headers=headers)

    def count_answered() -> None:
        answered["n"] += 1
        limit = config.shutdown_after_requests
        if limit is not None and answered["n"] >= limit and state["server"] is not None:
            if state["shutdown"] is not None:
                state["shutdown"](f"--shutdown-after-requests {limit} reached")
            else:
                state["server"].should_exit = True

    def capacity() -> tuple[int, str] | None:
        """The most requests the server holds at once, running or waiting, and what makes it: the
        KV pool's rows + ``max_queue`` (per engine process: the live replicas' sum; None: none is
        alive)."""
        if isinstance(engine, Engine):
            rows = engine.max_num_seqs
            return rows + config.max_queue, f"{rows} KV pool rows + max_queue {config.max_queue}"
        rows = sorted({r for r, alive in zip(engine.kv_rows, engine.alive) if alive})
        live = sum(engine.alive)
        if not live:  # every engine process died: requests are answered 503 (``submit``)
            return None
        each = " / ".join(str(r) for r in rows)
        why = f"{each} KV pool rows + max_queue {config.max_queue}"
        return engine.capacity, why if live == 1 else f"{live} replicas x ({why})"

    def admit(sub: Submission, options: dict, listeners: list[_Stream]) -> list[Request]:
        """The in-process engine's admission, all prompts or none: each checked, then queued only if
        the requests in flight leave room for all of them (``capacity``)."""
        if engine.closed:
            raise EngineClosed("the engine is shutting down and admits no new requests")
        for ids in sub.prompts:  # every prompt before any is queued
            engine.check_request(ids, sub.params, sub.max_tokens)
        limit, why = capacity()
        flight = sum(1 for r in held if r.id not in cancelled)
        if flight + len(sub.prompts) > limit:
            batch = f" for a batch of {len(sub.prompts)}" if len(sub.prompts) > 1 else ""
            raise QueueFull(f"the server is full{batch}: {flight} requests in flight, at most {limit} ({why})")
        reqs: list[Request] = []
        try:
            for ids, listener in zip(sub.prompts, listeners):
                reqs.append(engine.submit(ids, sub.params, max_tokens=sub.max_tokens, listener=listener, **options))
        except DinferError:  # (the engine closed meanwhile) the batch is answered whole or not at all
            for req in reqs:
                engine.abort(req.id)
            raise
        return reqs

    def submit(sub: Submission, listeners: list[_Stream]) -> list[Request]:
        """One engine request per prompt, every one or none (a batch is answered whole or not at
        all): past the requests the server holds (``capacity``) a 429, and nothing is queued."""
        options: dict = {"return_canvas": sub.return_canvas}
        if sub.stream_provisional:  # only when asked, as the priority
            options["stream_provisional"] = True
        if sub.priority:
            options["priority"] = sub.priority
        held[:] = [r for r in held if not r.done]
        cancelled.intersection_update(r.id for r in held)
        try:
            if isinstance(engine, Engine):
                reqs = admit(sub, options, listeners)
            else:  # engine processes: the pool routes the batch atomically
                reqs = engine.submit_many(
                    sub.prompts, sub.params, max_tokens=sub.max_tokens, listeners=listeners, **options
                )
        except DinferError as e:
            loop_holder.wake.set()
            if isinstance(e, QueueFull):
                raise ApiError(429, f"{e}; retry later", None, "rate_limit_error") from None
            if isinstance(e, EngineClosed):
                deaths = getattr(engine, "deaths", None)  # engine processes that died (replicas, --engine-process)
                why = f"the engine is unavailable: {'; '.join(deaths)}" if deaths else str(e)
                raise ApiError(503, why, None, "server_error") from None
            raise ApiError(400, str(e), _param_of(str(e))) from None  # the engine's admission checks
        held.extend(reqs)
        app_drain.submitted(reqs)
        loop_holder.wake.set()
        return reqs

    def cancel(reqs: list[Request]) -> None:
        """Give up on the requests not yet done (their client went away, or their answer failed)."""
        for req in reqs:
            if not req.done:
                cancelled.add(req.id)
                engine.abort(req.id)
        loop_holder.wake.set()

    def failure(req: Request) -> ApiError:
        if req.finish_reason == "abort":
            return ApiError(
                503, f"request {req.id} was cancelled: {req.error or 'client disconnected'}", None, "server_error"
            )
        if isinstance(req.error, ReplicaError):  # the engine process itself is gone: the server cannot serve it
            return ApiError(503, f"the engine is unavailable: {req.error}", None, "server_error")
        return ApiError(500, f"the engine step failed: {type(req.error).__name__}: {req.error}", None, "server_error")

    async def body_of(receive) -> tuple[object, int]:
        """The body, read up to ``max_request_bytes`` (past it: 413, the rest read and dropped so
        the client gets the answer) and parsed as JSON (on a worker thread past
        ``INLINE_BODY_BYTES``); returns it and its size in bytes."""
        limit = config.max_request_bytes
        try:
            raw, size = await asgi.read_body(receive, limit, _DRAIN_BYTES, config.body_timeout)
        except asgi.BodyStalled as e:
            raise ApiError(
                408, f"the request body stopped arriving: {e.size} bytes came, then nothing for "
                f"{config.body_timeout:g} s (--body-timeout; does its Content-Length promise more than was sent?)",
                None,
            ) from None  # fmt: skip
        if size > limit:
            raise ApiError(
                413, f"the request body is {size}{'+' if size > limit + _DRAIN_BYTES else ''} bytes; this server "
                f"accepts at most {limit} (--max-request-bytes)", None,
            )  # fmt: skip
        if size <= INLINE_BODY_BYTES:
            return _json_body(raw), size
        return await asyncio.to_thread(_json_body, raw), size

    async def send_error(send, e: ApiError) -> None:
        close = [(b"connection", b"close")] if e.status == 408 else []  # the rest of a stalled body never comes
        await asgi.send_body(send, e.status, json.dumps(e.body()).encode(), headers=close)  # ASCII JSON, as error()

    async def complete(_scope, receive, send, chat: bool) -> None:
        """POST /v1/completions and /v1/chat/completions (a plain ASGI handler, ``asgi.py``)."""
        try:
            body, size = await body_of(receive)
            validate = functools.partial(
                parse, body, chat=chat, tokenizer=tok, defaults=defaults, model_name=config.model_name,
                max_len=engine.max_model_len, chars_per_token=per_token, mask_id=mask_id,
                kv_bytes_per_position=getattr(engine, "kv_bytes_per_position", None), batch_limit=capacity(),
                stop_ids=stop_ids,
            )  # fmt: skip
            # tokenising a long prompt must not hold up the event loop: a worker thread does it; a
            # small body (a short prompt) is validated here, where it costs less than the hop there
            sub = validate() if size <= INLINE_BODY_BYTES else await asyncio.to_thread(validate)
            queue: asyncio.Queue = asyncio.Queue()
            here = asyncio.get_running_loop()
            reqs = submit(sub, [_Stream(relay, here, sub.stream, i, queue) for i in range(len(sub.prompts))])
        except ApiError as e:
            count_answered()
            return await send_error(send, e)
        except asgi.ClientGone:  # nobody to answer
            count_answered()
            return
        # a client that goes away cancels its rows: the watcher wakes the wait below with GONE
        watcher = asgi.watch_disconnect(receive, functools.partial(queue.put_nowait, GONE))
        try:
            if sub.stream:
                return await _stream(send, reqs, queue, sub, new_id(chat), chat)
            await _answer(send, reqs, queue, sub, new_id(chat), chat)
        finally:
            watcher.cancel()

    async def _answer(send, reqs: list[Request], queue: asyncio.Queue, sub: Submission, rid: str, chat: bool):
        """A whole (non-streamed) answer, once every choice finished."""
        try:
            running = len(reqs)
            while running:
                event = await queue.get()
                if event is GONE:
                    return cancel(reqs)
                running -= event[1] == "finish"
        finally:
            count_answered()
        for req in reqs:
            _first_text(metrics, req)
        failed = next((req for req in reqs if req.finish_reason in ("error", "abort")), None)
        if failed is not None:
            return await send_error(send, failure(failed))
        echo = sub.echo or [""] * len(reqs)
        answers = [(shown + req.text, _openai_reason(req)) for shown, req in zip(echo, reqs)]
        lps = None
        if sub.params.logprobs is not None:  # each choice's answer tokens
            lps = [choice_logprobs(tok, chat, r.output_ids, r.logprobs, r.top_logprobs) for r in reqs]
        answer = response(rid, config.model_name, chat, answers, _usage(reqs, sub), lps)
        await asgi.send_body(send, 200, _json_bytes(answer))

    async def _stream(send, reqs: list[Request], queue: asyncio.Queue, sub: Submission, rid: str, chat: bool):
        """The SSE stream of one request: a chunk per choice whenever its final text grew."""
        name, first = config.model_name, True
        sent, done = [0] * len(reqs), [False] * len(reqs)
        shown_tail = [""] * len(reqs)  # stream_provisional: the provisional text each choice last sent
        asked = sub.params.logprobs is not None
        sent_tokens = [0] * len(reqs)  # logprobs: the answer tokens whose log-probabilities were sent

        def use(i: int, tokens: int) -> dict | None:  # continuous_usage_stats: usage on every chunk
            return usage(len(sub.prompts[i]), tokens) if sub.continuous_usage else None

        # the chunks ready at once (the opening ones; those of one batch of events; the last ones with
        # the usage and [DONE]) leave as one body message: one write and one client wake-up, not one each
        out: list[str] = []
        try:
            await send({"type": "http.response.start", "status": 200, "headers": asgi.SSE_HEADERS})
            if chat:
                out.append(_sse(chunk(rid, name, chat, None, None, use=use(0, 0))))
            for i, shown in enumerate(sub.echo or []):  # echo: the prompt comes first
                out.append(_sse(chunk(rid, name, chat, shown, None, index=i, use=use(i, 0))))
            failed = False
            while not all(done) and not failed:
                if out:
                    await send({"type": "http.response.body", "body": "".join(out).encode(), "more_body": True})
                    out = []
                events = [await queue.get()]
                while not queue.empty():
                    events.append(queue.get_nowait())
                if GONE in events:  # the client went away: its rows are freed below
                    return
                if not sub.return_canvas:  # only the newest final text of each choice matters (a finish is its last)
                    events = sorted({e[0]: e for e in events}.values(), key=lambda e: e[0])
                for i, event, final, canvas, provisional in events:
                    req = reqs[i]
                    if done[i]:
                        continue
                    finishing = event == "finish"
                    if finishing:
                        if req.finish_reason in ("error", "abort"):
                            out.append(_sse(failure(req).body()))
                            failed = True
                            break
                        text, tokens, kept = req.text, len(req.output_ids), req.output_ids
                    else:
                        kept = before_eos(final, eos)[: sub.max_tokens]
                        text = streamable(tok.decode(kept), sub.params.stop, final=False)
                        tokens = _tokens_within(tok, kept, len(text)) if sub.continuous_usage or asked else 0
                    delta, sent[i] = text[sent[i] :], max(sent[i], len(text))
                    extra = {"canvas": _canvas(tok, canvas, model.mask_id)} if sub.return_canvas and canvas else {}
                    if sub.stream_provisional:  # the text after the final text, which may still be revised
                        tail = "" if finishing else _provisional(tok, final, provisional, eos, sub.max_tokens, text)
                        if tail != shown_tail[i]:
                            extra["provisional"] = shown_tail[i] = tail
                    if delta and first:
                        first = False
                        metrics.ttft.observe(time.perf_counter() - req.arrival)
                    if delta or extra or finishing:
                        reason = _openai_reason(req) if finishing else None
                        lps = None
                        if asked:  # the tokens whose text this chunk completes (each token once)
                            lo, sent_tokens[i] = min(sent_tokens[i], tokens), max(sent_tokens[i], tokens)
                            lps = choice_logprobs(tok, chat, kept, req.logprobs, req.top_logprobs, lo, tokens)
                        one = chunk(rid, name, chat, delta, reason, index=i, use=use(i, tokens), logprobs=lps, **extra)
                        out.append(_sse(one))
                    done[i] = finishing
            if not failed and sub.include_usage:
                out.append(_sse(usage_chunk(rid, name, chat, _usage(reqs, sub))))
            out.append("data: [DONE]\n\n")
            await send({"type": "http.response.body", "body": "".join(out).encode()})
        finally:  # a client that went away, or a failure: free the rows still running
            cancel(reqs)
            count_answered()

    def error_body(status: int, message: str) -> bytes:  # the fast paths' 405 / 500 (asgi.py)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return json.dumps(ApiError(status, message[:SHOWN_CHARS], None, kind).body()).encode()

    fast = {
        "/v1/completions": functools.partial(complete, chat=False),
        "/v1/chat/completions": functools.partial(complete, chat=True),
    }  # the generation endpoints: plain ASGI, ahead of FastAPI's stack (asgi.py says why)
    app = asgi.fast_path_app(fastapi.FastAPI, fast, error_body, title="dinfer-rt", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.serve, app.state.loop = engine, metrics, state, loop_holder
    app.state.drain = app_drain

    def card() -> dict:
        return {
            "id": config.model_name, "object": "model", "created": started, "owned_by": "dinfer-rt",
            "max_model_len": engine.max_model_len,
        }  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")  # an id may hold slashes (org/name)
    async def model_card(model_id: str):
        if model_id != config.model_name:
            shown = model_id if len(model_id) <= SHOWN_CHARS else model_id[:SHOWN_CHARS] + "..."
            message = f"model {shown!r} does not exist; this server serves '{config.model_name}'"
            return error(ApiError(404, message, "model", "not_found"))
        return card()

    @app.get("/version")
    async def version():
        return {"version": dinfer_rt.__version__}

    @app.get("/health")
    async def health():
        if loop_holder.failure is not None:  # the engine (every replica) died: the server is exiting
            body = ApiError(503, f"the engine is unavailable: {loop_holder.failure}", None, "server_error").body()
            return JSONResponse({"status": "failed", **body}, status_code=503)
        if not loop_holder.alive or engine.closed:
            body = ApiError(503, "the server is draining (shutting down)", None, "server_error").body()
            return JSONResponse({"status": "draining", **body}, status_code=503)
        body = {"status": "ok", "running": engine.num_running, "waiting": engine.num_waiting}
        if not isinstance(model, Model):  # replicas: requests routed to each, which are alive, their pids
            rows = zip(engine.served, engine.alive, engine.pids, engine.rank_pids)
            body["replicas"] = [{"served": n, "alive": a, "pid": pid, "ranks": r} for n, a, pid, r in rows]
        return body

    # vLLM's (and SageMaker's) liveness probe: the same answer as /health (a route per method, so
    # that each operation of the OpenAPI schema has its own id)
    app.add_api_route("/ping", health, methods=["GET"], name="ping", operation_id="ping_get")
    app.add_api_route("/ping", health, methods=["POST"], name="ping_post", operation_id="ping_post")

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.text(engine), media_type="text/plain; version=0.0.4")

    async def http_error(request, exc):  # unknown routes (404), methods (405): OpenAI's error body too
        where = f"{request.method} {request.url.path}"[:SHOWN_CHARS]
        status = exc.status_code
        message = {404: f"no such endpoint: {where}", 405: f"method not allowed: {where}"}.get(status, str(exc.detail))
        kind = "not_found" if status == 404 else "invalid_request_error" if status < 500 else "server_error"
        return error(ApiError(status, message, None, kind), headers=getattr(exc, "headers", None))

    async def internal_error(_request, exc):  # a bug: still OpenAI's body, naming the error
        return error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", None, "server_error"))

    from starlette.exceptions import HTTPException

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    return app


_DRAIN_BYTES = 64 * 1024 * 1024  # of a too-large body, read and dropped at most this much more
# A body up to this size is parsed and validated (tokenised, templated) on the event loop: two
# hops to a worker thread and back cost more than that work (0.1 ms for a 100-byte chat request, 0.5 ms
# for 1 KiB with the embedded tokenizer, measured on a busy 2-core machine).
INLINE_BODY_BYTES = 1024


def _json_body(raw: bytes) -> object:
    """Parse a request body; whatever the JSON parser refuses (bad syntax, bad UTF-8, integers
    past Python's digit limit, nesting past the recursion limit) is a 400."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise ApiError(400, f"the request body is not valid JSON: {why}") from None


def _param_of(message: str) -> str | None:
    """The field an engine admission message starts with (``block_length 16: ...``)."""
    word = message.removeprefix("SamplingParams: ").split(" ", 1)[0].rstrip(":")
    return word if word.isidentifier() else None


def _first_text(metrics: Metrics, req: Request) -> None:
    if req.finished is not None and req.text:
        metrics.ttft.observe(req.finished - req.arrival)  # non-streamed: the whole answer is the first text


def _openai_reason(req: Request) -> str:
    return "stop" if req.finish_reason == "stop" else "length"


def _usage(reqs: list[Request], sub: Submission) -> dict:
    """The request's usage: every prompt's tokens and every answer's (a batch sums its choices);
    with an editing rule also its token-to-token ``edits`` and ``post_steps`` (forwards after a
    block's last mask), dinfer-rt's extension."""
    use = usage(sum(len(p) for p in sub.prompts), sum(len(req.output_ids) for req in reqs))
    # as OpenAI reports it: prompt tokens whose K/V were reused (the block prefix cache)
    use["prompt_tokens_details"] = {"cached_tokens": sum(getattr(req, "cached_tokens", 0) for req in reqs)}
    if sub.params.strategy in EDITING:
        use["edits"] = sum(req.edits for req in reqs)
        use["post_steps"] = sum(req.post_steps for req in reqs)
    return use


def _provisional(tok, final: list[int], provisional: list[int], eos, max_tokens: int, sent_text: str) -> str:
    """``stream_provisional``: the text of final + provisional tokens (cut at EOS and max_tokens)
    past the final text ``sent_text`` already streamed; it may be revised by a later chunk."""
    ids = before_eos(final + provisional, eos)[:max_tokens]
    text = tok.decode(ids)
    return text[len(sent_text) :] if text.startswith(sent_text) else text[len(tok.decode(before_eos(final, eos))) :]


def _tokens_within(tok, ids: list[int], chars: int) -> int:
    """How many leading ``ids`` decode to at most ``chars`` characters: the tokens whose text a
    stream has sent (a tail that could still become a stop string is held back, and uncounted)."""
    k = len(ids)
    while k and len(tok.decode(ids[:k])) > chars:
        k -= 1
    return k


def _canvas(tok, ids: list[int], mask_id: int) -> str:
    return "".join(MASK_MARK if i == mask_id else tok.decode([i]) for i in ids)


GONE = (-1, "gone", None, None, None)  # in a request's event queue: its client went away


def _json_bytes(obj: dict) -> bytes:
    """A response body as FastAPI's JSONResponse encodes it (UTF-8, compact, no NaN)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def serve(model, defaults: SamplingParams, config: ServeConfig) -> int:
    """Run the server until SIGTERM / Ctrl-C (or the test bounds); returns the exit status.

    The engine steps on this (the main) thread; uvicorn serves HTTP on another. SIGTERM / SIGINT
    start uvicorn's graceful shutdown: no new connections, the lifespan drains the engine, exit 0
    (a second signal forces the exit)."""
    _, uvicorn, _ = _need_serve_extra()
    app = build_app(model, defaults, config, engine_thread=False)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=config.host, port=config.port, log_level="warning",
            timeout_graceful_shutdown=max(1, int(config.drain_timeout)),
        )
    )  # fmt: skip
    app.state.serve["server"] = server
    loop: EngineLoop = app.state.loop
    report: DrainReport = app.state.drain

    def run_http() -> None:
        try:
            server.run()
        finally:  # the engine loop, sleeping while idle, sees the HTTP server's end at once
            loop.wake.set()

    http = threading.Thread(target=run_http, name="dinfer-http", daemon=True)
    loop.watch = http

    def shut_down(why: str) -> None:
        """Start uvicorn's graceful shutdown (the lifespan then drains the engine), saying so once."""
        line = report.begin(why, config.drain_timeout)
        server.should_exit = True
        loop.wake.set()
        if line is not None:
            try:
                print(line, flush=True)
            except RuntimeError:  # (a signal that arrived inside another print of this thread)
                pass

    app.state.serve["shutdown"] = shut_down

    def on_signal(sig, _frame) -> None:
        if server.should_exit:
            server.force_exit = True
        shut_down(signal.Signals(sig).name)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    if config.shutdown_after_s is not None:
        timer = threading.Timer(
            config.shutdown_after_s, shut_down, (f"--shutdown-after-s {config.shutdown_after_s:g}",)
        )
        timer.daemon = True
        timer.start()
    try:
        http.start()
        while not server.started and http.is_alive():
            time.sleep(0.01)
        if not server.started:
            raise DinferError(f"dinfer-rt serve could not listen on {config.host}:{config.port} (see the log above)")
        if isinstance(app.state.engine, Engine):
            print(kv_pool_summary(app.state.engine, config.max_num_seqs), flush=True)
        elif hasattr(app.state.engine, "kv_pool_summary"):  # engine processes: what replica 0's engine took
            print(app.state.engine.kv_pool_summary, flush=True)
        if hasattr(app.state.engine, "prefix_cache_summary"):  # an approximate cache is never silent
            print(app.state.engine.prefix_cache_summary(), flush=True)
        print(f"dinfer-rt serving '{config.model_name}' on http://{config.host}:{config.port}", flush=True)
        freeze_startup_heap()  # start-up objects live as long as the server: no full collection walks them
        loop.run()
        if loop.failure is not None:  # the engine is gone: say why, stop serving, exit non-zero
            print(f"error: {loop.failure}", file=sys.stderr, flush=True)
            server.should_exit = True
        http.join(timeout=config.drain_timeout + 10)
        if loop.failure is None:
            print(report.end(), flush=True)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 0 if loop.failure is None else 1
