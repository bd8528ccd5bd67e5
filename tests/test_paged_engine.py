"""The engine's paged KV pool (issue #40 point 4; ``kv_blocks.py``, ``EngineArgs.kv_block_size``):
a budget in blocks, taken per request at admission and given back at its end; admission by free
blocks; a request that can never fit refused with its bytes; the prefix cache's blocks in the same
pool (a hit references them, copy-on-write keeps them unwritten); and every output equal to the
contiguous pool's and to ``LLM.generate``'s, whatever runs beside it."""

from __future__ import annotations

import functools
import random

import pytest
import torch

import dinfer_rt
from dinfer_rt.engine import Engine
from dinfer_rt.errors import GenerationError
from dinfer_rt.kv_blocks import TRASH, KVBlocks, blocks_for
from dinfer_rt.kv_pool import DEFAULT_KV_FRACTION, kv_row_bytes
from dinfer_rt.sampling import SamplingParams

LB = 4
SYSTEM = [7, 19, 8, 30, 9, 41, 10, 52, 11, 23, 12, 34, 13, 45]  # 14 tokens


@pytest.fixture(scope="module")
def models(ckpt_dir):
    """name -> the session's tiny checkpoint of that family, loaded once per module."""
    return functools.cache(lambda name: dinfer_rt.load_model(ckpt_dir(name), backend="cpu"))


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"gen_length": 8, "block_length": LB, "strategy": "threshold", "cache": "dual", **kw})


def _prompts(count: int, seed: int, vocab: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab) for _ in range(rng.randrange(3, 15))] for _ in range(count)]  # past mask 5


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams, stagger: int = 1) -> list[list[int]]:
    """Submit one request every ``stagger`` steps (so rows sit at different blocks), run all."""
    reqs, pending, most = [], list(prompts), 0
    while pending or engine.has_work():
        if pending:
            reqs.append(engine.submit(pending.pop(0), params))
        for _ in range(stagger):
            engine.step()
        most = max(most, engine.num_running)
    for r in reqs:
        assert r.error is None, r.error
    engine.most_running = most
    return [r.output_ids for r in reqs]


def _block_bytes(model, size: int = LB) -> int:
    return kv_row_bytes(model.spec, model.dtype, size)


# ------------------------------------------------------------------------------ bookkeeping


def test_blocks_allocate_share_copy_on_write_move_and_free():
    blocks = KVBlocks(num_blocks=9, block_size=4, rows=3, max_blocks=4)
    assert (blocks.usable, blocks.free) == (8, 8)
    blocks.allocate(0, 10)  # 3 blocks
    a = blocks.row_blocks(0, 3)
    assert TRASH not in a and blocks.free == 5 and blocks.table[0, 3] == TRASH
    blocks.ref(a[0])  # the prefix cache takes the first two
    blocks.ref(a[1])
    blocks.mark_shared(0, 2)
    blocks.allocate(1, 13, shared=a[:2])  # a hit: row 1 points at them
    assert blocks.row_blocks(1, 2) == a[:2] and blocks.refs[a[0]] == 3 and blocks.free == 3
    assert blocks.writable(1, 8) == []  # writes past the shared blocks copy nothing
    pairs = blocks.writable(1, 5)  # writes into its second block: that one is copied first
    assert len(pairs) == 1 and pairs[0][0] == a[1] and blocks.table[1, 1] == pairs[0][1]
    assert blocks.refs[a[1]] == 2 and blocks.copied_blocks == 1 and blocks.writable(1, 5) == []
    blocks.release(0)
    assert blocks.refs[a[0]] == 2 and blocks.refs[a[2]] == 0 and blocks.table[0].eq(TRASH).all()
    blocks.move(0, 1, 1)  # row 1 becomes row 0: the table row moves, no block does
    assert blocks.allocated == [4, 0, 0] and blocks.table[1].eq(TRASH).all()
    blocks.release(0)
    blocks.unref(a[0])
    blocks.unref(a[1])
    assert blocks.free == 8 and blocks.used == 0
    with pytest.raises(GenerationError, match="needs 3 free blocks, 0 are free"):
        full = KVBlocks(num_blocks=3, block_size=4, rows=2, max_blocks=4)
        full.allocate(0, 8)
        full.allocate(1, 9)
    with pytest.raises(GenerationError, match="at least 2 blocks"):
        KVBlocks(1, 4, 1, 1)


# ------------------------------------------------------------------------------ the pool's size


