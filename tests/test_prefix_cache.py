"""The block prefix cache across requests (``prefix_cache.py``, issue #40 point 1).

Exactness is checked against independent paths: the same request on an engine without the
cache (cold) and ``LLM.generate`` alone (its own engine, no cache): same tokens, same commit
order, same number of forwards; and the K/V a cache hit leaves in the pool against a fresh
prefill of the final sequence. Tiny block-causal checkpoints (SDAR, LLaDA2) on the CPU."""

from __future__ import annotations

import argparse

import pytest
import torch

import dinfer_rt
from dinfer_rt.engine import Engine
from dinfer_rt.errors import DinferError, GenerationError
from dinfer_rt.model import KVCache
from dinfer_rt.prefix_cache import PrefixCache, block_key
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing import checkpoints

LB = 4  # block length of every request here
SYSTEM = [7, 19, 8, 30, 9, 41, 10, 52, 11, 23, 12, 34, 13, 45]  # 14 tokens: 3 whole blocks and a tail


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> loaded model, built once per module."""
    made: dict = {}
    writers = {"sdar": checkpoints.sdar, "llada2": checkpoints.llada2, "llada": checkpoints.llada}

    def get(name: str):
        if name not in made:
            path = writers[name](tmp_path_factory.mktemp(name))
            made[name] = dinfer_rt.load_model(path, backend="cpu")
        return made[name]

    return get


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"gen_length": 8, "block_length": LB, "strategy": "threshold", "cache": "dual", **kw})


def _serve(engine: Engine, prompt: list[int], params: SamplingParams):
    """Run one request alone on ``engine``: (output ids, commit step of each generated slot
    counted from the request's first forward, forwards taken, the request, query slots computed)."""
    first, computed = len(engine.forward_s), engine.stats.computed_tokens
    req = engine.submit(prompt, params)
    engine.run_until_idle()
    assert req.error is None, req.error
    steps = req.cohort.commit_step[0].cpu()
    computed = engine.stats.computed_tokens - computed
    return req.output_ids, torch.where(steps >= 0, steps - first, steps).tolist(), req.forwards, req, computed


def _cold(model, prompt: list[int], params: SamplingParams):
    engine = Engine(model, max_num_seqs=2, prefix_cache_bytes=0)
    assert engine.prefix_cache is None
    return _serve(engine, prompt, params)


def _alone(model, prompt: list[int], params: SamplingParams) -> list[int]:
    return dinfer_rt.LLM(model).generate([prompt], params)[0].token_ids


# ----------------------------------------------------------------------------------- the store


def _pool(blocks: int, fill: float = 0.0) -> KVCache:
    n = blocks * LB
    k = [torch.arange(n * 2, dtype=torch.float32).reshape(1, n, 1, 2) + fill for _ in range(2)]
    return KVCache(k, [t + 1000 for t in k])


def test_chain_keys_separate_equal_blocks_after_different_prefixes():
    cache = PrefixCache(1 << 20)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 5, 6, 7, 8]  # same second block
    assert block_key(b"x", LB, a[4:]) != block_key(b"y", LB, a[4:])
    held = cache.insert(a, LB, 2, _pool(2), 0)
    assert len(cache.match(a, LB, 2)) == 2 and len(cache.match(b, LB, 2)) == 0
    assert len(cache.match(a[:4] + [0, 0, 0, 0], LB, 2)) == 1  # the longest cached prefix
    assert len(cache.match(a + [1, 2, 3, 4], LB, 3)) == 2 and len(cache.match(a, LB, 1)) == 1
    block_bytes = 2 * 2 * (LB * 2 * 4)  # k and v, two layers, [4, 1, 2] float32
    assert cache.stats.bytes == 2 * block_bytes and cache.stats.blocks == 2
    cache.release(held)
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release(held)


