"""The approximate prefix cache for bidirectional families (issue #40: ``--prefix-cache approximate``).

Off by default (a bidirectional model's prompt K/V depend on the generated tokens); on when
asked, for ``prefix`` / ``dual`` / ``vicinity`` requests, where a hit copies an earlier request's
first-forward prompt K/V and no forward of the new request recomputes them. Checked: the hits
and the compute they save (every refresh skips the cached prompt), that the reused K/V are the
earlier request's first forward (and not what the new request would compute: the approximation
is real), where the approximation vanishes (a one-block repeat decodes as cold), that policies
which recompute the prompt are left alone, that block-causal models stay exact, and the flag
and field errors. Tiny random checkpoints on the CPU."""

from __future__ import annotations

import argparse

import pytest
import torch

import dinfer_rt
from dinfer_rt.engine import APPROXIMATE_POLICIES, Engine
from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import DinferError, GenerationError
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing import checkpoints

LB = 4
SYSTEM = [7, 19, 8, 30, 9, 41, 10, 52, 11, 23, 12, 34, 13, 45]  # 14 tokens: 3 whole blocks and a tail
BIDIRECTIONAL = ["llada", "llada_moe", "dream"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict = {}
    writers = {
        "llada": checkpoints.llada,
        "llada_moe": checkpoints.llada_moe,
        "dream": checkpoints.dream,
        "sdar": checkpoints.sdar,
    }

    def get(name: str):
        if name not in made:
            made[name] = dinfer_rt.load_model(writers[name](tmp_path_factory.mktemp(name)), backend="cpu")
        return made[name]

    return get


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"gen_length": 8, "block_length": LB, "strategy": "threshold", "cache": "dual", **kw})


def _serve(engine: Engine, prompt: list[int], params: SamplingParams):
    """One request alone: (output ids, commit step per slot from its first forward, forwards,
    the request, query slots computed)."""
    first, computed = len(engine.forward_s), engine.stats.computed_tokens
    req = engine.submit(prompt, params)
    engine.run_until_idle()
    assert req.error is None, req.error
    steps = req.cohort.commit_step[0].cpu()
    return (
        req.output_ids,
        torch.where(steps >= 0, steps - first, steps).tolist(),
        req.forwards,
        req,
        engine.stats.computed_tokens - computed,
    )


def _approx(model, **kw) -> Engine:
    engine = Engine(model, max_num_seqs=2, prefix_cache="approximate", **kw)
    assert engine.prefix_cache is not None and engine.prefix_cache.approximate
    return engine


def _cold(model, prompt, params):
    return _serve(Engine(model, max_num_seqs=2, prefix_cache_bytes=0), prompt, params)


# ------------------------------------------------------------------------------ off by default


@pytest.mark.parametrize("family", BIDIRECTIONAL)
def test_off_by_default_on_a_bidirectional_model(models, family):
    """The default engine has no cache for a bidirectional family: a repeated prompt hits
    nothing and computes its whole prompt again; the start-up line says how to turn it on."""
    engine = Engine(models(family), max_num_seqs=2)
    assert engine.prefix_cache is None and engine.prefix_cache_mode == "off"
    assert "--prefix-cache approximate turns it on" in engine.prefix_cache_summary()
    first, again = (_serve(engine, SYSTEM + [20, 21], _params()) for _ in range(2))
    assert first[3].cached_tokens == again[3].cached_tokens == 0
    assert first[:3] == again[:3] and first[4] == again[4]


# ------------------------------------------------------------------------------ on when asked