def test_a_budget_buys_blocks_not_rows_and_the_default_never_preallocates_every_row(models):
    model = models("llada")
    block = _block_bytes(model)
    engine = Engine(model, max_num_seqs=8, max_model_len=40, kv_cache_memory=21 * block + 3, prefix_cache_bytes=0)
    plan = engine.kv_plan
    assert plan.paged and plan.num_blocks == 21 and engine.max_num_seqs == 8  # rows are table rows: all kept
    pool_bytes = sum(t.nbytes for t in (*engine.cache.k, *engine.cache.v))
    assert pool_bytes == 21 * block and engine.kv_pool_bytes == pool_bytes + plan.table_bytes
    # without a budget: every row at max_model_len (+ the trash block), never more ...
    roomy = Engine(model, max_num_seqs=8, max_model_len=40, prefix_cache_bytes=0)
    assert roomy.kv_plan.num_blocks == 8 * blocks_for(40, LB) + 1
    # ... and at most DEFAULT_KV_FRACTION of the free memory (a Dream-7B-sized pool would not fit)
    from dinfer_rt import engine as engine_module

    free = 40 * block
    original = engine_module.available_memory
    engine_module.available_memory = lambda device: free
    try:
        capped = Engine(model, max_num_seqs=8, max_model_len=40, prefix_cache_bytes=0)
    finally:
        engine_module.available_memory = original
    assert capped.kv_plan.num_blocks == int(free * DEFAULT_KV_FRACTION) // block == 20
    with pytest.raises(GenerationError, match="holds 1 KV block: a paged pool needs 2 blocks"):
        Engine(model, kv_cache_memory=block + 1)


def test_a_request_that_can_never_fit_is_refused_with_its_bytes(models):
    model = models("llada")
    block = _block_bytes(model)
    engine = Engine(model, max_num_seqs=2, kv_cache_memory=5 * block, prefix_cache_bytes=0)  # 4 usable blocks
    assert engine.submit([6] * 8, _params()).error is None  # 16 positions: 4 blocks, fits
    with pytest.raises(GenerationError) as e:
        engine.submit([6] * 9, _params())  # 17 positions: 5 blocks
    msg = str(e.value)
    for part in ("17 tokens need 5 KV blocks of 4 positions", f"{5 * block} bytes", "the whole KV pool holds 4"):
        assert part in msg, (part, msg)
    assert "--kv-cache-memory" in msg
    engine.run_until_idle()


# ------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize(
    "family,cache",
    [
        ("llada", "dual"),
        ("llada", "prefix"),
        ("llada", "none"),
        ("dream", "dual"),
        ("sdar", "dual"),
        ("llada2", "prefix"),
    ],
)
def test_paged_outputs_equal_the_contiguous_pool_and_generate(models, family, cache):
    """Requests arriving a step apart (rows at different blocks share per-row forwards, rows
    move down as others end) decode the same ids on the paged pool as on contiguous rows and as
    ``LLM.generate`` of each prompt alone; at the end every block is free again."""
    model = models(family)
    params = _params(cache=cache, gen_length=12 if family != "dream" else 8)
    prompts = _prompts(5, seed=hash((family, cache)) % 1000, vocab=model.spec.vocab)
    paged = Engine(model, max_num_seqs=3, block_length=LB, prefix_cache_bytes=0)
    rows = Engine(model, max_num_seqs=3, block_length=LB, prefix_cache_bytes=0, kv_block_size=0)
    got = _run(paged, prompts, params)
    assert got == _run(rows, prompts, params)
    llm = dinfer_rt.LLM(model)
    assert got == [llm.generate([p], params)[0].token_ids for p in prompts]
    assert paged.stats.per_row_steps > 0 and paged.blocks.used == 0 and not any(paged.blocks.allocated)


def test_admission_waits_for_free_blocks_and_short_requests_share_a_long_one_s_memory(models):
    """A budget of 12 usable blocks: one request at the full max_model_len (40 positions, 10
    blocks) would leave room for no second one under contiguous rows; requests of 16 positions
    (4 blocks) run three at a time, a fourth waits for blocks (not rows: 8 are free), and every
    output equals ``LLM.generate``'s."""
    model = models("llada")
    block = _block_bytes(model)
    engine = Engine(model, max_num_seqs=8, max_model_len=40, kv_cache_memory=13 * block, prefix_cache_bytes=0)
    params = _params(gen_length=8)
    prompts = [[6 + i, 9, 11, 13 + i, 7, 20, 21, 22] for i in range(5)]  # 8 + 8 = 16 positions each
    reqs = [engine.submit(p, params) for p in prompts]
    engine.step()
    assert [r.status for r in reqs] == ["running"] * 3 + ["waiting"] * 2
    assert engine.blocks.free == 0 and engine.num_running == 3
    engine.run_until_idle()
    llm = dinfer_rt.LLM(model)
    assert [r.output_ids for r in reqs] == [llm.generate([p], params)[0].token_ids for p in prompts]
    assert engine.blocks.used == 0


