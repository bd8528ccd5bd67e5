"""Device graphs per batch-size bucket in the engine (issue #37 point 2, #41 point 1), on the CPU:
the cpu backend's executables wrapped in the graph cache with a stand-in API that replays by
re-running (``backends/triton/graphs.py``), so the bookkeeping (buckets, padding, eager
fallbacks, counters, warm-up) runs here; the capture itself needs a GPU (``gpu_check.py``)."""

from __future__ import annotations

import pytest
import torch

import dinfer_rt
from dinfer_rt.engine import Engine, run_batch
from dinfer_rt.engine_args import EngineArgs, default_graph_batch_sizes, graph_buckets
from dinfer_rt.errors import GenerationError
from dinfer_rt.sampling import SamplingParams

# logits (no confidence head): every window's shapes are fixed, so the captures are countable
PARAMS = SamplingParams(strategy="threshold", threshold=0.7, cache="dual", gen_length=8, block_length=4)
ARGS = {"confidence_head": False, "prefix_cache_bytes": 0}


class ReplayByRerun:
    """CPU stand-in for torch.cuda graphs: capture runs the function (warm-up, then once more,
    keeping its outputs as the static buffers); replay re-runs it into those buffers. Records
    the batch rows of each capture."""

    def __init__(self):
        self.rows: list[int] = []

    def capture(self, fn, warmup):
        for _ in range(warmup):
            fn()
        outputs = fn()

        class Graph:
            def replay(self):
                for name, t in fn().items():
                    outputs[name].copy_(t)

        head = next(t for name, t in outputs.items() if not name.startswith(("k_cache.", "v_cache.")))
        self.rows.append(int(head.shape[0]))  # not a cache's: a paged pool's first dim is its blocks
        return Graph(), outputs


def graphed_model(path, monkeypatch):
    """A cpu model whose backend 'replays graphs' through the stand-in (what cuda / ascend with
    DINFER_GRAPHS=1 get at load: GraphedExecutable, and a cache pool that keeps its caches)."""
    from dinfer_rt.backends.triton.graphs import GraphedExecutable

    model = dinfer_rt.load_model(path, backend="cpu")
    api = ReplayByRerun()
    compile_eager = model.backend.compile
    monkeypatch.setattr(model.backend, "compile", lambda g, w: GraphedExecutable(compile_eager(g, w), api))
    monkeypatch.setattr(model.backend, "replays_graphs", lambda: True)
    model.cache_pool.keep = 2
    return model, api


def prompts(n: int, length: int = 5, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 50, (n, length), generator=g).tolist()


def decode(engine: Engine, batch: list[list[int]], params=PARAMS) -> list[list[int]]:
    reqs = engine.submit_batch(batch, params)
    engine.run_until_idle()
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def reference(ckpt_dir):
    return dinfer_rt.load_model(ckpt_dir("llada"), backend="cpu")


def eager(reference, batch, params=PARAMS) -> list[list[int]]:
    return [r.output_ids for r in run_batch(reference, batch, params, args=EngineArgs(**ARGS)).requests]


def test_default_buckets_and_their_checks():
    assert default_graph_batch_sizes(1) == (1,)
    assert default_graph_batch_sizes(3) == (1, 2, 4)
    assert default_graph_batch_sizes(16) == (1, 2, 4, 8, 16)
    assert default_graph_batch_sizes(17) == (1, 2, 4, 8, 16, 24)
    assert len(default_graph_batch_sizes(256)) == 35  # not one per row count
    assert graph_buckets(EngineArgs(graph_batch_sizes=(8, 2, 2))) == (2, 8)
    for bad in ({"graphs": 1}, {"graph_batch_sizes": ()}, {"graph_batch_sizes": (0,)}, {"graph_batch_sizes": 4}):
        with pytest.raises(GenerationError, match="graph"):
            EngineArgs.build(**bad)


def test_graphs_true_where_the_backend_replays_none_is_refused(reference):
    with pytest.raises(GenerationError, match="replays no device graphs"):
        Engine(reference, graphs=True)
    engine = Engine(reference)  # the cpu default: eager, the runner itself, no padding
    assert not engine.graphs and engine._inner_runner is engine.runner and engine.pool_rows == 16


