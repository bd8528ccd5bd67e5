"""Device graphs per batch-size bucket for the engine's lockstep forwards.

A captured device graph replays one shape, and a server's batch changes whenever a request
arrives or ends. So a one-window forward of b rows runs padded to the smallest bucket B >= b
(``EngineArgs.graph_batch_sizes``, default ``engine_args.default_graph_batch_sizes``) over pool
rows that no cohort holds: one capture per bucket and window shape serves every row count up to
B. The sequence pads alike to a length bucket (a multiple of ``graph_length_step`` positions:
masked keys, and dropped queries where the window is the whole sequence), so prompts of many lengths
share a capture too. Forwards outside the buckets run eagerly and capture nothing. This module decides bucket or
eager per forward, warms the buckets up and reports the captures; the graph caches themselves
live in the backends (``backends/triton/graphs.py``).
"""

from __future__ import annotations

import dataclasses

from dinfer_rt.engine_args import EngineArgs, graph_buckets
from dinfer_rt.errors import GenerationError
from dinfer_rt.model_runner import ForwardInputs
from dinfer_rt.sampling import SamplingParams

# ``stats`` below is the engine's ``EngineStats`` and ``engine`` its ``Engine``: not imported, as the
# engine imports this module (the core has no import cycle, lazy ones included)


class GraphBuckets:
    """Where the backend replays device graphs (and ``args.graphs`` is not False): the batch-size
    buckets, and per forward the bucket it pads to or eager. ``args.graphs=True`` on a backend
    that replays none is an error naming the backend."""

    def __init__(self, backend, args: EngineArgs) -> None:
        self.replays = backend.replays_graphs()
        if args.graphs and not self.replays:
            raise GenerationError(
                f"EngineArgs: graphs=True but backend {backend.name} replays no device graphs "
                "(cuda and ascend do with DINFER_GRAPHS=1)"
            )
        self.enabled = self.replays and args.graphs is not False
        self.sizes: tuple[int, ...] = graph_buckets(args) if self.enabled else ()
        self.length_step = args.graph_length_step
        # b -> its bucket, for every b up to the largest bucket (one lookup per forward)
        self._bucket_of = {b: next(x for x in self.sizes if x >= b) for b in range(1, (self.sizes or (0,))[-1] + 1)}

    def bucket_of(self, rows: int) -> int | None:
        """The bucket a forward of ``rows`` rows pads to; None: above the largest (eager)."""
        return self._bucket_of.get(rows)

    def length_of(self, n: int, limit: int) -> int:
        """The length bucket of an ``n``-position sequence: the next multiple of
        ``graph_length_step`` (0: ``n``), at most ``limit`` (the pool's positions, the model's
        max length) and never below ``n``."""
        step = self.length_step
        return n if not step else max(n, min(-(-n // step) * step, limit))

    def run(self, runner, inputs: ForwardInputs, *, used: int, pool_rows: int, positions: int, stats):
        """One forward: padded to its bucket B when the pool rows [start + b, start + B) hold no
        cohort (``used``: the rows cohorts hold; the padding rows' K/V land there and the runner
        drops their outputs), and its sequence to its length bucket (:meth:`length_of`, at most
        ``positions``); else eagerly (a batch above the largest bucket, per-row windows, the rows
        after it taken, graphs turned off)."""
        b = inputs.input_ids.shape[0]
        bucket = self._bucket_of.get(b) if self.enabled and inputs.rows is None else None
        if bucket is not None and bucket > b and inputs.cache is not None:
            start = inputs.cache[0]
            if start + b != used or start + bucket > pool_rows:
                bucket = None
        if bucket is None:
            stats.eager_forwards += 1
            return runner(dataclasses.replace(inputs, graph=False))
        stats.graph_forwards += 1
        n = inputs.input_ids.shape[1]
        grow = self.length_of(n, positions) - n
        stats.padded_rows += bucket - b
        stats.padded_positions += bucket * grow
        if bucket == b and not grow:
            return runner(inputs)
        return runner(dataclasses.replace(inputs, pad_rows=bucket - b, pad_length=grow))

    def report(self, model, stats) -> dict:
        """The model's device graphs: captures (in all and per batch rows), replays, eager calls,
        graphs dropped (LRU) and the device memory the live ones hold (0 with a stand-in API or
        without graphs), beside the engine's bucket counters."""
        caches = [exe.graphs for exe in model._compiled.values() if hasattr(exe, "graphs")]
        by_rows: dict[int, int] = {}
        for g in caches:
            for rows, n in g.captures_by_rows.items():
                by_rows[rows] = by_rows.get(rows, 0) + n
        return {
            "enabled": self.enabled,
            "buckets": list(self.sizes),
            "captures": sum(g.captures for g in caches),
            "captures_by_rows": dict(sorted(by_rows.items())),
            "replays": sum(g.replays for g in caches),
            "eager_calls": sum(g.eager for g in caches),
            "evictions": sum(g.evictions for g in caches),
            "graph_bytes": sum(g.nbytes for g in caches),
            "graph_forwards": stats.graph_forwards,
            "eager_forwards": stats.eager_forwards,
            "padded_rows": stats.padded_rows,
            "length_step": self.length_step,
            "padded_positions": stats.padded_positions,
        }

    def warm_up(self, engine, params: SamplingParams, prompt_len: int) -> None:
        """One short static batch per bucket (at most ``max_num_seqs`` rows; a bucket above it
        serves the padded largest batch) through ``engine``'s own pool, so each bucket's window
        shapes for ``params`` and a ``prompt_len``-token prompt are captured before the first
        request (other shapes are captured on first use)."""
        params = params.for_model(engine.model.spec)
        n = min(prompt_len, max(1, engine.max_model_len - params.gen_length))
        prompt = [engine.model.pad_id] * n
        for bucket in self.sizes:
            rows = min(bucket, engine.max_num_seqs)
            if rows < bucket and bucket != self._bucket_of.get(engine.max_num_seqs):
                continue
            engine.submit_batch([list(prompt) for _ in range(rows)], params)
            engine.run_until_idle()