def test_aborted_failed_and_finished_requests_all_give_their_blocks_back(models):
    model = models("sdar")
    engine = Engine(model, max_num_seqs=4, block_length=LB, prefix_cache_bytes=0)
    params = _params()
    a = engine.submit(SYSTEM, params)
    b = engine.submit(SYSTEM[:6], params)
    engine.step()
    engine.abort(a.id)
    engine.step()
    assert a.finish_reason == "abort"
    engine.run_until_idle()
    assert b.finish_reason in ("stop", "length") and engine.blocks.used == 0


# ------------------------------------------------------------------------------ prefix cache in the pool


def test_a_hit_references_the_cached_blocks_and_copies_none(models):
    """Block-causal (exact): the second request's table points at the blocks the first one's
    prompt left in the cache (same block ids, nothing copied, no copy-on-write: its first forward
    writes past them), and its output equals a cold run's."""
    model = models("sdar")
    params = _params()
    engine = Engine(model, max_num_seqs=2, block_length=LB)
    first = engine.submit(SYSTEM + [20], params)
    engine.run_until_idle()
    cached = engine.prefix_cache.match(SYSTEM + [25, 26], LB, 3)
    assert len(cached) == 3 and all(node.pool_block > 0 for node in cached)
    held_before = engine.blocks.used  # the cache's blocks, nothing else
    assert held_before == engine.prefix_cache.stats.blocks
    second = engine.submit(SYSTEM + [25, 26], params)
    engine.step()
    row = second.row + second.cohort.start_row
    assert engine.blocks.row_blocks(row, 3) == [node.pool_block for node in cached]
    assert second.cached_tokens == 12 and engine.blocks.copied_blocks == 0
    need = blocks_for(second.cohort.n, LB)
    assert engine.blocks.used == held_before + need - 3  # its own blocks past the shared three
    engine.run_until_idle()
    cold = Engine(model, max_num_seqs=2, block_length=LB, prefix_cache_bytes=0)
    assert second.output_ids == _run(cold, [SYSTEM + [25, 26]], params)[0]
    assert first.error is None and engine.prefix_cache.held() == 0


def test_an_approximate_insert_copies_the_first_forward_blocks_and_a_hit_copies_on_write(models):
    """Bidirectional (approximate): the request that inserts its prompt blocks after its first
    forward goes on refreshing its prompt, so the cache gets copies of them (its own blocks stay
    its own) and keeps the first forward's K/V while the request rewrites its rows; a later hit
    that ends inside a pool block shares it and copies it on its first write. Outputs equal a cold
    run's, and the cache's blocks are unchanged by either request."""
    model = models("llada")
    params = _params(gen_length=12)
    engine = Engine(model, max_num_seqs=1, prefix_cache="approximate", kv_block_size=8)
    req = engine.submit(SYSTEM + [20, 21], params)
    engine.step()  # the first forward; its prompt blocks enter the cache after it
    chain = engine.prefix_cache.match(SYSTEM, LB, 1)  # 16 positions: 12 of the span, one whole 8-block
    assert len(chain) == 1 and chain[0].pool_block not in engine.blocks.row_blocks(0, 2)  # a copy
    snapshot = [t.clone() for t in engine.cached_kv(chain[0])[0]]
    engine.run_until_idle()
    assert torch.equal(torch.stack(engine.cached_kv(chain[0])[0]), torch.stack(snapshot))
    assert engine.blocks.copied_blocks == 0
    cold = Engine(model, max_num_seqs=1, prefix_cache_bytes=0)
    assert req.output_ids == _run(cold, [SYSTEM + [20, 21]], params)[0]
    # a hit: its prompt shares 12 positions = 3 blocks of 4; the 8-position pool blocks give 8 of them
    again = engine.submit(SYSTEM[:12] + [33, 34, 35, 36], params)
    engine.run_until_idle()
    assert again.cached_tokens == 8 and engine.blocks.copied_blocks == 0  # ends on a pool block: no copy
    assert torch.equal(torch.stack(engine.cached_kv(chain[0])[0]), torch.stack(snapshot))
    assert engine.blocks.used == engine.prefix_cache.stats.blocks


