"""The seam between the decode state and the ranks that run the model.

A step's forward is described by one :class:`ForwardInputs` (ids, one window or per-row
windows, which rows of the KV-cache pool, which outputs are wanted) and run by a runner:

- :class:`LocalRunner` runs it in this process (one device);
- :class:`LeadRunner` is rank 0 of a tensor/expert-parallel group: it broadcasts each forward's
  inputs (and the pool's row moves) to the group, then runs its own shard;
- :func:`follow` is every other rank: it receives the lead's inputs and runs its shard, and
  never decides anything on its own (the collectives inside the forward pair with the lead's).

The same seam serves the persistent worker processes of ``workers.py`` and ranks started by an
external launcher (``torchrun``, ``llm.generate_on_rank``). Not to be confused with
``executor.py``, which runs one compiled graph.

Device graphs (a backend whose ``replays_graphs()``): a forward's inputs say whether it may
replay a captured graph (``graph``; False runs it eagerly, inside :func:`eager_forwards`) and how
many rows pad it to the engine's batch-size bucket (``pad_rows``): every rank pads alike, the
padding rows' outputs are dropped here, and their K/V go to pool rows no cohort holds (paged: to
the trash block).

Paged pools (``kv_blocks.py``): a cached forward also carries its rows' block table
(``block_table``), so every rank reads and writes the same blocks without keeping a table of
its own; the only other message a paged pool needs is a copy-on-write's block copies.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dinfer_rt.errors import DinferError
from dinfer_rt.kv_blocks import blocks_for
from dinfer_rt.model import KVCache, Model, PagedKV

# ---------------------------------------------------------------- what a forward needs


@dataclass
class RowWindows:
    """Per-row query windows (cohorts at different blocks in one forward): ``token_index`` /
    ``positions`` [B, T] and ``key_valid`` [B, S] (see ``Model.forward_rows``)."""

    token_index: torch.Tensor
    positions: torch.Tensor
    key_valid: torch.Tensor


@dataclass
class ForwardInputs:
    """Everything one forward needs, in a form any rank can run.

    ``cache``: ``(first_row, rows, length)`` of the engine's KV-cache pool, or None (uncached);
    with a paged pool, ``block_table`` is those rows' block table (int32 [rows, blocks]; missing
    rows and entries read the trash block).
    With ``rows`` None the forward is one window for every row (``compute``: the positions
    computed, None for all; ``attention_mask`` marks real tokens) and ``select`` are positions;
    with ``rows`` each row has its own window and ``select`` indexes its queries. ``select``
    None asks for logits, else the confidence head's (score, argmax)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    compute: torch.Tensor | None = None
    rows: RowWindows | None = None
    cache: tuple[int, int, int] | None = None
    select: torch.Tensor | None = None
    score: str = "max"
    block_size: int | None = None
    precision: str | None = None
    graph: bool = True  # False: run eagerly even where the backend replays device graphs
    pad_rows: int = 0  # rows appended (mask ids, every key valid) up to a graph's batch size; outputs dropped
    # positions appended to the sequence up to a graph's length bucket: masked keys, and queries
    # (outputs dropped) where the window is the whole sequence
    pad_length: int = 0
    block_table: torch.Tensor | None = None


_GRAPHS = threading.local()


class eager_forwards:  # noqa: N801 (a context manager, used as ``with eager_forwards():``)
    """Forwards run inside it on this thread are eager: a graphed executable neither captures
    nor replays (``backends/triton/graphs.py`` asks :func:`graphs_allowed`)."""

    def __enter__(self) -> None:
        self.before = getattr(_GRAPHS, "eager", False)
        _GRAPHS.eager = True

    def __exit__(self, *exc) -> None:
        _GRAPHS.eager = self.before


def graphs_allowed() -> bool:
    """Whether a forward on this thread may capture or replay a device graph."""
    return not getattr(_GRAPHS, "eager", False)