def test_batches_of_every_size_capture_once_per_bucket_with_eager_tokens(ckpt_dir, monkeypatch, reference):
    """Static batches of 1..8 rows through one engine (the pool of a server): each runs padded to
    its bucket (1, 2, 4, 8), tokens equal the eager backend's, and the graphs captured are one
    per (bucket, window shape): the dual cache's refresh and block step, not one per row count."""
    model, api = graphed_model(ckpt_dir("llada"), monkeypatch)
    engine = Engine(model, max_num_seqs=8, **ARGS)
    assert engine.graph_buckets == (1, 2, 4, 8) and engine.pool_rows == 8
    for size in (1, 3, 5, 2, 4, 8, 6, 7):
        batch = prompts(size, seed=size)
        assert decode(engine, batch) == eager(reference, batch), size
    stats = engine.graph_stats()
    assert sorted(set(api.rows)) == [1, 2, 4, 8]
    assert stats["captures"] == len(api.rows) == 2 * 4  # (refresh, block step) x 4 buckets
    assert stats["captures_by_rows"] == {1: 2, 2: 2, 4: 2, 8: 2}
    assert stats["eager_forwards"] == 0 and stats["eager_calls"] == 0 and stats["evictions"] == 0
    assert stats["replays"] == engine.stats.graph_forwards - stats["captures"]
    assert stats["padded_rows"] > 0 and engine.stats.padded_rows == stats["padded_rows"]
    assert stats["graph_bytes"] == 0  # the stand-in API holds no device memory


def test_served_requests_arriving_at_different_batch_sizes_equal_eager(ckpt_dir, monkeypatch, reference):
    """Requests arriving in waves of 1, 3 and 5 (one cohort each, merged at admission), then a
    wave beside a running cohort (per-row windows: eager): each request's tokens equal its eager
    decode alone; lockstep forwards replay their bucket's graphs, per-row ones capture nothing."""
    model, api = graphed_model(ckpt_dir("llada"), monkeypatch)
    engine = Engine(model, max_num_seqs=8, **ARGS)
    waves = [prompts(k, seed=10 + k) for k in (1, 3, 5)]
    for wave in waves:
        reqs = [engine.submit(p, PARAMS) for p in wave]
        engine.run_until_idle()
        assert [r.output_ids for r in reqs] == [eager(reference, [p])[0] for p in wave]
    assert sorted(set(api.rows)) == [1, 4, 8] and engine.graph_stats()["captures"] == 6
    first = engine.submit(prompts(1, seed=40)[0], PARAMS)
    engine.step()
    later = [engine.submit(p, PARAMS) for p in prompts(2, seed=41)]  # join mid-stream: per-row windows
    engine.run_until_idle()
    assert engine.stats.per_row_steps > 0 and engine.stats.eager_forwards >= engine.stats.per_row_steps
    for req in (first, *later):
        assert req.output_ids == eager(reference, [req.prompt])[0]
    assert all(rows in (1, 2, 4, 8) for rows in api.rows)  # per-row shapes never captured


def test_a_batch_above_the_largest_bucket_runs_eager_and_captures_nothing(ckpt_dir, monkeypatch, reference):
    model, api = graphed_model(ckpt_dir("llada"), monkeypatch)
    engine = Engine(model, max_num_seqs=4, graph_batch_sizes=(1, 2), **ARGS)
    assert engine.pool_rows == 4  # no bucket holds 4 rows: the pool is max_num_seqs'
    batch = prompts(3, seed=3)
    assert decode(engine, batch) == eager(reference, batch)
    assert api.rows == [] and engine.stats.graph_forwards == 0
    assert engine.stats.eager_forwards == engine.stats.steps > 0
    assert engine.graph_stats()["eager_calls"] == engine.stats.steps


@pytest.mark.parametrize("confidence", [False, True])
def test_padded_forward_leaves_the_real_rows_as_unpadded(reference, confidence):
    """A forward padded by 2 rows: the real rows' outputs and K/V equal the unpadded forward's
    bit for bit, and the pad rows write only the pool rows after them."""
    from dinfer_rt.model_runner import ForwardInputs, LocalRunner

    model = reference
    n, b = 10, 3
    ids = torch.tensor(prompts(b, length=n, seed=2))
    attn = torch.ones(b, n, dtype=torch.long)
    attn[0, :2] = 0
    outs, pools = [], []
    for pad in (0, 2):
        pool = model.new_cache(6, n + 1)
        sentinel = pool.k[0][5].clone()
        runner = LocalRunner(model)
        runner.bind(pool)
        select = torch.arange(6, 10) if confidence else None
        for compute in (None, torch.arange(6, 10)):  # the refresh, then a block step
            out = runner(ForwardInputs(ids, attn, compute=compute, cache=(0, b, n), select=select, pad_rows=pad))
        outs.append(tuple(o.clone() for o in out) if confidence else out.clone())
        pools.append(pool)
        assert torch.equal(pool.k[0][5], sentinel)  # rows past the padding untouched
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for k0, k1 in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v):
        assert torch.equal(k0[:b], k1[:b])
    assert pools[1].k[0][b : b + 2].abs().sum() > 0 and pools[0].k[0][b : b + 2].abs().sum() == 0


