"""Data-parallel serving: M engine replicas in worker processes behind one front end.

Each replica process loads the model (on its own device: the replica index among the visible
ones) and runs its own :class:`~dinfer_rt.engine.Engine`. The front end, in the HTTP server's
process, checks every request as an engine would (so a bad request is still a 400 at once),
routes it to the replica with the fewest requests in flight (ties: round robin; each holds at
most its KV pool rows, as its engine reported them, + ``max_queue``) and mirrors
the replica's events ("update", "finish") onto a local :class:`~dinfer_rt.engine.Request`,
which the server streams from exactly as it does for a local engine. :class:`ReplicaPool`
offers the part of the engine interface the server uses (``submit``, ``abort``, ``close``,
``step``, the counts, ``stats``, ``prefix_cache``: each replica's step counters and prefix-cache
stats, relayed with its step reports and finish events and summed), so the server's loop steps it
like an engine: a pool step waits briefly for replica events. A replica that dies fails its
requests with a message naming it; the others keep serving. The replicas hold no weights in
common and exchange nothing: each is one device's continuous-batching engine, as vLLM's
data-parallel replicas are.
"""

from __future__ import annotations

import gc
import itertools
import os
import queue
import sys
import threading
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import NamedTuple

import torch

from dinfer_rt.channel import EventReceiver, EventSender, apply_event
from dinfer_rt.engine import EngineClosed, EngineStats, QueueFull, Request, check_request, notify
from dinfer_rt.errors import DinferError, GenerationError
from dinfer_rt.kv_blocks import blocks_for
from dinfer_rt.prefix_cache import PrefixCacheStats
from dinfer_rt.sampling import SamplingParams

_STAT_FIELDS = tuple(f.name for f in fields(EngineStats))
_PREFIX_FIELDS = tuple(f.name for f in fields(PrefixCacheStats))
_PREFIX_GAUGES = ("blocks", "bytes")  # what a dead replica no longer holds (the rest are counters)


class RelayedPrefixCache(NamedTuple):
    """The replicas' prefix caches as the front end knows them: the stats each replica last
    reported, summed, and their budgets summed (what ``server.Metrics.read_prefix_cache`` reads of a
    :class:`~dinfer_rt.prefix_cache.PrefixCache`)."""

    stats: PrefixCacheStats
    budget: int
    approximate: bool = False  # a bidirectional model's, under --prefix-cache approximate


class RelayedBlocks(NamedTuple):
    """The replicas' paged KV pools as the front knows them (what ``server.Metrics`` reads of a
    :class:`~dinfer_rt.kv_blocks.KVBlocks`): usable blocks, and blocks in use as last reported."""

    usable: int
    used: int