def run_on(model: Model, inputs: ForwardInputs, cache: KVCache | None):
    """Run ``inputs`` on ``model`` with ``cache`` (the pool rows ``inputs.cache`` names): the one
    entry point a step calls (``Model.forward`` / ``confidence`` / ``forward_rows`` are its three
    shapes, kept as they are for tests and likelihood). ``inputs.pad_rows`` must be 0 here
    (:func:`run_rows` pads); ``inputs.graph`` False runs it eagerly."""
    if not inputs.graph:
        with eager_forwards():
            return _run(model, inputs, cache)
    return _run(model, inputs, cache)


def run_rows(model: Model, inputs: ForwardInputs, rows: CachePoolRows):
    """:func:`run_on` over the pool rows ``inputs.cache`` names, padded by ``inputs.pad_rows`` rows
    first (what every runner and follower calls): the pad rows compute the same window over
    the pool rows after the real ones (free rows: the engine checks), and only the real rows'
    outputs come back."""
    width = None  # the window's outputs before length padding (logits only; None: not trimmed)
    if inputs.pad_length:
        inputs, width = _lengthened(model, inputs, inputs.pad_length)
    pad = inputs.pad_rows
    if not pad:
        out = run_on(model, inputs, rows.view(inputs.cache, inputs.block_table))
        return out if width is None else out[:, :width]
    padded = _padded(model, inputs, pad)
    out = run_on(model, padded, rows.view(padded.cache, padded.block_table))
    b = inputs.input_ids.shape[0]
    if isinstance(out, tuple):
        return tuple(o[:b] for o in out)
    return out[:b] if width is None else out[:b, :width]


def _lengthened(model: Model, inputs: ForwardInputs, pad: int) -> tuple[ForwardInputs, int | None]:
    """``inputs`` with ``pad`` positions appended to the sequence (a graph's length bucket): mask
    ids that no query sees (``attention_mask`` 0 there, so the real rows' answers are unchanged),
    computed as well where the window is the whole sequence (its width then follows the bucket,
    not the length). Their K/V land past the sequence in its own pool rows. Returns the
    inputs and, for a logits forward whose window grew, the width to trim its output to."""
    if inputs.rows is not None:
        raise DinferError("per-row query windows are never padded to a graph's length bucket")
    ids = inputs.input_ids
    b, n = ids.shape
    m = n + pad
    buf = _grown(model, "graph_len_ids", ids, (b, m), model.mask_id)
    mask = inputs.attention_mask
    full = _grown(model, "graph_len_mask", mask, (b, m), 0, like=ids if mask is None else None)
    compute, width = inputs.compute, None
    # a window over the whole sequence (a refresh, an uncached forward) grows with it; the others
    # ([s, e) blocks, [s, n) suffixes) have widths of the generation's blocks, not of the prompt
    if compute is None or (len(compute) and int(compute[0]) == 0 and int(compute[-1]) == n - 1):
        if compute is not None:
            key = ("graph_len_compute", id(compute), compute._version, len(compute), n, m)
            tail = torch.arange(n, m, dtype=compute.dtype, device=compute.device)
            compute = model._memo(key, lambda: (torch.cat((compute, tail)), compute))[0]
        width = n if inputs.compute is None else len(inputs.compute)
        if inputs.select is not None:
            width = None  # the confidence head answers for ``select`` only
    cache = None if inputs.cache is None else (inputs.cache[0], inputs.cache[1], m)
    out = dataclasses.replace(inputs, input_ids=buf, attention_mask=full, compute=compute, cache=cache, pad_length=0)
    return out, width


def _grown(model: Model, name: str, real: torch.Tensor | None, shape: tuple[int, int], fill: int, like=None):
    """A [rows, length] buffer kept per shape (a step copies into it; a graph binds it): ``real`` in
    its leading corner (None: ones the shape of ``like``, an all-valid mask), ``fill`` everywhere
    else, rewritten each call (a smaller input of this shape may have left real values there)."""
    src = real if real is not None else like
    dtype = src.dtype if real is not None else torch.long
    key = (name, shape, dtype, src.device)
    buf = model._memo(key, lambda: torch.empty(shape, dtype=dtype, device=src.device))
    buf.fill_(fill)
    b, n = src.shape
    if real is None:
        buf[:b, :n].fill_(1)
    else:
        buf[:b, :n].copy_(real)
    return buf