def test_padding_is_skipped_when_the_next_rows_are_taken(ckpt_dir, monkeypatch, reference):
    """Without the scratch slot every cohort runs its own lockstep forward: a cohort of 3 rows
    followed by one of 2 cannot pad to 4 (row 3 is the next cohort's) and runs eager, the last
    cohort (2 rows, a bucket) replays; both decode as eager."""
    model, api = graphed_model(ckpt_dir("llada"), monkeypatch)
    engine = Engine(model, max_num_seqs=8, scratch_slot=False, **ARGS)
    a, b = prompts(3, seed=5), prompts(2, seed=6)
    ra, rb = engine.submit_batch(a, PARAMS), engine.submit_batch(b, PARAMS)
    engine.run_until_idle()
    assert [r.output_ids for r in ra] == eager(reference, a)
    assert [r.output_ids for r in rb] == eager(reference, b)
    assert engine.stats.eager_forwards > 0 and engine.stats.graph_forwards > 0
    assert 4 not in api.rows and 2 in api.rows


def test_graphs_false_opts_out(ckpt_dir, monkeypatch, reference):
    model, api = graphed_model(ckpt_dir("llada"), monkeypatch)
    engine = Engine(model, max_num_seqs=4, graphs=False, **ARGS)
    batch = prompts(3, seed=7)
    assert decode(engine, batch) == eager(reference, batch)
    assert api.rows == [] and engine.stats.eager_forwards == engine.stats.steps
    assert engine.pool_rows == 4 and engine.graph_stats()["buckets"] == []


def test_warm_up_captures_the_buckets_before_the_first_request(ckpt_dir, monkeypatch, reference):
    """``capture_graphs`` runs one short static batch per bucket through the engine's pool: the
    requests of that shape that follow capture nothing; the engine's counters start from zero."""
    model, api = graphed_model(ckpt_dir("llada"), monkeypatch)
    engine = Engine(model, max_num_seqs=6, **ARGS)
    warm = engine.capture_graphs(PARAMS, prompt_len=5)
    assert engine.graph_buckets == (1, 2, 4, 8) and engine.pool_rows == 8
    assert warm["captures_by_rows"] == {1: 2, 2: 2, 4: 2, 8: 2}  # 8: the padded batch of 6
    assert engine.stats.steps == 0 and not engine.forward_s
    for size in (2, 6, 1, 3):
        batch = prompts(size, seed=20 + size)
        assert decode(engine, batch) == eager(reference, batch)
    assert engine.graph_stats()["captures"] == warm["captures"]


def test_dream_left_padded_batches_with_the_confidence_head(ckpt_dir, monkeypatch):
    """Dream (shifted logits, positions from the padding) with prompts of different lengths and
    the confidence head: padded bucket forwards give the eager tokens."""
    path = ckpt_dir("dream")
    model, api = graphed_model(path, monkeypatch)
    ref = dinfer_rt.load_model(path, backend="cpu")
    params = SamplingParams(strategy="threshold", threshold=0.7, cache="dual", gen_length=8, block_length=4)
    engine = Engine(model, max_num_seqs=8, prefix_cache_bytes=0)
    batch = [p[: 3 + i] for i, p in enumerate(prompts(3, length=6, seed=9))]
    assert decode(engine, batch, params) == [r.output_ids for r in run_batch(ref, batch, params).requests]
    assert api.rows and set(api.rows) == {4} and engine.stats.padded_rows > 0