def test_copy_into_writes_the_cached_k_v_at_their_positions():
    cache = PrefixCache(1 << 20)
    src = _pool(2, fill=0.5)
    chain = cache.insert(list(range(6, 14)), LB, 2, src, 0)
    dst = KVCache([torch.zeros(3, 12, 1, 2) for _ in range(2)], [torch.zeros(3, 12, 1, 2) for _ in range(2)])
    assert PrefixCache.copy_into(chain, dst, 2) == 8
    for d, s in zip((*dst.k, *dst.v), (*src.k, *src.v)):
        assert torch.equal(d[2, :8], s[0, :8]) and not d[:2].any() and not d[2, 8:].any()


def test_lru_eviction_under_the_budget_never_takes_a_held_block_or_a_parent():
    block_bytes = 2 * 2 * (LB * 2 * 4)
    cache = PrefixCache(3 * block_bytes)
    first = cache.insert([6] * 8, LB, 2, _pool(2), 0)  # a chain of two: held
    cache.release(cache.insert([7] * 4, LB, 1, _pool(1), 0))  # unheld leaf
    assert cache.stats.blocks == 3
    cache.release(cache.insert([8] * 4, LB, 1, _pool(1), 0))  # room: the unheld leaf [7] goes
    assert cache.match([7] * 4, LB, 1) == [] and len(cache.match([6] * 8, LB, 2)) == 2
    assert cache.stats.evicted_blocks == 1 and cache.stats.bytes == 3 * block_bytes
    cache.release(first)
    cache.lookup([8] * 4, LB, 1)[0]  # [8] most recent and held again; [6]'s leaf is the only candidate
    cache.release(cache.insert([9] * 4, LB, 1, _pool(1), 0))
    assert len(cache.match([6] * 8, LB, 2)) == 1 and cache.match([8] * 4, LB, 1)  # the leaf, not its parent
    assert cache.stats.bytes <= cache.budget
    tiny = PrefixCache(block_bytes - 1)  # not even one block fits: nothing cached, nothing breaks
    assert tiny.insert([6] * 4, LB, 1, _pool(1), 0) == [] and tiny.stats.blocks == 0


def test_stats_count_queries_and_hit_tokens():
    cache = PrefixCache(1 << 20)
    cache.release(cache.insert(SYSTEM, LB, 3, _pool(4), 0))
    cache.release(cache.lookup(SYSTEM[:12] + [6, 6, 6, 6], LB, 4)[0])
    cache.release(cache.lookup([6] * 16, LB, 4)[0])
    st = cache.stats
    assert (st.queries, st.query_tokens, st.hit_tokens, st.inserted_blocks) == (2, 32, 12, 3)


# ----------------------------------------------------------------------------------- exactness

FAMILIES = {"sdar": ("prefix", "dual", "vicinity", "adaptive", "anchored"), "llada2": None}


def _policies(name: str) -> list[str]:
    from dinfer_rt.model_spec import CACHES_ALL

    return [c for c in CACHES_ALL if c != "none" and (FAMILIES[name] is None or c in FAMILIES[name])]


CASES = [(f, "threshold", c) for f in FAMILIES for c in _policies(f)]
CASES += [
    (f, rule, "dual")
    for f in FAMILIES
    for rule in ("low_confidence", "low_confidence_dynamic", "topk_margin", "entropy", "joint_threshold")
]


@pytest.mark.parametrize(("family", "strategy", "cache"), CASES)
def test_a_cache_hit_decodes_as_cold_and_as_generate_alone(models, family, strategy, cache):
    """A request whose prompt shares the system prompt's whole blocks with an earlier one copies
    their K/V (hit tokens > 0) and answers as a cold engine and ``LLM.generate`` alone do: same
    tokens, commit order and forwards. Also a prompt that is whole blocks, repeated (the first
    forward then computes no prompt position)."""
    model = models(family)
    extra = {"vicinity_warmup": 0} if cache == "vicinity" else {}
    params = _params(strategy=strategy, cache=cache, **extra)
    engine = Engine(model, max_num_seqs=2)
    _serve(engine, SYSTEM + [20, 21, 22], params)
    for prompt, hit in ((SYSTEM + [25, 26, 27, 28, 29], 12), (SYSTEM + [20, 21], 16)):
        warm, cold = _serve(engine, prompt, params), _cold(model, prompt, params)
        assert warm[3].cached_tokens == hit
        assert warm[:3] == cold[:3]
        assert warm[0] == _alone(model, prompt, params)
        assert cold[4] - warm[4] == hit  # the first forward computed only past the cached prefix
    assert engine.prefix_cache.stats.hit_tokens == 28