def test_a_hit_that_ends_inside_a_pool_block_copies_it_on_its_first_write(models):
    """Block length 6 on a pool of 4-position blocks (exact, block-causal), the cached chain cut by
    eviction to 5 pool blocks (20 positions): a hit is cut to whole blocks of 6 (18 positions), so
    it shares the pool block holding positions 16-19 and copies it before its first forward writes
    18-19. The cached block keeps what it had, and the output equals a cold run's."""
    model = models("sdar")
    params = _params(block_length=6, gen_length=12)
    engine = Engine(model, max_num_seqs=1, block_length=6)
    first = SYSTEM + [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]  # 25 tokens: 4 blocks of 6 cached
    engine.submit(first, params)
    engine.run_until_idle()
    cache = engine.prefix_cache
    while len(cache.match(first, 6, 6)) > 5:  # evict leaves until the chain holds 5 pool blocks
        cache._evict(next(n for n in reversed(cache._blocks.values()) if n.children == 0))
    chain = cache.match(first, 6, 6)
    assert len(chain) == 5
    kept = [t.clone() for t in engine.cached_kv(chain[4])[0]]
    prompt = first[:24] + [40, 41]
    req = engine.submit(prompt, params)
    engine.run_until_idle()
    assert req.cached_tokens == 18 and engine.blocks.copied_blocks == 1
    assert torch.equal(torch.stack(engine.cached_kv(chain[4])[0]), torch.stack(kept))
    cold = Engine(model, max_num_seqs=1, block_length=6, prefix_cache_bytes=0)
    assert req.output_ids == _run(cold, [prompt], params)[0]


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_the_blocks_hold_the_k_v_of_a_fresh_prefill_of_the_final_tokens(models, family):
    """The paged pool's counterpart of the contiguous pool's K/V checks (``tests/test_editing.py``):
    the blocks a request held at its end, read through its table, equal a fresh prefill of its
    final sequence for every finished block (block-causal: every layer; bidirectional: layer 0,
    whose K/V depend on the token and position alone)."""
    model = models(family)
    engine = Engine(model, max_num_seqs=1, block_length=LB, prefix_cache_bytes=0)
    held: dict[int, list[int]] = {}
    release = engine.blocks.release

    def keep_then_release(row: int) -> None:
        held[row] = engine.blocks.row_blocks(row, engine.blocks.allocated[row])
        release(row)

    engine.blocks.release = keep_then_release
    req = engine.submit([7, 8, 9, 10, 11], _params(gen_length=12, strategy="low_confidence_dynamic"))
    engine.run_until_idle()
    cohort = req.cohort
    last = ((cohort.n - 1) // LB) * LB if model.spec.block_causal else cohort.n - LB
    fresh = model.new_cache(1, cohort.n)
    model.forward(cohort.x, cache=fresh, block_size=LB if model.spec.block_causal else None)
    table = torch.tensor(held[0])
    for i in range(len(fresh.k)) if model.spec.block_causal else [0]:
        for pool, want in ((engine.cache.k[i], fresh.k[i]), (engine.cache.v[i], fresh.v[i])):
            kept = pool[table].flatten(0, 1)[:last]
            assert (kept - want[0, :last]).abs().max() < 1e-5, (family, i)


def test_admission_evicts_cache_blocks_nobody_holds_and_outputs_stay_identical(models):
    """A pool just big enough for two requests: the cache's blocks fill what the rows leave, and a
    request that needs them evicts the least recently used ones instead of waiting forever."""
    model = models("sdar")
    block = _block_bytes(model)
    params = _params()
    engine = Engine(model, max_num_seqs=2, block_length=LB, kv_cache_memory=13 * block)  # 12 usable
    cold = Engine(model, max_num_seqs=2, block_length=LB, prefix_cache_bytes=0)
    prompts = [[30 + i] * 4 + SYSTEM[: 8 + i % 3] for i in range(6)]  # 20-23 positions: 5-6 blocks each
    got = _run(engine, prompts, params, stagger=2)
    assert got == _run(cold, prompts, params, stagger=2)
    assert engine.prefix_cache.stats.evicted_blocks > 0
    assert engine.blocks.used == engine.prefix_cache.stats.blocks  # only the cache holds blocks now


def test_a_running_request_s_blocks_survive_eviction_pressure(models):
    model = models("sdar")
    block = _block_bytes(model)
    params = _params(gen_length=16)
    engine = Engine(model, max_num_seqs=2, block_length=LB, kv_cache_memory=16 * block)
    long = engine.submit(SYSTEM, params)
    engine.step()
    engine.step()  # its prompt blocks are cached (and held by it)
    mine = engine.blocks.row_blocks(0, 3)
    other = engine.submit([40] * 12, params)  # needs 7 blocks: only unheld cache blocks may go
    engine.run_until_idle()
    assert long.error is None and other.error is None
    assert all(engine.blocks.refs[b] >= 1 for b in mine)  # still cached (the only holder left)
    cold = Engine(model, max_num_seqs=2, block_length=LB, prefix_cache_bytes=0)
    assert long.output_ids == _run(cold, [SYSTEM], params)[0]


# ------------------------------------------------------------------------------ served


@pytest.mark.parametrize("process", ["in-process", "engine-process"])
def test_serve_on_a_paged_budget_answers_concurrent_requests_as_offline_and_reports_its_blocks(process):
    """``serve --kv-cache-memory`` of 10 blocks (less than one contiguous row of the embedded model),
    with the engine in the server's process and in its own (``--engine-process``): the start-up
    line describes the paged pool, ``/metrics`` its blocks, a request past the whole pool is the
    same 400 naming its blocks in both, four concurrent chats (each needs most of the pool: they wait for blocks,
    not rows) are answered as ``LLM.generate`` answers them, and at the end only the prefix cache
    holds blocks (none here: the embedded model is bidirectional)."""
    from pathlib import Path

    import openai

    from dinfer_rt.demo import task
    from dinfer_rt.llm import LLM
    from dinfer_rt.testing.serving import ServerProcess

    root = Path(__file__).resolve().parents[1]
    llm = LLM()
    block = kv_row_bytes(llm.model.spec, llm.model.dtype, 4)
    split = ["--engine-process"] if process == "engine-process" else []
    s = ServerProcess(
        "--strategy", "threshold", "--block-length", "8", "--gen-length", "16", "--max-num-seqs", "8",
        "--kv-cache-memory", str(11 * block), *split, cwd=root,
    )  # fmt: skip
    params = SamplingParams(strategy="threshold", block_length=8, gen_length=16)
    try:
        assert s.metric("dinfer_kv_blocks") == 10 and s.metric("dinfer_kv_pool_rows") == 8
        client = s.openai_client()
        model = client.models.list().data[0].id
        items = task.heldout(4)
        with pytest.raises(openai.BadRequestError) as refused:  # 2 + 48 positions: 13 blocks of 4 > 10
            client.completions.create(model=model, prompt="ab", max_tokens=48)
        why = str(refused.value)
        assert "need 13 KV blocks of 4 positions" in why and "the whole KV pool holds 10" in why, why

        answers = s.chats([item.letters for item in items])
        for item, got in zip(items, answers):
            assert got == llm.generate([item.letters], params)[0].text, item.letters
        assert s.metric("dinfer_kv_blocks_used") == 0
        s.proc.terminate()
        s.proc.wait(timeout=60)
        log = s.proc.stdout.read()
        where = " (the engine process)" if split else ""
        assert f"dinfer-rt KV pool{where}: paged, 10 blocks of 4 positions" in log, log[-2000:]
    finally:
        s.stop()


# ------------------------------------------------------------------------------ found in review


def test_entries_are_keyed_to_the_end_of_their_block_when_blocks_are_longer_than_pool_blocks(models):
    """Block length 8 on the default pool blocks of 4 (exact, block-causal): attention inside a
    block runs both ways, so positions 0-3 depend on tokens 4-7 too. A request that shares only
    tokens 0-3 must not leave entries a later request with other tokens 4-7 reuses: every hit
    equals a cold run and its cached K/V equal a fresh prefill's."""
    model = models("llada2")
    lb, params = 8, _params(block_length=8, strategy="low_confidence")
    rng = random.Random(0)
    t = [rng.randrange(6, model.spec.vocab) for _ in range(17)]
    a = t[:4] + [rng.randrange(6, model.spec.vocab) for _ in range(4)] + t[8:17]  # shares tokens 0-3 only
    engine = Engine(model, max_num_seqs=1, block_length=lb)
    cold = Engine(model, max_num_seqs=1, block_length=lb, prefix_cache_bytes=0)
    got = _run(engine, [a, t, t], params, stagger=40)
    assert got == _run(cold, [a, t, t], params, stagger=40)
    chain = engine.prefix_cache.match(t, lb, 4)
    fresh = model.new_cache(1, 16)
    model.forward(torch.tensor([t[:16]]), cache=fresh, block_size=lb)
    assert len(chain) == 4
    for node in chain:
        k, _ = engine.cached_kv(node)
        for i in range(len(k)):
            assert (k[i] - fresh.k[i][0, node.start : node.start + 4]).abs().max() < 1e-5, (node.start, i)


def test_a_shifted_logits_hit_copies_the_block_its_forward_writes_before_the_hit(models):
    """Dream (approximate): a forward computing from position c also runs c - 1 (its output
    predicts c); that write into a shared block is copied first, so the cached block is unchanged."""
    model = models("dream")
    params = _params(cache="prefix", strategy="low_confidence")
    base = [7, 19, 8, 30, 9, 41, 10, 52, 11, 23]
    engine = Engine(model, max_num_seqs=1, prefix_cache="approximate")
    _run(engine, [base + [20]], params)
    chain = engine.prefix_cache.match(base, LB, 2)
    before = [[t.clone() for t in engine.cached_kv(n)[0]] for n in chain]
    req = engine.submit(base + [33, 34], params)
    engine.run_until_idle()
    assert req.cached_tokens == 8 and engine.blocks.copied_blocks >= 1
    for node, snap in zip(chain, before):
        assert all(torch.equal(a, b) for a, b in zip(engine.cached_kv(node)[0], snap))


def test_a_request_that_fits_the_pool_exactly_is_admitted_with_a_shorter_hit_rather_than_waiting(models):
    """Block length 6 on pool blocks of 8, 3 usable blocks: the second request needs all 3 and its
    hit (6 positions) ends inside the cache's only block. Keeping that block would leave 2 free:
    it is admitted without the hit instead (never waiting forever), with a cold run's output."""
    model = models("sdar")
    params = _params(block_length=6, gen_length=6)
    block = kv_row_bytes(model.spec, model.dtype, 8)
    engine = Engine(model, max_num_seqs=2, block_length=6, kv_block_size=8, kv_cache_memory=4 * block)
    base = [7, 19, 8, 30, 9, 41, 10, 52, 11, 23, 12, 34]
    _run(engine, [base + [13, 14, 15, 16, 17]], params)  # 23 positions: 3 blocks
    assert engine.blocks.usable == 3 and engine.prefix_cache.stats.blocks >= 1
    req = engine.submit(base + [44, 45, 46, 47, 48], params)
    for _ in range(100):
        engine.step()
        if not engine.has_work():
            break
    assert req.finish_reason in ("stop", "length") and req.cached_tokens == 0
    cold = Engine(model, max_num_seqs=2, block_length=6, prefix_cache_bytes=0)
    assert req.output_ids == _run(cold, [base + [44, 45, 46, 47, 48]], params)[0]


def test_a_static_batch_larger_than_the_whole_pool_is_refused_naming_its_blocks(models):
    model = models("llada")
    engine = Engine(model, max_num_seqs=4, kv_cache_memory=9 * _block_bytes(model), prefix_cache_bytes=0)
    with pytest.raises(GenerationError, match="a batch of 3 prompts of up to 16 positions needs 12 KV blocks"):
        engine.submit_batch([[6] * 8, [7] * 8, [8] * 8], _params())
    assert not engine.has_work()


def test_rows_are_capped_by_the_blocks_and_a_block_longer_than_a_row_is_refused(models):
    model = models("llada")
    block = _block_bytes(model)
    engine = Engine(model, max_num_seqs=10**6, kv_cache_memory=27 * block, prefix_cache_bytes=0)
    assert engine.max_num_seqs == engine.kv_plan.rows == 26 and engine.blocks.table.shape[0] == 26
    with pytest.raises(GenerationError, match=r"kv_block_size 1000 \(--kv-block-size\) exceeds the 41 positions"):
        Engine(model, max_model_len=40, kv_block_size=1000)


def test_serve_refuses_a_paged_pool_too_small_for_its_default_request(capsys):
    from dinfer_rt.cli import main
    from dinfer_rt.llm import LLM

    block = _block_bytes(LLM().model)  # the embedded model: a default request (1 + 40 positions) needs 11
    assert main(["serve", "--port", "0", "--shutdown-after-s", "20", "--kv-cache-memory", str(3 * block)]) == 2
    err = capsys.readouterr().err
    assert "serve: every request would be refused with these defaults: prompt (1 tokens) + 40 generated" in err, err
    assert "need 11 KV blocks of 4 positions" in err and "the whole KV pool holds 2" in err, err
