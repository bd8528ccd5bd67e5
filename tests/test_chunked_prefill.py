"""Chunked prefill (issue #40 point 4): a long prompt of a block-causal model is computed in whole
blocks over several steps beside the running rows, within the step's token budget, and decodes
exactly as alone; the running rows' answers do not change. Tiny SDAR / LLaDA2 checkpoints on
the CPU; bidirectional families keep one first forward."""

from __future__ import annotations

import pytest
import torch

import dinfer_rt
from dinfer_rt.engine import Engine
from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import GenerationError
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing import checkpoints

LB = 4
BUDGET = 24  # query slots per step: the long prompt's first forward (76) would not fit


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict = {}
    writers = {"sdar": checkpoints.sdar, "llada2": checkpoints.llada2, "llada": checkpoints.llada}

    def get(name: str):
        if name not in made:
            made[name] = dinfer_rt.load_model(writers[name](tmp_path_factory.mktemp(name)), backend="cpu")
        return made[name]

    return get


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 60, (n,), generator=g).tolist()


SHORT = [_prompt(5, 1), _prompt(7, 2)]
LONG = _prompt(70, 3)  # 17 whole blocks and a tail of 2

CONFIGS = [
    dict(strategy="threshold", threshold=0.2, cache="dual"),
    dict(strategy="low_confidence", cache="prefix"),
    dict(strategy="threshold", threshold=0.2, cache="delayed"),
    dict(strategy="entropy", cache="vicinity", vicinity_before=4, vicinity_warmup=0),
    dict(strategy="random", temperature=0.7, seed=3, cache="dual"),  # logits path, sampled
]


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"gen_length": 12, "block_length": LB, **kw})


def _alone(model, prompt, params) -> list[int]:
    return dinfer_rt.LLM(model).generate([prompt], params)[0].token_ids


def _run_beside(model, params, **engine_kw):
    """Two short requests running, then the long one: (engine, short requests, the long one, real
    query slots per step, whether the long one ran while a short one still did)."""
    engine = Engine(model, max_num_seqs=3, max_num_batched_tokens=BUDGET, block_length=LB, **engine_kw)
    short = [engine.submit(p, params) for p in SHORT]
    engine.step()
    long = engine.submit(LONG, params)
    per_step, beside = [], False
    while engine.has_work():
        before = engine.stats.computed_tokens - engine.stats.padded_tokens
        engine.step()
        per_step.append(engine.stats.computed_tokens - engine.stats.padded_tokens - before)
        beside |= long.status == "running" and not all(r.done for r in short)
    for req in (*short, long):
        assert req.error is None, req.error
    return engine, short, long, per_step, beside


# every (family, config) pair the family accepts: SDAR's KV rule refuses ``delayed``
# (``model_spec.exact_cache_policies``), so that pair is not a case
CASES = [
    (name, cfg) for name in ("sdar", "llada2") for cfg in CONFIGS if not (name == "sdar" and cfg["cache"] == "delayed")
]


@pytest.mark.parametrize(
    ("name", "cfg"), CASES, ids=lambda c: c if isinstance(c, str) else f"{c['strategy']}-{c['cache']}"
)
def test_long_prompt_beside_running_rows_is_exact_and_within_budget(models, name, cfg):
    model = models(name)
    params = _params(**cfg)
    engine, short, long, per_step, beside = _run_beside(model, params, prefix_cache_bytes=0)
    assert long.output_ids == _alone(model, LONG, params)[: len(long.output_ids)]
    assert len(long.output_ids) == 12 or long.finish_reason == "stop"
    for p, req in zip(SHORT, short):  # the running rows' answers are unchanged
        assert req.output_ids == _alone(model, p, params)[: len(req.output_ids)]
    assert engine.stats.prefill_chunks >= 3  # 68 prompt positions, at most 16 a step beside the rows
    assert engine.stats.prefill_tokens == 68
    assert max(per_step) <= BUDGET  # every step's computed query slots (padding aside) within the budget
    assert beside  # it prefilled while the short rows ran
    # the same engine without chunking: the same answers, but the long prompt waited for the rows to end
    off, short_off, long_off, _, beside_off = _run_beside(
        model, params, prefix_cache_bytes=0, max_prefill_chunk_tokens=0
    )
    assert off.stats.prefill_chunks == 0 and not beside_off
    assert long_off.output_ids == long.output_ids
    assert [r.output_ids for r in short_off] == [r.output_ids for r in short]


def test_editing_rule_and_prefix_cache_hit_with_chunks(models):
    """LLaDA2.1's editing rule, and a second long prompt sharing the first one's blocks: its
    cached prefix is copied, the rest chunked; both equal their lone answers."""
    model = models("llada2")
    params = _params(strategy="joint_threshold", threshold=0.3, edit_threshold=0.5, cache="dual")
    engine = Engine(model, max_num_seqs=3, max_num_batched_tokens=BUDGET, block_length=LB)
    first = engine.submit(LONG, params)
    engine.run_until_idle()
    other = LONG[:40] + _prompt(30, 9)  # 10 blocks shared, then different
    runner = engine.submit(SHORT[0], params)
    engine.step()
    second = engine.submit(other, params)
    chunks = engine.stats.prefill_chunks
    engine.run_until_idle()
    assert second.cached_tokens == 40 and engine.stats.prefill_chunks > chunks
    assert first.output_ids == _alone(model, LONG, params)[: len(first.output_ids)]
    assert second.output_ids == _alone(model, other, params)[: len(second.output_ids)]
    assert runner.output_ids == _alone(model, SHORT[0], params)[: len(runner.output_ids)]