def test_vicinity_warm_up_and_no_cache_skip_the_lookup(models):
    """Where the first forwards recompute every position (``vicinity``'s warm-up) or nothing is
    cached (``none``) a request neither looks up nor inserts, and still answers as cold."""
    model = models("sdar")
    for params in (_params(cache="vicinity"), _params(cache="none")):
        engine = Engine(model, max_num_seqs=2)
        for _ in range(2):
            warm = _serve(engine, SYSTEM + [20, 21], params)
            assert warm[3].cached_tokens == 0 and warm[:3] == _cold(model, SYSTEM + [20, 21], params)[:3]
        assert engine.prefix_cache.stats.queries == 0
    vicinity = Engine(model, max_num_seqs=2)
    _serve(vicinity, SYSTEM + [20, 21], _params(cache="vicinity"))  # inserted: its K/V are exact
    assert _serve(vicinity, SYSTEM + [20, 21], _params())[3].cached_tokens == 16


def test_multi_turn_chat_reuses_the_previous_turn(models):
    """Turn 2's prompt is turn 1's prompt, its answer and a new user turn (the checkpoint's chat
    template): it reuses turn 1's blocks (prompt and answer blocks, which are final and were
    recomputed from their final tokens) and answers as cold and alone."""
    model = models("llada2")
    tok = model.tokenizer
    params = _params(gen_length=12, strategy="low_confidence_dynamic")
    engine = Engine(model, max_num_seqs=2)
    history = [{"role": "system", "content": "youareatinymodel"}, {"role": "user", "content": "addtwelveandthirty"}]
    turn1 = tok.encode(tok.apply_chat_template(history))
    ids1, *_ = _serve(engine, turn1, params)
    history += [{"role": "assistant", "content": tok.decode(ids1)}, {"role": "user", "content": "andseven"}]
    turn2 = tok.encode(tok.apply_chat_template(history))
    assert turn2[: len(turn1)] == turn1
    warm = _serve(engine, turn2, params)
    assert warm[3].cached_tokens > (len(turn1) // LB) * LB  # the answer's blocks too, not only the prompt's
    assert warm[:3] == _cold(model, turn2, params)[:3]
    assert warm[0] == _alone(model, turn2, params)


@pytest.mark.parametrize("kv_block_size", [4, 0])
def test_the_k_v_of_a_cache_hit_equal_a_fresh_prefill(models, kv_block_size):
    """The K/V copied from the cache (paged: referenced) equal a fresh prefill's, and so do those
    the first forward computed past them while reading the cached ones: after decoding, every
    block but the last (nothing reads it) holds what a fresh prefill of the final sequence writes."""
    model = models("sdar")
    params = _params(gen_length=12, strategy="low_confidence_dynamic")
    engine = Engine(model, max_num_seqs=1, kv_block_size=kv_block_size)
    _serve(engine, SYSTEM + [20], params)
    prompt = SYSTEM + [25, 26, 27]
    chain = engine.prefix_cache.match(prompt, LB, len(prompt) // LB)
    assert len(chain) == 3
    req = _serve(engine, prompt, params)[3]
    assert req.cached_tokens == 12
    cohort = req.cohort
    fresh = model.new_cache(1, cohort.n)
    model.forward(cohort.x, cache=fresh, block_size=LB)
    for layer, (ck, cv) in enumerate(zip(fresh.k, fresh.v)):
        for node in chain:
            a = node.start
            nk, nv = engine.cached_kv(node)
            assert (nk[layer] - ck[0, a : a + LB]).abs().max() < 1e-5
            assert (nv[layer] - cv[0, a : a + LB]).abs().max() < 1e-5
    last = ((cohort.n - 1) // LB) * LB
    if not kv_block_size:  # contiguous: the pool row keeps them (paged: the row's blocks are the cache's below)
        for kept, prefill in zip((*engine.cache.k, *engine.cache.v), (*fresh.k, *fresh.v)):
            assert (kept[0, :last] - prefill[0, :last]).abs().max() < 1e-5
        assert engine.cache.k[0][0, :12].abs().sum() > 0
    # at its end the request cached every block before the last one it decoded, generated ones
    # too (recomputed from their final tokens): their K/V are the fresh prefill's as well
    assert cohort.block_start == last
    every = engine.prefix_cache.match(cohort.x[0].tolist(), LB, last // LB)
    assert len(every) == last // LB and every[-1].start >= len(prompt)
    for layer, (ck, cv) in enumerate(zip(fresh.k, fresh.v)):
        for node in every:
            a = node.start
            nk, nv = engine.cached_kv(node)
            assert (nk[layer] - ck[0, a : a + LB]).abs().max() < 1e-5
            assert (nv[layer] - cv[0, a : a + LB]).abs().max() < 1e-5


def test_eviction_under_a_tiny_budget_keeps_outputs_identical(models):
    """A budget of five blocks: requests over three system prompts evict each other's blocks
    all the time; every answer still equals the cold engine's, and the budget holds."""
    model = models("sdar")
    params = _params()
    probe = Engine(model, max_num_seqs=1)
    _serve(probe, SYSTEM[:8], params)
    block_bytes = probe.prefix_cache.stats.bytes // probe.prefix_cache.stats.blocks
    engine = Engine(model, max_num_seqs=2, prefix_cache_bytes=5 * block_bytes)
    systems = [SYSTEM, SYSTEM[::-1], [s + 1 for s in SYSTEM]]
    for i in range(7):
        prompt = systems[i % 3] + [20 + i, 30 + i]
        warm = _serve(engine, prompt, params)
        assert warm[:3] == _cold(model, prompt, params)[:3]
        assert engine.prefix_cache.stats.bytes <= 5 * block_bytes and engine.prefix_cache.held() == 0
        # the blocks just finished are the most recent: the same prompt again hits all 4 of its blocks
        again = _serve(engine, prompt, params)
        assert again[3].cached_tokens == 16 and again[:3] == warm[:3]
    st = engine.prefix_cache.stats
    assert st.evicted_blocks > 0 and st.inserted_blocks > st.blocks


def test_a_running_request_keeps_its_blocks_under_eviction_pressure(models):
    """A budget of four blocks, all held by a running request (its prompt blocks, cached after
    its first forward): a second request's blocks find no room and evict none of them; both
    answer as cold; once both end nothing is held."""
    model = models("sdar")
    params = _params()
    probe = Engine(model, max_num_seqs=1)
    _serve(probe, SYSTEM[:8], params)
    block_bytes = probe.prefix_cache.stats.bytes // probe.prefix_cache.stats.blocks
    engine = Engine(model, max_num_seqs=2, prefix_cache_bytes=4 * block_bytes)
    cache = engine.prefix_cache
    a, b = SYSTEM + [20, 21], [s + 2 for s in SYSTEM] + [20, 21]
    req_a = engine.submit(a, params)
    engine.step()
    assert len(cache.match(a, LB, 4)) == 4 and cache.held() == 4
    req_b = engine.submit(b, params)
    engine.step()
    assert req_a.status == req_b.status == "running"
    assert len(cache.match(a, LB, 4)) == 4 and cache.match(b, LB, 4) == [] and cache.stats.evicted_blocks == 0
    engine.run_until_idle()
    for req, prompt in ((req_a, a), (req_b, b)):
        assert req.output_ids == _cold(model, prompt, params)[0]
    assert cache.held() == 0 and cache.stats.bytes <= cache.budget


def test_an_aborted_or_failed_request_releases_its_blocks(models):
    model = models("sdar")
    params = _params(gen_length=16)
    engine = Engine(model, max_num_seqs=2)
    _serve(engine, SYSTEM + [20, 21], params)
    req = engine.submit(SYSTEM + [20, 21], params)
    engine.step()
    assert req.cached_tokens == 16 and engine.prefix_cache.held() > 0
    engine.abort(req.id)
    engine.step()
    assert req.finish_reason == "abort" and engine.prefix_cache.held() == 0


# ----------------------------------------------------------------------------------- where it is on


def test_the_cache_is_on_for_block_causal_models_only_and_off_when_asked(models):
    assert Engine(models("sdar"), kv_block_size=0).prefix_cache.budget == 1 << 30  # the CPU default
    paged = Engine(models("sdar"))  # its blocks are the pool's: never more than the pool
    assert paged.prefix_cache.budget == paged.kv_pool_bytes and paged.prefix_cache.unit == 4
    assert Engine(models("sdar"), prefix_cache_bytes=4096).prefix_cache.budget == 4096
    assert Engine(models("sdar"), prefix_cache_bytes=0).prefix_cache is None
    assert Engine(models("llada")).prefix_cache is None  # bidirectional: prompt K/V depend on the answer
    with pytest.raises(GenerationError, match="prefix_cache_bytes must be an int >= 0"):
        Engine(models("sdar"), prefix_cache_bytes=-1)
    with pytest.raises(GenerationError, match="prefix_cache_bytes must be an int >= 1"):
        PrefixCache(0)


def test_serve_flags_set_the_budget_and_refuse_a_contradiction():
    from dinfer_rt.cli import _prefix_cache_args, build_parser

    parse = build_parser().parse_args
    assert _prefix_cache_args(parse(["serve"])) == {}
    assert _prefix_cache_args(parse(["serve", "--prefix-cache-bytes", "4096"])) == {"prefix_cache_bytes": 4096}
    assert _prefix_cache_args(parse(["serve", "--no-prefix-cache"])) == {"prefix_cache_bytes": 0}
    with pytest.raises(DinferError, match="--no-prefix-cache contradicts --prefix-cache-bytes"):
        _prefix_cache_args(argparse.Namespace(no_prefix_cache=True, prefix_cache_bytes=10))


def test_a_static_batch_inserts_every_row_and_sync_every_keeps_it_exact(models):
    """Rows of a static batch (``submit_batch``, equal lengths) are each cached; with
    ``sync_every`` 2 (blocks advance at every other step) a later hit still decodes as cold."""
    model = models("llada2")
    params = _params(strategy="low_confidence_dynamic")
    engine = Engine(model, max_num_seqs=2, sync_every=2)
    rows = [SYSTEM + [20, 21], [s + 1 for s in SYSTEM] + [20, 21]]
    engine.submit_batch(rows, params)
    engine.run_until_idle()
    for row in rows:
        assert len(engine.prefix_cache.match(row, LB, 4)) == 4
    cold_engine = Engine(model, max_num_seqs=2, sync_every=2, prefix_cache_bytes=0)
    for row in rows:
        prompt = row[:12] + [30, 31, 32]
        warm = _serve(engine, prompt, params)
        assert warm[3].cached_tokens == 12 and warm[:3] == _serve(cold_engine, prompt, params)[:3]


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_a_hit_admitted_beside_a_running_request_decodes_as_cold(models, family):
    """The hit's first forward shares a per-row forward with a request already running (its
    window starts past the cached prefix, the other's at its block): both answer as cold."""
    model = models(family)
    params = _params(gen_length=12, strategy="low_confidence_dynamic")
    engine = Engine(model, max_num_seqs=2)
    _serve(engine, SYSTEM + [20], params)
    other, hit = [s + 3 for s in SYSTEM] + [20, 21], SYSTEM + [25, 26, 27]
    req_a = engine.submit(other, params)
    engine.step()
    before = engine.stats.per_row_steps
    req_b = engine.submit(hit, params)
    engine.run_until_idle()
    assert engine.stats.per_row_steps > before and req_b.cached_tokens == 12 and req_a.cached_tokens == 0
    for req, prompt in ((req_a, other), (req_b, hit)):
        assert req.output_ids == _cold(model, prompt, params)[0]