def test_gpu_check_section_runs_on_the_cpu(monkeypatch):
    """``benchmarks/gpu_check.py``'s engine_graph_buckets section, prepared for a device run, runs
    here over the embedded model with the stand-in API: graphed tokens equal eager, a static batch
    sharing a bucket captures nothing new, the report renders."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_check

    from dinfer_rt.backends.triton.graphs import GraphedExecutable

    monkeypatch.setattr(gpu_check, "DEV", "cpu")
    model = dinfer_rt.LLM(backend="cpu").model
    api = ReplayByRerun()
    compile_eager = model.backend.compile
    monkeypatch.setattr(model.backend, "compile", lambda g, w: GraphedExecutable(compile_eager(g, w), api))
    monkeypatch.setattr(model.backend, "replays_graphs", lambda: True)
    model.cache_pool.keep = 2
    out = gpu_check.engine_graph_buckets("cpu", model=model, sizes=(3, 4), limit=6, max_num_seqs=4)
    assert out["burst_equal_outputs"] == "6/6" and [r["equal"] for r in out["static_batches"]] == ["3/3", "4/4"]
    assert [r["bucket"] for r in out["static_batches"]] == [4, 4]
    assert out["static_batches"][1]["new_captures"] == 0 or out["evictions"] > 0
    assert out["lengths_equal"] == "4/4" and len(set(out["lengths_prompt_tokens"])) > 1
    assert out["lengths_new_captures_after_first"] == 0 or out["evictions"] > 0
    assert set(out["captures_by_rows"]) <= set(out["buckets"])
    lines = gpu_check.render({"device": "cpu", "engine_graph_buckets": out, "section_s": {"engine_graph_buckets": 1}})
    assert any("graph memory" in line for line in lines)


def test_the_server_warms_the_buckets_up_and_reports_them(monkeypatch):
    """``build_app`` over a model whose backend replays graphs captures every bucket for the
    served defaults before the first request; /metrics reports the captures."""
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    from dinfer_rt.backends.triton.graphs import GraphedExecutable
    from dinfer_rt.server import ServeConfig, build_app

    model = dinfer_rt.LLM(backend="cpu").model
    api = ReplayByRerun()
    compile_eager = model.backend.compile
    monkeypatch.setattr(model.backend, "compile", lambda g, w: GraphedExecutable(compile_eager(g, w), api))
    monkeypatch.setattr(model.backend, "replays_graphs", lambda: True)
    model.cache_pool.keep = 2
    defaults = SamplingParams(strategy="threshold", block_length=8, gen_length=16)
    app = build_app(model, defaults, ServeConfig(max_num_seqs=2), engine_thread=False)
    engine = app.state.engine
    assert engine.graph_buckets == (1, 2) and sorted(set(api.rows)) == [1, 2]
    text = app.state.metrics.text(engine).decode()
    assert f"dinfer_graph_captures {float(len(api.rows))}" in text


# ---------------------------------------------------------------- length buckets (graph_length_step)


def test_length_buckets_round_up_within_the_pool():
    from dinfer_rt.graph_buckets import GraphBuckets

    class Replays:
        name = "stand-in"

        def replays_graphs(self):
            return True

    buckets = GraphBuckets(Replays(), EngineArgs(graph_length_step=16))
    assert [buckets.length_of(n, limit=40) for n in (1, 16, 17, 33, 40)] == [16, 16, 32, 40, 40]
    assert buckets.length_of(50, limit=40) == 50  # never below the sequence
    assert GraphBuckets(Replays(), EngineArgs(graph_length_step=0)).length_of(13, limit=40) == 13
    with pytest.raises(GenerationError, match="graph_length_step"):
        EngineArgs.build(graph_length_step=-1)


@pytest.mark.parametrize("confidence", [False, True])
@pytest.mark.parametrize("window", ["whole", "block", "uncached"])
def test_length_padded_forward_leaves_the_real_positions_as_unpadded(reference, confidence, window):
    """A forward whose sequence is padded by 6 positions (masked keys; a whole-sequence window also
    computes them, its extra outputs dropped): the outputs and the sequence's K/V equal the
    unpadded forward's within float32 rounding (more keys and query rows change the kernels'
    blocking, as a batch-size bucket does on a device; the tokens are checked equal below), and
    nothing is written past the bucket."""
    from dinfer_rt.model_runner import ForwardInputs, LocalRunner

    model = reference
    n, b, grow = 10, 3, 6
    ids = torch.tensor(prompts(b, length=n, seed=4))
    attn = torch.ones(b, n, dtype=torch.long)
    attn[1, :3] = 0
    compute = {"whole": None, "block": torch.arange(6, 10), "uncached": None}[window]
    cached = window != "uncached"
    select = torch.arange(6, 10) if confidence else None
    outs, pools = [], []
    for pad in (0, grow):
        pool = model.new_cache(4, n + grow + 1)
        runner = LocalRunner(model)
        runner.bind(pool)
        inputs = ForwardInputs(
            ids, attn, compute=compute, cache=(0, b, n) if cached else None, select=select, pad_length=pad,
            pad_rows=1 if pad else 0,
        )  # fmt: skip
        out = runner(inputs)
        outs.append(tuple(o.clone() for o in out) if confidence else out.clone())
        pools.append(pool)
    if confidence:  # (score, argmax): the same tokens, scores within rounding
        assert torch.equal(outs[0][1], outs[1][1])
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    if cached:
        for k0, k1 in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v):
            torch.testing.assert_close(k0[:b, :n], k1[:b, :n], rtol=1e-4, atol=1e-5)
            assert k1[:, n + grow :].abs().sum() == 0  # the scratch slot past the bucket untouched


@pytest.mark.parametrize("cache", ["dual", "prefix", "none"])
def test_prompts_of_many_lengths_share_one_capture_per_length_bucket(ckpt_dir, monkeypatch, reference, cache):
    """Lone requests with prompts of 3, 5 and 7 tokens (sequences of 11, 13 and 15 positions): with
    ``graph_length_step`` 16 they pad to one length and capture each window shape once; with 0 every
    length captures its own. Tokens equal the eager decode alone either way."""
    params = SamplingParams(strategy="threshold", threshold=0.7, cache=cache, gen_length=8, block_length=4)
    batch = [p[:k] for k, p in zip((3, 5, 7), prompts(3, length=7, seed=30))]
    want = [eager(reference, [p], params)[0] for p in batch]
    captured = {}
    for step in (16, 0):
        model, api = graphed_model(ckpt_dir("llada"), monkeypatch)
        model._compiled.clear()  # the uncached executable compiled at load: graphed as on a device
        engine = Engine(model, max_num_seqs=2, graph_length_step=step, **ARGS)
        assert [decode(engine, [p], params)[0] for p in batch] == want, step
        captured[step] = engine.graph_stats()["captures"]
        assert (engine.stats.padded_positions > 0) == (step > 0)
    # dual: the refresh and the block step; prefix: the refresh and one [s, n) suffix per block
    shapes = {"dual": 2, "prefix": 3, "none": 1}[cache]
    assert captured[16] == shapes and captured[0] == 3 * shapes, captured


@pytest.mark.parametrize("name", ["dream", "llada2"])
def test_length_buckets_with_shifted_logits_and_block_causal_masks(ckpt_dir, monkeypatch, name):
    """Dream (shifted logits, positions from the left padding) and LLaDA2 (block-causal) with the
    confidence head and batches of prompts of different lengths: length-padded bucket forwards give
    the eager tokens."""
    path = ckpt_dir(name)
    model, api = graphed_model(path, monkeypatch)
    ref = dinfer_rt.load_model(path, backend="cpu")
    params = SamplingParams(strategy="threshold", threshold=0.7, gen_length=8, block_length=4)
    engine = Engine(model, max_num_seqs=4, graph_length_step=16, prefix_cache_bytes=0)
    for size, seed in ((3, 11), (1, 12), (2, 13)):
        batch = [p[: 3 + 2 * i] for i, p in enumerate(prompts(size, length=8, seed=seed))]
        assert decode(engine, batch, params) == [r.output_ids for r in run_batch(ref, batch, params).requests]
    assert engine.stats.graph_forwards > 0 and engine.stats.padded_positions > 0


def test_the_graph_flags_reach_the_engine_args():
    from dinfer_rt.cli import _engine_args, build_parser

    parser = build_parser()
    a = parser.parse_args(["serve", "--graphs", "on", "--graph-batch-sizes", "1,4", "--graph-length-step", "64"])
    got = _engine_args(a)
    assert (got["graphs"], got["graph_batch_sizes"], got["graph_length_step"]) == (True, (1, 4), 64)
    assert _engine_args(parser.parse_args(["generate", "hello"]))["graph_length_step"] == 256
    assert EngineArgs.build(**_engine_args(a)).graph_length_step == 64


@pytest.mark.parametrize("confidence", [False, True])
def test_row_slices_of_an_uncached_forward_keep_their_own_replayed_outputs(
    ckpt_dir, monkeypatch, reference, confidence
):
    """A batch run in row slices (``max_forward_tokens``) without a cache: every slice replays the
    same graph (no pool address tells them apart), whose outputs are its static buffers; each
    slice's outputs are copied before the next replays, so the tokens equal eager ones."""
    params = SamplingParams(strategy="threshold", threshold=0.7, cache="none", gen_length=8, block_length=4)
    args = {"confidence_head": confidence, "prefix_cache_bytes": 0, "max_forward_tokens": 28}
    model, api = graphed_model(ckpt_dir("llada"), monkeypatch)
    model._compiled.clear()  # the uncached executable compiled at load: graphed as on a device
    engine = Engine(model, max_num_seqs=4, **args)
    batch = prompts(4, seed=50)
    want = [r.output_ids for r in run_batch(reference, batch, params, args=EngineArgs(**args)).requests]
    assert decode(engine, batch, params) == want
    assert engine.graph_stats()["replays"] > 0