def _prefix_report(engine) -> dict | None:
    """The engine's prefix-cache stats and budget, to relay (None: it has no prefix cache)."""
    cache = engine.prefix_cache
    return None if cache is None else {**asdict(cache.stats), "budget": cache.budget, "approximate": cache.approximate}


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (modules, the model's Python objects, the
    server's routes and templates) out of the garbage collector's reach; returns how many.
    Called by ``serve`` once listening, and by every engine process (lead or tensor-parallel
    follower) once loaded.

    Why: a serving process keeps its start-up objects for life, yet every full collection walks
    them all. Measured in ``serve`` on the embedded model: 220k tracked objects, a full
    collection of 151-162 ms about once every 70-220 requests (an engine stall, which every
    running row waits out); frozen, 5-10k objects stay tracked and the same runs had no full
    collection. vLLM's engine core and API server do the same (``gc.freeze`` after start-up).
    Objects made later are collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class ReplicaError(DinferError):
    """A replica failed to start or died: the message names it."""


def replica_main(
    index: int,
    replicas: int,
    load: dict,
    engine_kwargs: dict,
    inbox,
    outbox,
    events_conn=None,
    tp_rank: int = 0,
    tp_size: int = 1,
    rendezvous: str | None = None,
    expert_parallel: bool = False,
    collective_timeout: float = 600.0,
) -> None:
    """One replica process (with ``tp_size`` > 1: rank ``tp_rank`` of replica ``index``'s
    tensor-parallel group): load, report "ready" on ``outbox``, then apply the commands of
    ``inbox`` and step the engine; a turn's events and step report go to the front in one write
    on the lead's ``events_conn`` (``channel.py``).

    Under tensor parallelism the group's rank 0 owns the scheduler: it alone runs the engine
    (admission, decisions, reports) and its runner (``model_runner.LeadRunner``) broadcasts each
    forward's inputs to the group; every other rank only runs those forwards over its shard
    (``model_runner.follow``). The ranks never decide what to run on their own."""
    from dinfer_rt import parallel
    from dinfer_rt.engine import Engine
    from dinfer_rt.kv_pool import pool_summary
    from dinfer_rt.loader import load_model
    from dinfer_rt.model_runner import GroupLost, LeadRunner, follow
    from dinfer_rt.parallel import RENDEZVOUS_ENV, bind_device, init_group, leave_group, load_sharded
    from dinfer_rt.plugins import select_backend

    torch.set_num_threads(parallel.threads_per_process(replicas * tp_size))
    _exit_when_orphaned(index, tp_rank)
    lead = tp_rank == 0
    group = runner = None
    src = index * tp_size  # the lead's global rank
    try:
        if tp_size > 1:
            from dinfer_rt.ir import ops

            os.environ[RENDEZVOUS_ENV] = rendezvous
            # a collective waiting on a rank that died or hung fails after this long
            rank = index * tp_size + tp_rank
            init_group(load.get("backend"), rank, replicas * tp_size, tp_size, timeout_s=collective_timeout)
            group = ops.COLLECTIVE_GROUPS["tp"]
            args = (load.get("path"), tp_rank, tp_size, load.get("backend"), load.get("dtype"), expert_parallel)
            model = load_sharded(*args)
            runner = LeadRunner(model, group, src, timeout_s=collective_timeout) if lead else None
        else:
            bind_device(select_backend(load.get("backend")), index)
            model = load_model(**load)
        engine = Engine(model, **engine_kwargs, runner=runner) if lead else None
    except BaseException as e:  # the front end reports it, naming this replica and rank
        where = f"rank {tp_rank}: " if tp_size > 1 else ""
        outbox.put(("failed", index, f"{where}{type(e).__name__}: {e}"))
        return
    parent = os.getppid()
    if not lead:
        freeze_startup_heap()  # a follower's full collection would stall every collective of its group
        try:
            follow(model, group, src, alive=lambda: os.getppid() == parent)
        except RuntimeError:  # a peer rank is gone: the front end names it and stops the group
            pass
        finally:
            leave_group(wait=False)
        return
    info = {"eos_ids": model.eos_ids, "mask_id": model.mask_id, "max_model_len": engine.max_model_len}
    info["prefix_cache"] = _prefix_report(engine)
    # the pool this engine allocated (rows: max_num_seqs or what the KV budget holds; a position's
    # K/V bytes: this rank's share under TP), so the front admits and refuses as this engine would
    info.update(kv_rows=engine.max_num_seqs, kv_pool_bytes=engine.kv_pool_bytes)
    info["kv_bytes_per_position"] = engine.kv_bytes_per_position
    # a paged pool's blocks (0 / None: contiguous rows), so the front refuses a request past the
    # whole pool with the 400 an in-process engine gives, and /metrics reports the blocks
    info.update(kv_block_size=engine.kv_plan.block_size, kv_pool_blocks=engine.blocks.usable if engine.paged else None)
    asked = engine_kwargs.get("max_num_seqs") or engine.max_num_seqs
    info["kv_pool_summary"] = pool_summary(engine.kv_plan, engine.max_model_len, asked)
    info["prefix_cache_summary"] = engine.prefix_cache_summary()
    outbox.put(("ready", index, {**info, "block_size": engine.block_size, "pid": os.getpid()}))
    freeze_startup_heap()

    events = EventSender(events_conn, index, extra=lambda: {"prefix_cache": _prefix_report(engine)})

    lost_peer = False
    try:
        while os.getppid() == parent:  # an orphaned replica (the front end was killed) exits
            commands = _take_commands(inbox, engine.has_work(), IDLE_WAIT_S if runner is None else TP_IDLE_WAIT_S)
            if _apply(commands, engine, events):
                return
            report = None
            if engine.has_work():
                engine.step()
                if runner is not None and runner.lost is not None:  # its requests failed naming it
                    events.flush()
                    runner, lost_peer = None, True
                    break
                report = {k: getattr(engine.stats, k) for k in _STAT_FIELDS}
                report.update(running=engine.num_running, waiting=engine.num_waiting)
                report["prefix_cache"] = _prefix_report(engine)
                report["kv_blocks_used"] = engine.blocks.used if engine.paged else 0
            elif runner is not None:  # followers wait in a collective: keep it short of the timeout
                runner.send(("idle",))
            if not events.flush(report):  # the front closed its end: it is gone or shutting down
                return
    except GroupLost:  # a collective failed or timed out (a follower rank died or hung), or a forward failed
        runner, lost_peer = None, True
    finally:
        if runner is not None:
            try:
                runner.stop()
            except (RuntimeError, GroupLost):
                pass
        if group is not None:
            leave_group(wait=False)
    if lost_peer:  # the front end names it (``LOST_PEER_EXIT_CODE``) and stops the group's other ranks
        sys.exit(LOST_PEER_EXIT_CODE)


LOST_PEER_EXIT_CODE = 4
"""A tensor-parallel lead's exit code when a collective failed or timed out (``collective_timeout``):
a follower rank died or hung, so the group cannot run another forward."""
ORPHAN_POLL_S = 0.2
ORPHANED_EXIT_CODE = 3
"""A replica process's exit code when it found its front end gone (its parent pid changed)."""


def _exit_when_orphaned(index: int, tp_rank: int) -> None:
    """Exit this replica process within ``ORPHAN_POLL_S`` of its front end's death, whatever it is
    doing. Why: a rank blocked in the rendezvous, in loading, or in a collective with a lead that
    died along with the front end never reaches the main loop's parent check, and nothing else
    stops it before the group's 600 s timeout; with the front end gone nobody reads its results,
    so it leaves at once (``os._exit``: no collective or interpreter shutdown left to hang in)."""
    import multiprocessing
    import sys

    spawner = multiprocessing.parent_process()  # the front end, as it was when it started us
    parent = spawner.pid if spawner is not None else os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL_S)
        print(f"dinfer-rt replica {index} rank {tp_rank}: the front end (pid {parent}) is gone; exiting",
              file=sys.stderr, flush=True)  # fmt: skip
        os._exit(ORPHANED_EXIT_CODE)

    threading.Thread(target=watch, name=f"dinfer-orphan-watch-{index}-{tp_rank}", daemon=True).start()