def _padded(model: Model, inputs: ForwardInputs, pad: int) -> ForwardInputs:
    """``inputs`` with ``pad`` rows of mask ids after the real ones, every position of them a
    valid key (no empty softmax), in buffers kept per shape (a step copies its rows in)."""
    if inputs.rows is not None:
        raise DinferError("per-row query windows are never padded to a graph's batch size")
    ids = inputs.input_ids
    b, n = ids.shape
    rows = b + pad
    buf = _grown(model, "graph_pad_ids", ids, (rows, n), model.mask_id)
    mask = inputs.attention_mask
    if mask is not None:
        mask = _grown(model, "graph_pad_mask", mask, (rows, n), 1)
    cache = inputs.cache
    if cache is not None:
        cache = (cache[0], cache[1] + pad, cache[2])
    return dataclasses.replace(inputs, input_ids=buf, attention_mask=mask, cache=cache, pad_rows=0)


def _run(model: Model, inputs: ForwardInputs, cache: KVCache | None):
    if inputs.rows is not None:
        w = inputs.rows
        return model.forward_rows(
            inputs.input_ids, w.token_index, w.positions, w.key_valid, cache,
            select=inputs.select, score=inputs.score, block_size=inputs.block_size,
        )  # fmt: skip
    if inputs.select is None:
        return model.forward(
            inputs.input_ids, inputs.attention_mask, cache=cache, compute=inputs.compute,
            block_size=inputs.block_size, precision=inputs.precision,
        )  # fmt: skip
    return model.confidence(
        inputs.input_ids, inputs.attention_mask, select=inputs.select, score=inputs.score, cache=cache,
        compute=inputs.compute, block_size=inputs.block_size, precision=inputs.precision,
    )  # fmt: skip


class CachePoolRows:
    """A KV-cache pool and views of its rows, built once per ``(first_row, rows, length)``: the
    same views come back every step (the backends' per-forward memos key on them). A paged pool
    (a :class:`PagedKV` with no table) is viewed through each forward's block table."""

    def __init__(self, pool: KVCache | PagedKV | None = None) -> None:
        self.pool = pool
        self._views: dict[tuple[int, int, int], KVCache] = {}

    def view(self, rows: tuple[int, int, int] | None, table: torch.Tensor | None = None) -> KVCache | PagedKV | None:
        if rows is None:
            return None
        if isinstance(self.pool, PagedKV) or table is not None:
            return self._paged(rows, table)
        if self.pool is None:
            raise DinferError("a cached forward ran without a KV-cache pool bound to the runner")
        view = self._views.get(rows)
        if view is None:
            a, b, n = rows
            pool = self.pool
            whole = a == 0 and b == pool.k[0].shape[0] and n == pool.length
            view = pool if whole else KVCache([k[a : a + b, :n] for k in pool.k], [v[a : a + b, :n] for v in pool.v])
            if len(self._views) > 64:
                self._views.clear()
            self._views[rows] = view
        return view

    def _paged(self, rows: tuple[int, int, int], table: torch.Tensor | None) -> PagedKV:
        """The paged pool seen through ``table``, made ``[rows, blocks of length]``: rows and entries
        it lacks (graph padding rows, a length bucket past the rows' blocks) read the trash block."""
        pool = self.pool
        if not isinstance(pool, PagedKV) or table is None:
            what = "a block table" if table is None else "a paged KV pool bound to the runner"
            raise DinferError(f"a cached forward on a paged KV pool ran without {what}")
        _, b, n = rows
        nb = blocks_for(n, pool.block_size)
        if tuple(table.shape) != (b, nb):
            full = torch.zeros((b, nb), dtype=torch.int32)
            r, c = min(b, table.shape[0]), min(nb, table.shape[1])
            full[:r, :c] = table[:r, :c]
            table = full
        return PagedKV(pool.k, pool.v, table, n)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each ``(src, dst)`` block's K/V, every layer (``KVBlocks.writable``)."""
        if not pairs or not isinstance(self.pool, PagedKV):
            return
        src = torch.tensor([p[0] for p in pairs], device=self.pool.k[0].device)
        dst = torch.tensor([p[1] for p in pairs], device=self.pool.k[0].device)
        for buf in (*self.pool.k, *self.pool.v):
            buf.index_copy_(0, dst, buf.index_select(0, src))

    def move(self, moves: list[tuple[int, int, int, int]]) -> None:
        """Copy pool rows ``(dst, src, rows, length)`` in order (the engine packs its rows down)."""
        if self.pool is None or isinstance(self.pool, PagedKV):  # paged: the engine moves its table rows
            return
        for dst, src, b, n in moves:
            for buf in (*self.pool.k, *self.pool.v):
                part = buf[src : src + b, :n]
                buf[dst : dst + b, :n].copy_(part.clone() if src < dst + b else part)