def test_chunk_bound_and_a_lone_long_prompt(models):
    """``max_prefill_chunk_tokens`` bounds each chunk (whole blocks), even with nothing else
    running; a lone prompt over the budget is chunked too instead of one oversized forward."""
    model = models("sdar")
    params = _params(strategy="threshold", threshold=0.2, cache="dual")
    engine = Engine(model, max_num_seqs=2, block_length=LB, prefix_cache_bytes=0, max_prefill_chunk_tokens=10)
    sizes = []
    real = engine.runner

    def spy(inputs):
        if inputs.compute is not None:
            sizes.append(len(inputs.compute))
        return real(inputs)

    engine.runner = spy
    req = engine.submit(LONG, params)
    engine.run_until_idle()
    assert req.output_ids == _alone(model, LONG, params)[: len(req.output_ids)]
    assert engine.stats.prefill_chunks == 9 and engine.stats.prefill_tokens == 68  # 8 blocks a chunk: 8 x 8 + 4
    assert max(sizes) <= 8
    lone = Engine(model, max_num_seqs=2, max_num_batched_tokens=16, block_length=LB, prefix_cache_bytes=0)
    req = lone.submit(LONG, params)
    lone.run_until_idle()
    assert lone.stats.prefill_chunks == 5 and req.output_ids == _alone(model, LONG, params)[: len(req.output_ids)]


def test_abort_while_prefilling_frees_the_row(models):
    model = models("sdar")
    params = _params(strategy="threshold", threshold=0.2, cache="dual")
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=BUDGET, block_length=LB, prefix_cache_bytes=0)
    runner = engine.submit(SHORT[0], params)
    engine.step()
    long = engine.submit(LONG, params)
    queued = engine.submit(SHORT[1], params)
    engine.step()
    assert engine.prefilling and long.status == "running" and queued.status == "waiting"
    engine.abort(long.id)
    engine.run_until_idle()
    assert long.finish_reason == "abort" and not engine.prefilling
    assert runner.output_ids == _alone(model, SHORT[0], params)[: len(runner.output_ids)]
    assert queued.output_ids == _alone(model, SHORT[1], params)[: len(queued.output_ids)]


def test_bidirectional_families_keep_one_first_forward(models):
    """LLaDA's prompt K/V depend on the whole sequence: no chunks, the prompt waits for room."""
    model = models("llada")
    params = SamplingParams(gen_length=8, block_length=4, strategy="threshold", threshold=0.2, cache="dual")
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=BUDGET)
    engine.submit(SHORT[0], params)
    engine.step()
    long = engine.submit(LONG, params)
    engine.step()
    assert long.status == "waiting"
    engine.run_until_idle()
    assert engine.stats.prefill_chunks == 0 and long.output_ids == _alone(model, LONG, params)[: len(long.output_ids)]


def test_engine_arg_is_validated(models):
    assert EngineArgs(max_prefill_chunk_tokens=0).validate().max_prefill_chunk_tokens == 0
    with pytest.raises(GenerationError, match="max_prefill_chunk_tokens"):
        EngineArgs(max_prefill_chunk_tokens=-1).validate()
    # a bidirectional model never chunks its prompt: a cap there would be ignored, so it is refused
    with pytest.raises(GenerationError, match="max_prefill_chunk_tokens 64 needs a block-causal model"):
        Engine(models("llada"), max_prefill_chunk_tokens=64)
    Engine(models("llada"), max_prefill_chunk_tokens=0).release()  # "off" is what it does anyway


def test_served_chunks_are_counted_in_metrics(models):
    """``/metrics`` counts the chunked-prefill forwards (``dinfer_prefill_chunks_total``) of a
    served long prompt, as many as the engine ran (exactness: the engine tests above)."""
    from fastapi.testclient import TestClient

    from dinfer_rt.server import ServeConfig, build_app

    model = models("llada2")
    params = _params(strategy="threshold", threshold=0.2, cache="dual")
    app = build_app(model, params, ServeConfig(max_num_seqs=2, max_num_batched_tokens=BUDGET))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 12})
        assert r.status_code == 200, r.text
        metrics = client.get("/metrics").text
    chunks = [line for line in metrics.splitlines() if line.startswith("dinfer_prefill_chunks_total ")]
    assert chunks and float(chunks[0].split()[1]) >= 3, chunks  # 68 prompt positions, 24 query slots a step
    assert app.state.engine.stats.prefill_chunks == float(chunks[0].split()[1])
    assert r.json()["usage"]["completion_tokens"] <= 12