IDLE_WAIT_S = 0.5
"""An idle engine process's (and the front's relay's) wait for the next command or event: a
command or an event ends it at once, so it only sets how often an idle server wakes (and its CPU
between requests). A tensor-parallel lead waits ``TP_IDLE_WAIT_S``: each idle turn it tells its
followers, which must hear from it well within the collective timeout."""
TP_IDLE_WAIT_S = 0.05


def _take_commands(inbox, busy: bool, idle_wait: float = IDLE_WAIT_S) -> list:
    """The front end's commands waiting in ``inbox`` (blocking up to ``idle_wait`` s when idle)."""
    commands = []
    try:
        commands.append(inbox.get(timeout=0 if busy else idle_wait))
    except queue.Empty:
        pass
    while True:
        try:
            commands.append(inbox.get_nowait())
        except queue.Empty:
            return commands


def _apply(commands: list, engine, events: EventSender | None = None) -> bool:
    """Apply the front end's commands to the lead's engine; True on "stop"."""
    listener = None if events is None else events.listener
    for cmd in commands:
        if cmd[0] == "submit":
            _, rid, prompt, params, max_tokens, canvas, *extra = cmd
            try:
                engine.submit(
                    prompt, params, max_tokens=max_tokens, request_id=rid, listener=listener, return_canvas=canvas,
                    stream_provisional=bool(extra and extra[0]), priority=extra[1] if len(extra) > 1 else 0,
                )  # fmt: skip
            except GenerationError as e:  # the front end checked it; refuse it as an error, not a hang
                if events is not None:
                    events.refuse(rid, f"{type(e).__name__}: {e}")
        elif cmd[0] == "abort":
            engine.abort(cmd[1])
        elif cmd[0] == "close":
            engine.close()
        elif cmd[0] == "stop":
            return True
    return False