# ---------------------------------------------------------------- runners


class LocalRunner:
    """Runs forwards in this process over the pool it is bound to (the engine's KV cache)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.rows = CachePoolRows()

    def bind(self, pool: KVCache | PagedKV | None) -> None:
        """The engine's KV-cache pool (None: released)."""
        self.rows = CachePoolRows(pool)

    def move_rows(self, moves: list[tuple[int, int, int, int]]) -> None:
        self.rows.move(moves)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.rows.copy_blocks(pairs)

    def __call__(self, inputs: ForwardInputs):
        return run_rows(self.model, inputs, self.rows)


class LeadRunner(LocalRunner):
    """Rank 0 of a model-parallel group: each forward's inputs go to the group first.

    Messages (one ``broadcast_object_list`` each): ``("bind", rows, length)`` a fresh pool,
    ``("bind_paged", blocks, block_size)`` a fresh paged pool, ``("move", moves)``, ``("copy",
    pairs)`` a copy-on-write's blocks, ``("run", inputs)``, ``("idle",)`` (a heartbeat while nothing runs, so
    a follower's wait never reaches the group's timeout), ``("stop",)``."""

    def __init__(self, model: Model, group, src: int, timeout_s: float | None = None) -> None:
        super().__init__(model)
        self.group, self.src = group, src
        self.stopped = False
        self.timeout_s = timeout_s  # the group's collective timeout, for messages
        self.lost: GroupLost | None = None  # set when the group broke: every later call raises it
        from dinfer_rt.parallel import BEFORE_LEAVING

        BEFORE_LEAVING.append(self.stop)  # a lead leaving its group releases its followers first

    def stop(self) -> None:
        """Release the followers (their ``follow`` returns); idempotent."""
        if not self.stopped:
            self.stopped = True
            self.send(("stop",))

    def send(self, msg: tuple) -> None:
        import torch.distributed as dist

        if self.lost is not None:
            raise self.lost
        try:
            dist.broadcast_object_list([msg], src=self.src, group=self.group)
        except Exception as e:
            raise self._broke(e) from e

    def _broke(self, err: BaseException) -> GroupLost:
        """The group cannot run another forward: a collective failed (a peer died, or hung past the
        timeout) or the lead's forward failed while the followers ran theirs (they now wait in
        a collective the lead skipped, out of step for good)."""
        wait = "the group's collective timeout"
        if self.timeout_s is not None:
            wait = f"the {self.timeout_s:.0f} s collective timeout (--distributed-timeout)"
        self.lost = GroupLost(
            f"the tensor-parallel group broke on its lead rank ({type(err).__name__}: {err}): a peer rank died, "
            f"or hung past {wait}, or a forward failed on the lead and left the ranks out of step; this group "
            "runs no more forwards"
        )
        return self.lost

    def bind(self, pool: KVCache | PagedKV | None) -> None:
        super().bind(pool)
        if isinstance(pool, PagedKV):
            self.send(("bind_paged", pool.k[0].shape[0], pool.block_size))
        elif pool is not None:
            self.send(("bind", pool.k[0].shape[0], pool.length))

    def move_rows(self, moves) -> None:
        if not isinstance(self.rows.pool, PagedKV):  # paged: nothing to copy anywhere
            self.send(("move", moves))
        super().move_rows(moves)

    def copy_blocks(self, pairs) -> None:
        if pairs:
            self.send(("copy", pairs))
        super().copy_blocks(pairs)

    def __call__(self, inputs: ForwardInputs):
        self.send(("run", _on_host(inputs)))
        try:
            return super().__call__(inputs)
        except Exception as e:
            raise self._broke(e) from e


