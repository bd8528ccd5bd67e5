"""Requests admitted together share their prompt blocks (issue #40: the prefix cache across
requests). A request's prompt blocks enter the cache only after its first forward, so requests
sharing a system prompt admitted in one step used to miss each other: now the first one admitted
computes the blocks a request waiting behind it shares in a prefill forward at its admission
and caches them at once (``Engine._prefix_share``), and a prompt prefilled in chunks is cached
when it joins, so the requests behind it admit with a hit in that same step.

Checked on the tiny block-causal checkpoints (SDAR, LLaDA2) on the CPU against a cold engine
and ``LLM.generate`` alone: same tokens, commit order and forwards; the hit tokens; a first
request aborted, failed or still prefilling strands nobody; priority order is unchanged."""

from __future__ import annotations

import pytest
import torch

import dinfer_rt
from dinfer_rt.engine import Engine
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing import checkpoints

LB = 4
SYSTEM = [7, 19, 8, 30, 9, 41, 10, 52, 11, 23, 12, 34, 13, 45, 14, 56]  # 4 whole blocks
USERS = [[20 + i, 30 + i] for i in range(8)]  # distinct user turns (the prompt's tail block)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict = {}
    writers = {"sdar": checkpoints.sdar, "llada2": checkpoints.llada2}

    def get(name: str):
        if name not in made:
            made[name] = dinfer_rt.load_model(writers[name](tmp_path_factory.mktemp(name)), backend="cpu")
        return made[name]

    return get


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"gen_length": 8, "block_length": LB, "strategy": "threshold", "cache": "dual", **kw})


def _drive(engine: Engine, reqs) -> dict[str, int]:
    """Step until idle; returns each request's first forward (an index into ``forward_s``)."""
    first: dict[str, int] = {}
    while engine.has_work():
        n0 = len(engine.forward_s)
        engine.step()
        for r in reqs:
            if r.id not in first and r.forwards > 0:
                first[r.id] = n0
    for r in reqs:
        assert r.error is None, r.error
    return first


def _answer(req, first: int | None):
    """(output ids, commit step of each generated slot from the request's first forward, forwards)."""
    steps = req.cohort.commit_step[req.row].cpu()
    rel = torch.where(steps >= 0, steps - first, steps).tolist() if first is not None else None
    return req.output_ids, rel, req.forwards


def _cold(model, prompt, params):
    engine = Engine(model, max_num_seqs=2, prefix_cache_bytes=0)
    req = engine.submit(prompt, params)
    return _answer(req, _drive(engine, [req])[req.id])


def _alone(model, prompt, params) -> list[int]:
    return dinfer_rt.LLM(model).generate([prompt], params)[0].token_ids


CASES = [
    ("sdar", dict(strategy="threshold", cache="dual")),
    ("sdar", dict(strategy="low_confidence", cache="prefix")),
    ("llada2", dict(strategy="low_confidence_dynamic", cache="dual")),
    ("llada2", dict(strategy="threshold", cache="delayed")),
    ("llada2", dict(strategy="joint_threshold", threshold=0.3, edit_threshold=0.5, cache="dual")),  # editing
]


def _case_id(value) -> str:
    return value if isinstance(value, str) else f"{value['strategy']}-{value['cache']}"