@pytest.mark.parametrize("family", BIDIRECTIONAL)
@pytest.mark.parametrize("cache", APPROXIMATE_POLICIES)
def test_a_hit_reuses_the_prompt_blocks_and_no_refresh_recomputes_them(models, family, cache):
    """A request sharing the system prompt's 3 whole blocks with an earlier one hits 12 tokens;
    it computes 12 query slots fewer at every forward that recomputes the prompt in a cold run
    (prefix / dual: each block's first forward, 2 blocks here) and holds nothing once done."""
    model = models(family)
    params = _params(cache=cache)
    engine = _approx(model)
    assert (
        "approximate" in engine.prefix_cache_summary() and "may differ from a cold run" in engine.prefix_cache_summary()
    )
    first = _serve(engine, SYSTEM + [20, 21, 22], params)
    assert first[3].cached_tokens == 0 and engine.prefix_cache.stats.queries == 1
    # its first forward's whole prompt blocks were cached: 4 of its 17 tokens (Dream's last prompt
    # position, whose output predicts the first generated slot, is never cached: still 4 blocks)
    assert engine.prefix_cache.stats.blocks == 4
    prompt = SYSTEM + [25, 26, 27, 28, 29]
    warm = _serve(engine, prompt, params)
    cold = _cold(model, prompt, params)
    assert warm[3].cached_tokens == 12 and engine.prefix_cache.stats.hit_tokens == 12
    if cache in ("prefix", "dual"):
        assert cold[4] - warm[4] == 12 * (params.gen_length // LB)
    else:
        assert cold[4] - warm[4] >= 12
    assert len(warm[0]) == len(cold[0]) and engine.prefix_cache.held() == 0


@pytest.mark.parametrize("kv_block_size", [4, 0])
def test_the_reused_k_v_are_the_earlier_first_forwards_and_stay_frozen(models, kv_block_size):
    """After the hit decoded, the cached positions still hold exactly the K/V of the earlier
    request's first forward (its prompt and an all-masked answer), recomputed here independently:
    never overwritten by a refresh (contiguous: in its pool row; paged: in the shared blocks the
    row read, which copy-on-write keeps). They differ from the K/V its own first forward would
    compute (another tail, another answer): the reuse is an approximation."""
    model = models("llada")
    params = _params(gen_length=12)
    engine = Engine(model, max_num_seqs=1, prefix_cache="approximate", kv_block_size=kv_block_size)
    earlier, prompt = SYSTEM + [20, 21, 22], SYSTEM + [25, 26, 27, 28, 29]
    _serve(engine, earlier, params)
    chain = engine.prefix_cache.match(prompt, LB, 4)
    assert len(chain) == 3
    req = _serve(engine, prompt, params)[3]
    assert req.cached_tokens == 12 and req.cohort.cached_prefix == 12

    def first_forward(ids: list[int]):
        x = torch.tensor([ids + [model.mask_id] * params.gen_length])
        kv = model.new_cache(1, x.shape[1])
        model.forward(x, cache=kv)
        return kv

    theirs, own = first_forward(earlier), first_forward(prompt)
    for layer in range(len(engine.cache.k)):
        for i, ref, mine in ((0, theirs.k, own.k), (1, theirs.v, own.v)):
            cached = torch.cat([engine.cached_kv(node)[i][layer] for node in chain])
            kept = cached if kv_block_size else (engine.cache.k, engine.cache.v)[i][layer][0, :12]
            assert (kept - ref[layer][0, :12]).abs().max() < 1e-5
            assert torch.equal(cached, kept)
            if layer > 0:  # layer 0's K/V see only their own token: equal; deeper ones see the tail
                assert (kept - mine[layer][0, :12]).abs().max() > 1e-4


@pytest.mark.parametrize("family", BIDIRECTIONAL)
def test_a_one_block_repeat_decodes_as_cold(models, family):
    """Where the approximation vanishes, as documented: the same whole-block prompt with the
    same gen length, one block (its first forward is the only one that refreshes the prompt),
    reuses the prompt (16 tokens; Dream 12: its last prompt position is always computed) and
    decodes token for token, in the same order and forwards, as cold."""
    model = models(family)
    params = _params(gen_length=LB)
    engine = _approx(model)
    prompt = SYSTEM + [20, 21]
    _serve(engine, prompt, params)
    warm, cold = _serve(engine, prompt, params), _cold(model, prompt, params)
    hit = 12 if model.spec.shift_logits else 16
    assert warm[3].cached_tokens == hit
    assert warm[:3] == cold[:3]
    assert cold[4] - warm[4] == hit


def test_a_hit_beside_a_running_request_decodes_as_it_does_alone(models):
    """The hit's forwards share per-row forwards with a request already running: it decodes as
    the same hit served alone on an engine holding the same cache, and the other as cold."""
    model = models("llada")
    params, longer = _params(gen_length=12), _params(gen_length=16)
    warmup, other, hit = SYSTEM + [20, 21, 22], [s + 3 for s in SYSTEM] + [20], SYSTEM + [25, 26, 27]
    alone = _approx(model)
    _serve(alone, warmup, params)
    expected = _serve(alone, hit, params)
    engine = _approx(model)
    _serve(engine, warmup, params)
    req_a = engine.submit(other, longer)
    engine.step()
    before = engine.stats.per_row_steps
    req_b = engine.submit(hit, params)
    engine.run_until_idle()
    assert engine.stats.per_row_steps > before
    assert req_b.cached_tokens == expected[3].cached_tokens == 12 and req_a.cached_tokens == 0
    assert req_b.output_ids == expected[0]
    assert req_a.output_ids == _cold(model, other, longer)[0]


def test_a_merged_cohort_caches_its_unpadded_rows(models):
    """Requests waiting together merge into one left-padded cohort (no lookup); its unpadded
    rows (the longest prompts) still cache their first forward's prompt blocks for later ones."""
    model = models("llada")
    params = _params()
    engine = _approx(model)
    a, b = engine.submit(SYSTEM + [20, 21], params), engine.submit(SYSTEM[:9], params)
    engine.run_until_idle()
    assert a.cohort is b.cohort and a.cached_tokens == b.cached_tokens == 0
    assert engine.prefix_cache.stats.blocks == 4 and engine.prefix_cache.stats.queries == 0
    assert _serve(engine, SYSTEM + [30, 31], params)[3].cached_tokens == 12


@pytest.mark.parametrize("cache", ["none", "anchored", "delayed", "adaptive"])
def test_policies_that_recompute_the_prompt_are_left_alone(models, cache):
    """anchored / delayed / adaptive recompute the prompt every step (what keeps them accurate
    on the embedded task) and none caches nothing: they neither look up nor insert, and answer as
    cold."""
    model = models("llada")
    params = _params(cache=cache)
    engine = _approx(model)
    for _ in range(2):
        warm = _serve(engine, SYSTEM + [20, 21], params)
        assert warm[3].cached_tokens == 0
        assert warm[:3] == _cold(model, SYSTEM + [20, 21], params)[:3]
    assert engine.prefix_cache.stats.queries == 0 and engine.prefix_cache.stats.blocks == 0


def test_block_causal_models_stay_exact_under_approximate(models):
    """On a block-causal model "approximate" is the exact cache: a hit decodes as cold."""
    model = models("sdar")
    engine = Engine(model, max_num_seqs=2, prefix_cache="approximate")
    assert engine.prefix_cache_mode == "exact" and not engine.prefix_cache.approximate
    assert "exact" in engine.prefix_cache_summary()
    params = _params()
    _serve(engine, SYSTEM + [20, 21, 22], params)
    warm, cold = _serve(engine, SYSTEM + [25, 26, 27], params), _cold(model, SYSTEM + [25, 26, 27], params)
    assert warm[3].cached_tokens == 12 and warm[:3] == cold[:3]


# ------------------------------------------------------------------------------ bad input


def test_bad_fields_and_flags_are_refused_naming_them(models):
    with pytest.raises(GenerationError, match="prefix_cache must be one of auto, approximate"):
        EngineArgs(prefix_cache="yes").validate()
    with pytest.raises(GenerationError, match="prefix_cache 'approximate' contradicts prefix_cache_bytes 0"):
        Engine(models("llada"), prefix_cache="approximate", prefix_cache_bytes=0)
    assert Engine(models("llada"), prefix_cache_bytes=0).prefix_cache_summary().endswith("--prefix-cache-bytes 0)")

    from dinfer_rt.cli import _prefix_cache_args, build_parser

    parse = build_parser().parse_args
    assert _prefix_cache_args(parse(["serve", "--prefix-cache", "approximate"])) == {"prefix_cache": "approximate"}
    assert _prefix_cache_args(parse(["serve", "--prefix-cache", "auto", "--prefix-cache-bytes", "4096"])) == {
        "prefix_cache_bytes": 4096,
        "prefix_cache": "auto",
    }
    with pytest.raises(DinferError, match="--no-prefix-cache contradicts --prefix-cache approximate"):
        _prefix_cache_args(parse(["serve", "--prefix-cache", "approximate", "--no-prefix-cache"]))
    with pytest.raises(DinferError, match="--prefix-cache approximate contradicts --prefix-cache-bytes 0"):
        _prefix_cache_args(argparse.Namespace(no_prefix_cache=False, prefix_cache_bytes=0, prefix_cache="approximate"))
    with pytest.raises(SystemExit):
        parse(["serve", "--prefix-cache", "always"])


def test_settings_that_would_be_ignored_or_half_applied_are_refused(models):
    """``LLM.generate`` decodes each batch with no prefix cache (its own engine), while replicas
    (``data_parallel_size``) would apply it: the approximate setting is refused rather than
    meaning two things; so is ``serve --prefix-cache approximate`` with tensor parallelism, where
    no prefix cache runs (each rank holds a shard of the pool)."""
    with pytest.raises(GenerationError, match="LLM: prefix_cache='approximate' is for served engines"):
        dinfer_rt.LLM(models("llada"), prefix_cache="approximate")
    from dinfer_rt.cli import _prefix_cache_args, build_parser

    argv = ["serve", "--prefix-cache", "approximate", "--tensor-parallel-size", "2"]
    with pytest.raises(DinferError, match="approximate is not supported with --tensor-parallel-size > 1"):
        _prefix_cache_args(build_parser().parse_args(argv))


def test_the_server_says_it_is_approximate_at_start_up_and_in_metrics(models, capsys):
    """Never silent: an approximate cache is named by the start-up line (``prefix_cache_summary``,
    printed by ``serve``) and by ``/metrics``' ``dinfer_prefix_cache_approximate`` 1 (0 when exact
    or off), for the in-process engine; replicas relay it (``RelayedPrefixCache.approximate``)."""
    pytest.importorskip("prometheus_client")
    from dinfer_rt.server import ServeConfig, build_app
    from dinfer_rt.workers import RelayedPrefixCache, _prefix_report

    defaults = SamplingParams(strategy="threshold", block_length=LB, gen_length=8)
    for setting, flag in (({"prefix_cache": "approximate"}, 1.0), ({}, 0.0)):
        config = ServeConfig(max_num_seqs=2, engine_args=setting)
        app = build_app(models("llada"), defaults, config, engine_thread=False)
        engine = app.state.engine
        text = app.state.metrics.text(engine).decode()
        assert f"dinfer_prefix_cache_approximate {flag}" in text
        line = engine.prefix_cache_summary()
        assert line.startswith("dinfer-rt prefix cache: approximate" if flag else "dinfer-rt prefix cache: off")
        engine.release()
    # what an engine process relays to the front (``_prefix_report``), and the front's sum of it
    reports = [_prefix_report(Engine(models("llada"), prefix_cache=mode)) for mode in ("approximate", "auto")]
    assert reports[0]["approximate"] is True and reports[1] is None
    assert RelayedPrefixCache(None, reports[0]["budget"], reports[0]["approximate"]).approximate