class ReplicaPool:
    """``replicas`` engine processes over the model ``load`` describes (``load_model`` keywords),
    each an :class:`Engine` with ``engine_kwargs``; the front end admits at most the rows of a
    replica's KV pool (``max_num_seqs``, or fewer under ``kv_cache_memory`` /
    ``kv_cache_memory_fraction``: what its engine reported when ready) + ``max_queue`` requests
    per replica (past it on every replica: ``QueueFull``)."""

    def __init__(
        self,
        replicas: int,
        load: dict,
        engine_kwargs: dict,
        max_queue: int,
        timeout: float = 600.0,
        tp_size: int = 1,
        expert_parallel: bool = False,
        collective_timeout: float = 600.0,
    ):
        """``tp_size`` > 1: each replica is a tensor-parallel group of that many rank processes,
        each loading its shard once (``expert_parallel``: MoE layers split whole experts). A
        collective that waits more than ``collective_timeout`` seconds on a rank (dead or hung)
        ends that replica: its requests fail naming it and its other ranks are killed."""
        import tempfile

        import torch.multiprocessing as mp

        from dinfer_rt.loader import default_model_path
        from dinfer_rt.model_spec import parse_spec
        from dinfer_rt.parallel import check_devices, check_split, sigint_ignored
        from dinfer_rt.plugins import select_backend
        from dinfer_rt.tokenizer import Tokenizer

        if replicas < 1:
            raise ReplicaError(f"data parallel size must be >= 1, got {replicas}")
        if tp_size < 1:
            raise ReplicaError(f"tensor parallel size must be >= 1, got {tp_size}")
        path = Path(load.get("path") or default_model_path())
        self.spec = parse_spec(path)  # a bad model folder fails here, before any process starts
        check_split(self.spec, tp_size, expert_parallel)  # expert parallelism without TP too
        if tp_size > 1:
            if load.get("quantization") is not None:
                raise ReplicaError("quantization with tensor_parallel_size > 1 is not supported yet")
        check_devices(select_backend(load.get("backend")), replicas * tp_size)
        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(replicas)]
        pipes = [ctx.Pipe(duplex=False) for _ in range(replicas)]  # (front's reader, lead's writer) each
        kwargs = {**engine_kwargs, "max_queue": None}  # the front end bounds the queue
        self._store = tempfile.mkdtemp(prefix="dinfer-replicas-") if tp_size > 1 else None
        rendezvous = None if self._store is None else "file://" + os.path.join(self._store, "store")
        self.tp_size, self.collective_timeout = tp_size, collective_timeout
        self.ranks = [  # per replica, its rank processes (rank 0 first)
            [
                ctx.Process(
                    target=replica_main,
                    args=(
                        i,
                        replicas,
                        load,
                        kwargs,
                        self.inboxes[i] if t == 0 else None,
                        self.outbox,
                        pipes[i][1] if t == 0 else None,
                        t,
                        tp_size,
                        rendezvous,
                        expert_parallel,
                        collective_timeout,
                    ),
                    daemon=True,
                )  # fmt: skip
                for t in range(tp_size)
            ]
            for i in range(replicas)
        ]
        self.procs = [group[0] for group in self.ranks]
        with sigint_ignored():
            for group in self.ranks:
                for p in group:
                    p.start()
        for _, writer in pipes:  # the leads hold the writing ends: a lead's exit ends its pipe
            writer.close()
        self.events = EventReceiver({i: reader for i, (reader, _) in enumerate(pipes)})
        ready: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(ready) < replicas:
            try:
                kind, index, value = self.outbox.get(timeout=0.5)
            except queue.Empty:
                dead = [(i, *d) for i in range(replicas) if i not in ready for d in self._dead_ranks(i)]
                if dead or time.monotonic() > deadline:
                    self.shutdown()
                    which = self._name(*dead[0][:2]) if dead else f"replica {sorted(set(range(replicas)) - set(ready))}"
                    why = f"died (exit code {dead[0][2]})" if dead else f"did not start within {timeout:.0f} s"
                    raise ReplicaError(f"{which} {why}") from None
                continue
            if kind == "failed":
                self.shutdown()
                raise ReplicaError(f"replica {index} failed to load: {value}")
            ready[index] = value
        info = ready[0]
        self.eos_ids, self.mask_id, self.max_model_len = info["eos_ids"], info["mask_id"], info["max_model_len"]
        self.block_size = info["block_size"]
        self.pids = [ready[i]["pid"] for i in range(replicas)]
        self._prefix = [ready[i].get("prefix_cache") for i in range(replicas)]  # per replica, its last report
        self.tokenizer = Tokenizer(path, self.spec.vocab)
        # each replica's KV pool as its engine allocated it: the rows that decode at once (a budget
        # may hold fewer than max_num_seqs; with kv_cache_memory_fraction they may differ between
        # devices) and one position's K/V bytes, which admission names for a request too long
        self.kv_rows = [ready[i]["kv_rows"] for i in range(replicas)]
        # (a rank's engine reports its shard: a group holds tp_size shards, split or replicated heads alike)
        self._kv_bytes = [ready[i]["kv_pool_bytes"] * tp_size for i in range(replicas)]
        self.kv_bytes_per_position: int = info["kv_bytes_per_position"] * tp_size
        self.kv_block_size: int = info["kv_block_size"]  # 0: contiguous rows
        self.kv_pool_blocks: list[int | None] = [ready[i]["kv_pool_blocks"] for i in range(replicas)]
        self.paged = info["kv_pool_blocks"] is not None
        where = f"replica 0 of {replicas}" if replicas > 1 else "the engine process"
        shard = f", rank 0's shard of {tp_size}" if tp_size > 1 else ""
        self.kv_pool_summary = info["kv_pool_summary"].replace("KV pool:", f"KV pool ({where}{shard}):", 1)
        self.max_queue = max_queue
        self._prefix_summary: str = info["prefix_cache_summary"]
        self.capacities = [rows + max_queue for rows in self.kv_rows]  # requests in flight per replica, at most
        self.replicas = replicas
        self.inflight: dict[str, tuple[Request, int]] = {}
        self.load = [0] * replicas  # requests in flight per replica
        # aborted requests whose room was handed back at once (their rows free at their engine's next
        # step): a client that goes away and reconnects is not refused for its own cancelled request
        self._released: set[str] = set()
        self.served = [0] * replicas  # requests routed to each replica so far
        self.alive = [True] * replicas
        self.deaths: list[str] = []
        self.closed = False
        self.stats = EngineStats()
        self._reported = [{k: 0 for k in (*_STAT_FIELDS, "running", "waiting")} for _ in range(replicas)]
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._turn = itertools.count()

    # ---------------------------------------------------------------- the engine interface the server uses
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        max_tokens: int | None = None,
        request_id: str | None = None,
        listener=None,
        return_canvas: bool = False,
        stream_provisional: bool = False,
        priority: int = 0,
    ) -> Request:
        options = {"return_canvas": return_canvas, "stream_provisional": stream_provisional, "priority": priority}
        ids = None if request_id is None else [request_id]
        return self.submit_many(
            [prompt], params, max_tokens=max_tokens, listeners=[listener], request_ids=ids, **options
        )[0]

    def submit_many(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        max_tokens: int | None = None,
        listeners: list | None = None,
        request_ids: list[str] | None = None,
        return_canvas: bool = False,
        stream_provisional: bool = False,
        priority: int = 0,
    ) -> list[Request]:
        """Route every prompt, or none (a completions batch): each is checked first, then all are
        placed at once under the lock; when the live replicas' room (each: its KV pool rows +
        ``max_queue`` requests in flight) cannot take them all, ``QueueFull`` and nothing is sent,
        counted or routed."""
        listeners = listeners or [None] * len(prompts)
        checked = [self.check_request(p, params, max_tokens) for p in prompts]  # every prompt before any is routed
        max_tokens = checked[0] if checked else max_tokens
        with self._lock:
            if self.closed:
                raise EngineClosed("the server is shutting down and admits no new requests")
            live = [i for i in range(self.replicas) if self.alive[i]]
            if not live:
                raise EngineClosed("every replica has died")
            load, picks = list(self.load), []
            for prompt in prompts:  # placed on a copy of the loads: committed only if every prompt has room
                turn = next(self._turn)
                positions = len(prompt) + params.gen_length
                room = [r for r in live if load[r] < self.capacities[r] and self._holds(r, positions)]
                if not room:
                    batch = f"no room for a batch of {len(prompts)} requests: " if len(prompts) > 1 else ""
                    raise QueueFull(batch + self._full_message(live))
                i = min(room, key=lambda r: (load[r], (r - turn) % self.replicas))
                load[i] += 1
                picks.append(i)
            reqs = []
            for k, (prompt, i, listener) in enumerate(zip(prompts, picks, listeners)):
                rid = request_ids[k] if request_ids is not None else f"req-{next(self._ids)}"
                req = Request(rid, list(prompt), params, max_tokens, listener, return_canvas)
                req.stream_provisional, req.priority = stream_provisional, priority
                self.inflight[req.id] = (req, i)
                self.load[i] += 1
                self.served[i] += 1
                reqs.append(req)
        for req, i in zip(reqs, picks):
            cmd = ("submit", req.id, req.prompt, params, max_tokens, return_canvas, stream_provisional, priority)
            self.inboxes[i].put(cmd)
        return reqs

    def check_request(self, prompt: list[int], params: SamplingParams, max_tokens: int | None) -> int:
        """What an engine would refuse (``Engine.check_request``), checked here before routing: a
        ``GenerationError`` naming the field (a request past every live replica's paged pool
        among them), else the request's ``max_tokens``."""
        pools = [b for b, alive in zip(self.kv_pool_blocks, self.alive) if alive and b is not None]
        return check_request(
            prompt, params, max_tokens, vocab=self.spec.vocab, max_model_len=self.max_model_len,
            has_tokenizer=True, block_causal=self.spec.block_causal,
            kv_bytes_per_position=self.kv_bytes_per_position, kv_block_size=self.kv_block_size,
            kv_pool_blocks=max(pools) if pools else None,
        )  # fmt: skip

    def _holds(self, replica: int, positions: int) -> bool:
        """Whether replica's KV pool can ever hold a request of ``positions`` positions (pools may
        differ under --kv-cache-memory-fraction)."""
        blocks = self.kv_pool_blocks[replica]
        return blocks is None or blocks_for(positions, self.kv_block_size) <= blocks

    @property
    def blocks(self) -> RelayedBlocks | None:
        """The live replicas' paged pools as they last reported them (None: contiguous rows)."""
        if not self.paged:
            return None
        live = [i for i in range(self.replicas) if self.alive[i]]
        used = sum(self._reported[i].get("kv_blocks_used", 0) for i in live)
        return RelayedBlocks(sum(self.kv_pool_blocks[i] for i in live), used)

    def prefix_cache_summary(self) -> str:
        """The start-up line on the replicas' prefix cache (replica 0's: every replica is built alike)."""
        return self._prefix_summary

    @property
    def capacity(self) -> int:
        """Requests the front admits at once over the live replicas (each: its KV pool rows +
        ``max_queue``)."""
        return sum(c for c, alive in zip(self.capacities, self.alive) if alive)

    @property
    def kv_pool_rows(self) -> int:
        """Rows decoding at once over the live replicas (``/metrics``' ``dinfer_kv_pool_rows``)."""
        return sum(r for r, alive in zip(self.kv_rows, self.alive) if alive)

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of the live replicas' KV pools (``/metrics``' ``dinfer_kv_pool_bytes``)."""
        return sum(b for b, alive in zip(self._kv_bytes, self.alive) if alive)

    def _full_message(self, live: list[int]) -> str:
        """Why no replica admits another request: each one's count against its KV pool rows."""
        held = ", ".join(
            f"replica {r} holds {self.load[r]} of {self.capacities[r]} ({self.kv_rows[r]} rows)" for r in live
        )
        return f"every replica is full (each admits its KV pool rows + max_queue {self.max_queue} requests): {held}"

    def abort(self, request_id: str) -> None:
        with self._lock:
            entry = self.inflight.get(request_id)
            if entry is not None and request_id not in self._released:
                self._released.add(request_id)
                self.load[entry[1]] -= 1
        if entry is not None:
            self.inboxes[entry[1]].put(("abort", request_id))

    def close(self) -> None:
        with self._lock:
            self.closed = True
        for i, box in enumerate(self.inboxes):
            if self.alive[i]:
                box.put(("close",))

    @property
    def num_waiting(self) -> int:
        return sum(r["waiting"] for r in self._reported)

    @property
    def num_running(self) -> int:
        """Rows the replicas last reported running (a request still on its way to a replica is
        neither running nor, yet, waiting there)."""
        return sum(r["running"] for r in self._reported)

    def has_work(self) -> bool:
        return bool(self.inflight)

    @property
    def prefix_cache(self) -> RelayedPrefixCache | None:
        """The replicas' prefix caches summed (None: no replica has one). A dead replica's
        counters stay counted (Prometheus counters never go down); its blocks and bytes do not."""
        reports = [r for r in self._prefix if r is not None]
        if not reports:
            return None
        stats = PrefixCacheStats(**{k: sum(r[k] for r in reports) for k in _PREFIX_FIELDS})
        approximate = any(r.get("approximate", False) for r in reports)
        return RelayedPrefixCache(stats, sum(r["budget"] for r in reports), approximate)

    def step(self) -> list[Request]:
        """Apply the replicas' events and step reports (waiting up to 50 ms for the first, or
        ``IDLE_WAIT_S`` with no request in flight: a replica's death ends the wait too, its pipe
        closing); the finished requests."""
        finished: list[Request] = []
        for index, events, report in self.events.receive(timeout=0.05 if self.inflight else IDLE_WAIT_S):
            for rid, event, msg in events:
                self._on_event(index, rid, event, msg, finished)
            if report is not None:
                report = dict(report)
                if "prefix_cache" in report:
                    self._prefix[index] = report.pop("prefix_cache")
                self._reported[index] = report
                for k in _STAT_FIELDS:
                    setattr(self.stats, k, sum(r[k] for r in self._reported))
        self._check_alive(finished)
        return finished

    def shutdown(self) -> None:
        """Stop every replica process (after ``close`` and the drain)."""
        for box in self.inboxes:
            box.put(("stop",))
        if hasattr(self, "events"):  # (a failed start stops the replicas before the pipes are read)
            self.events.close()  # a replica still writing finds its pipe closed and returns
        for group in self.ranks:
            for p in group:
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
                if p.is_alive():  # a hung or stopped rank never handles SIGTERM
                    p.kill()
                    p.join(timeout=5)
        if self._store is not None:
            import shutil

            shutil.rmtree(self._store, ignore_errors=True)

    @property
    def rank_pids(self) -> list[list[int]]:
        """Per replica, its rank processes' pids (rank 0 first; one each without TP)."""
        return [[p.pid for p in group] for group in self.ranks]

    def death_reason(self) -> str:
        """Which replicas (and ranks) died, in the order they were found dead."""
        return "; ".join(self.deaths) or "no replica died"

    def _dead_ranks(self, i: int) -> list[tuple[int, int]]:
        """(rank, exit code) of replica ``i``'s rank processes that have exited."""
        return [(t, p.exitcode) for t, p in enumerate(self.ranks[i]) if p.exitcode is not None]

    def _name(self, i: int, rank: int) -> str:
        return f"replica {i} rank {rank}" if self.tp_size > 1 else f"replica {i}"

    def _why(self, i: int, dead: list[tuple[int, int]]) -> str:
        """What ended replica ``i``, from its ranks that exited (rank, exit code): a rank that died
        is named before a lead that only lost it (``LOST_PEER_EXIT_CODE``)."""
        rank, code = sorted(dead, key=lambda d: (d[1] == LOST_PEER_EXIT_CODE, d[0]))[0]
        if code == LOST_PEER_EXIT_CODE and rank == 0 and self.tp_size > 1:
            return (
                f"replica {i}: its tensor-parallel group broke (one of ranks 1..{self.tp_size - 1} died or hung past "
                f"the {self.collective_timeout:.0f} s --distributed-timeout, or a forward failed on rank 0); "
                "its ranks were stopped"
            )
        if code == -6 and rank == 0 and self.tp_size > 1:  # NCCL's watchdog aborts (SIGABRT) a timed-out lead
            return (
                f"replica {i} rank 0 died (exit code {code}; a collective past the {self.collective_timeout:.0f} s "
                "--distributed-timeout aborts the process under NCCL: a peer rank may have died or hung)"
            )
        return f"{self._name(i, rank)} died (exit code {code})"

    # ---------------------------------------------------------------- events
    def _on_event(self, index: int, rid: str, event: str, msg: dict, finished: list[Request]) -> None:
        entry = self.inflight.get(rid)
        if entry is None:
            return
        req = entry[0]
        apply_event(req, msg)
        req.status = "running"
        if event == "finish":
            if msg.get("prefix_cache") is not None:
                self._prefix[index] = msg["prefix_cache"]
            req.output_ids, req.text = msg.get("output_ids", []), msg.get("text", "")
            req.forwards = msg.get("forwards", 0)
            error = msg.get("error")
            dead = self._dead_ranks(index) if error is not None else []
            if dead:  # a collective failed because a peer rank died: name the rank (``_why``), not the library
                error = f"{self._why(index, dead)} while serving this request"
                self._finish(req, index, msg["reason"], ReplicaError(error), finished)
                return
            self._finish(req, index, msg["reason"], None if error is None else GenerationError(error), finished)
            return
        notify(req, event)

    def _finish(self, req: Request, index: int, reason: str, error, finished: list[Request]) -> None:
        req.finish_reason, req.error, req.status, req.finished = reason, error, "finished", time.perf_counter()
        with self._lock:
            self.inflight.pop(req.id, None)
            if req.id in self._released:
                self._released.discard(req.id)
            else:
                self.load[index] -= 1
        finished.append(req)
        notify(req, "finish")

    def _check_alive(self, finished: list[Request]) -> None:
        for i in range(self.replicas):
            dead = self._dead_ranks(i) if self.alive[i] else []
            if dead:
                self.alive[i] = False
                self._reported[i] = {**self._reported[i], "running": 0, "waiting": 0}
                if self._prefix[i] is not None:  # its counters stay; the blocks it held are gone
                    self._prefix[i] = {**self._prefix[i], **dict.fromkeys(_PREFIX_GAUGES, 0)}
                for p in self.ranks[i]:  # the group's other ranks would wait on the dead one: killed
                    if p.exitcode is None:  # (SIGKILL: a hung, even a stopped, rank never handles SIGTERM)
                        p.kill()
                why = self._why(i, dead)
                self.deaths.append(why)
                lost = [req for req, r in list(self.inflight.values()) if r == i]
                for req in lost:
                    err = ReplicaError(f"{why} while serving this request")
                    self._finish(req, i, "error", err, finished)