@pytest.mark.parametrize(("family", "cfg"), CASES, ids=_case_id)
def test_eight_requests_submitted_at_once_hit_the_first_ones_blocks(models, family, cfg):
    """8 requests sharing a 4-block system prompt, submitted at once, all admitted in the first
    step: the first computes the shared blocks ahead of its first forward and the 7 others copy
    them (7 x 16 hit tokens, 7 x 16 query slots fewer than with the cache off); every answer
    equals a cold engine's (tokens, commit order, forwards) and ``LLM.generate`` alone."""
    model = models(family)
    params = _params(**cfg)
    prompts = [SYSTEM + u for u in USERS]
    engine = Engine(model, max_num_seqs=8)
    reqs = [engine.submit(p, params) for p in prompts]
    first = _drive(engine, reqs)
    assert set(first.values()) == {0}  # all admitted in the first step, sharing its forward
    assert [r.cached_tokens for r in reqs] == [0] + [16] * 7
    st = engine.stats
    assert engine.prefix_cache.stats.hit_tokens == 7 * 16 and st.shared_prefills == 1 and st.prefill_tokens == 16
    for p, r in zip(prompts, reqs):
        assert _answer(r, first[r.id]) == _cold(model, p, params), p
    for i in (0, 7):
        assert reqs[i].output_ids == _alone(model, prompts[i], params)
    assert engine.prefix_cache.held() == 0
    # the same load with the cache off: the same answers, 7 x 16 more query slots computed
    off = Engine(model, max_num_seqs=8, prefix_cache_bytes=0)
    cold = [off.submit(p, params) for p in prompts]
    _drive(off, cold)
    assert [r.output_ids for r in cold] == [r.output_ids for r in reqs]
    real = [e.stats.computed_tokens - e.stats.padded_tokens for e in (off, engine)]
    assert real[0] - real[1] == 7 * 16 and off.stats.shared_prefills == 0


def test_fewer_rows_than_siblings_the_rest_hit_the_cache(models):
    """3 rows for 8 siblings: the first step's two followers copy the first one's blocks, the
    five admitted later find them cached (one shared prefill in all)."""
    model = models("sdar")
    params = _params()
    engine = Engine(model, max_num_seqs=3)
    reqs = [engine.submit(SYSTEM + u, params) for u in USERS]
    first = _drive(engine, reqs)
    assert [r.cached_tokens for r in reqs] == [0] + [16] * 7 and engine.stats.shared_prefills == 1
    for u, r in zip(USERS, reqs):
        assert _answer(r, first[r.id]) == _cold(model, SYSTEM + u, params)
    one = Engine(model, max_num_seqs=1)  # one row: nobody is admitted beside it, nothing shared early
    reqs = [one.submit(SYSTEM + u, params) for u in USERS[:3]]
    _drive(one, reqs)
    assert [r.cached_tokens for r in reqs] == [0, 16, 16] and one.stats.shared_prefills == 0


def test_the_first_aborted_or_failing_strands_no_sibling(models):
    """The first request aborted after its first step (its blocks stay cached, the others ran
    beside it already), aborted before any step (the next one leads), or its shared prefill
    failing (it alone fails, the next one leads): every other answer equals the cold one and
    nothing stays held."""
    model = models("llada2")
    params = _params(strategy="low_confidence_dynamic", gen_length=12)
    prompts = [SYSTEM + u for u in USERS[:4]]
    colds = [_cold(model, p, params) for p in prompts]

    def check(engine, reqs, first, hits):
        assert [r.cached_tokens for r in reqs[1:]] == hits
        for i, r in enumerate(reqs[1:], 1):
            assert _answer(r, first[r.id]) == colds[i]
        assert engine.prefix_cache.held() == 0
        assert len(engine.prefix_cache.match(SYSTEM, LB, 4)) == 4

    engine = Engine(model, max_num_seqs=4)
    reqs = [engine.submit(p, params) for p in prompts]
    engine.step()
    assert all(r.forwards == 1 for r in reqs) and len(engine.forward_s) == 1  # all in the first forward
    engine.abort(reqs[0].id)
    _drive(engine, reqs[1:])
    first = {r.id: 0 for r in reqs}
    assert reqs[0].finish_reason == "abort"
    check(engine, reqs, first, [16, 16, 16])

    engine = Engine(model, max_num_seqs=4)
    reqs = [engine.submit(p, params) for p in prompts]
    engine.abort(reqs[0].id)  # before it is admitted: the second one leads
    first = _drive(engine, reqs[1:])
    assert reqs[0].finish_reason == "abort" and reqs[0].forwards == 0
    check(engine, reqs, first, [0, 16, 16])
    assert engine.stats.shared_prefills == 1

    engine = Engine(model, max_num_seqs=4)
    real, calls = engine._prefill_chunk, []

    def failing(cohort, width):
        calls.append(width)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real(cohort, width)

    engine._prefill_chunk = failing
    reqs = [engine.submit(p, params) for p in prompts]
    first = _drive(engine, reqs[1:])
    assert reqs[0].finish_reason == "error" and "device lost" in str(reqs[0].error)
    check(engine, reqs, first, [0, 16, 16])
    assert calls == [16, 16]


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 60, (n,), generator=g).tolist()