class GroupLost(DinferError):
    """A model-parallel group can run no more forwards (``LeadRunner``): its replica stops."""


def _on_host(inputs: ForwardInputs) -> ForwardInputs:
    """The inputs with host tensors: a device tensor would unpickle onto the lead's device index
    on another rank. (A device-resident sequence then costs one copy to the host per forward; a
    tensor broadcast on the device would not, and is not built.)"""

    def host(t):
        return t.cpu() if isinstance(t, torch.Tensor) else t

    rows = inputs.rows
    if rows is not None:
        rows = RowWindows(host(rows.token_index), host(rows.positions), host(rows.key_valid))
    return dataclasses.replace(
        inputs, input_ids=host(inputs.input_ids), attention_mask=host(inputs.attention_mask),
        compute=host(inputs.compute), rows=rows, select=host(inputs.select), block_table=host(inputs.block_table),
    )  # fmt: skip


def on_rank(model: Model) -> LeadRunner | None:
    """This rank's part under a process group someone started (``torchrun``, ``parallel.launch``):
    the lead of the model's tensor-parallel group gets its :class:`LeadRunner` (to drive the
    engine and ``stop()`` at the end); every other rank follows the lead here until it stops,
    and gets None (its work is done)."""
    import torch.distributed as dist

    from dinfer_rt.ir import ops

    group = ops.COLLECTIVE_GROUPS.get("tp")
    if group is None:
        raise DinferError("on_rank: no tensor-parallel group (parallel.init_group was not called)")
    src = 0 if group is dist.group.WORLD else dist.get_global_rank(group, 0)
    if dist.get_rank() != src:
        follow(model, group, src)
        return None
    return LeadRunner(model, group, src)


def follow(model: Model, group, src: int, alive: Callable[[], bool] = lambda: True) -> int:
    """A follower rank's loop: run what the lead sends until it says stop (or a collective fails
    because a peer died: the caller reports it). ``alive`` is asked after each message. Returns
    the number of forwards run."""
    import torch.distributed as dist

    rows = CachePoolRows()
    forwards = 0
    while alive():
        box: list = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        msg = box[0]
        kind = msg[0]
        if kind == "run":
            run_rows(model, msg[1], rows)
            forwards += 1
        elif kind == "bind":
            pool = rows.pool
            if not isinstance(pool, KVCache) or (pool.k[0].shape[0], pool.length) != (msg[1], msg[2]):
                pool = model.new_cache(msg[1], msg[2])
            else:  # a pool lent again is zeroed, as the lead's is (``CachePool.acquire``)
                for t in (*pool.k, *pool.v):
                    t.zero_()
            rows = CachePoolRows(pool)
        elif kind == "bind_paged":
            pool = rows.pool
            if not isinstance(pool, PagedKV) or (pool.k[0].shape[0], pool.block_size) != (msg[1], msg[2]):
                k, v = model.new_paged_pool(msg[1], msg[2])
                pool = PagedKV(k, v, torch.zeros((0, 0), dtype=torch.int32), 0)
            rows = CachePoolRows(pool)
        elif kind == "copy":
            rows.copy_blocks(msg[1])
        elif kind == "move":
            rows.move(msg[1])
        elif kind == "stop":
            return forwards
        elif kind != "idle":
            raise DinferError(f"follower rank: unknown message {kind!r} from the lead")
    return forwards