def test_a_prompt_prefilled_in_chunks_is_cached_when_it_joins(models):
    """A 10-block shared prompt over the step's budget (24 query slots) is prefilled in chunks
    while the requests behind it wait (FIFO); it is cached the moment it joins, so the next one
    admits with a hit in that same step. Aborted while prefilling, it strands nobody: the next
    one leads. Answers equal ``LLM.generate`` alone."""
    model = models("sdar")
    params = _params()
    shared = _prompt(40, 3)
    prompts = [shared + u for u in USERS[:3]]
    alone = [_alone(model, p, params) for p in prompts]

    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=24, block_length=LB)
    reqs = [engine.submit(p, params) for p in prompts]
    engine.step()
    assert engine.prefilling and [r.status for r in reqs] == ["running", "waiting", "waiting"]
    engine.step()  # the last chunk, then it joins: cached at once, the second one admits with a hit
    assert not engine.prefilling and reqs[1].status == "running" and reqs[1].cached_tokens == 40
    _drive(engine, reqs)
    assert [r.cached_tokens for r in reqs] == [0, 40, 40]
    assert [r.output_ids for r in reqs] == alone

    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=24, block_length=LB)
    reqs = [engine.submit(p, params) for p in prompts]
    engine.step()
    assert engine.prefilling and reqs[1].status == "waiting"
    engine.abort(reqs[0].id)
    _drive(engine, reqs[1:])
    assert reqs[0].finish_reason == "abort"
    assert [r.cached_tokens for r in reqs[1:]] == [0, 40] and [r.output_ids for r in reqs[1:]] == alone[1:]
    assert engine.prefix_cache.held() == 0


def test_priority_order_is_kept(models):
    """Sharing changes no admission: (priority, arrival) order, lower first. Three rows: B and D
    (priority 0) then A (priority 1) in the first step, D computing the blocks A shares; C and E
    later, from the cache."""
    model = models("sdar")
    params = _params()
    other = [s + 1 for s in SYSTEM] + USERS[1]  # shares no block
    spec = {"A": (1, SYSTEM + USERS[0]), "B": (0, other), "C": (1, SYSTEM + USERS[2]), "D": (0, SYSTEM + USERS[3])}
    spec["E"] = (2, SYSTEM + USERS[4])
    engine = Engine(model, max_num_seqs=3)
    reqs = {k: engine.submit(p, params, priority=pr) for k, (pr, p) in spec.items()}
    engine.step()
    assert [k for k, r in reqs.items() if r.status == "running"] == ["A", "B", "D"]
    assert [g[0].id for g in engine.waiting] == [reqs["C"].id, reqs["E"].id]
    _drive(engine, list(reqs.values()))
    assert sorted(reqs, key=lambda k: reqs[k].admitted) == ["B", "D", "A", "C", "E"]
    assert {k: r.cached_tokens for k, r in reqs.items()} == {"A": 16, "B": 0, "C": 16, "D": 0, "E": 16}
    assert engine.stats.shared_prefills == 1
    for k, r in reqs.items():
        assert r.output_ids == _alone(model, spec[k][1], params), k


def test_only_requests_that_reuse_the_cache_lead_or_follow(models):
    """``cache: "none"`` (no exact K/V) and ``vicinity``'s warm-up (no lookup) neither compute
    shared blocks for others nor copy them: the first request that looks up leads."""
    model = models("sdar")
    cfgs = [_params(cache="none"), _params(), _params(), _params(cache="vicinity")]
    prompts = [SYSTEM + u for u in USERS[:4]]
    engine = Engine(model, max_num_seqs=4)
    reqs = [engine.submit(p, c) for p, c in zip(prompts, cfgs)]
    first = _drive(engine, reqs)
    assert [r.cached_tokens for r in reqs] == [0, 0, 16, 0] and engine.stats.shared_prefills == 1
    for p, c, r in zip(prompts, cfgs, reqs):
        assert _answer(r, first[r.id]) == _cold(model, p, c)
