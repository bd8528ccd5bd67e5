"""The shared scheduler: exactness against a plain LLaDA ``generate``, rule invariants, caches, batching."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dinfer_rt
from dinfer_rt import strategies
from dinfer_rt.engine import run_batch
from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import GenerationError
from dinfer_rt.sampling import STRATEGIES, SamplingParams


def reference_llada_generate(model, prompts, gen_length, block_length, steps, cfg_scale=0.0):
    """ML-GSAI/LLaDA ``generate`` (docs/decoding.md) written plainly: T=0, low-confidence remasking,
    left padding with an attention mask, a Python loop over rows for the top-k. One deliberate
    deviation shared with dinfer-rt: the mask token's logit is banned before argmax/softmax."""
    mask_id = model.mask_id
    p = max(len(q) for q in prompts)
    b = len(prompts)
    x = torch.full((b, p + gen_length), mask_id, dtype=torch.long)
    attn = torch.ones(b, p + gen_length, dtype=torch.long)
    for r, q in enumerate(prompts):
        x[r, : p - len(q)] = model.pad_id
        attn[r, : p - len(q)] = 0
        x[r, p - len(q) : p] = torch.tensor(q)
    nb = gen_length // block_length
    sb = steps // nb
    for blk in range(nb):
        lo, hi = p + blk * block_length, p + (blk + 1) * block_length
        k = (x[:, lo:hi] == mask_id).sum(-1)
        plan = [[int(k[r]) // sb + (1 if j < int(k[r]) % sb else 0) for j in range(sb)] for r in range(b)]
        for j in range(sb):
            masked = x == mask_id
            am = attn if (attn == 0).any() else None
            if cfg_scale == 0:
                logits = model.forward(x, am).double()
            else:
                un = x.clone()
                un[:, :p] = mask_id  # prompt (and its padding) masked in the unconditional row
                both = model.forward(torch.cat((x, un)), None if am is None else torch.cat((am, am))).double()
                c, u = both.chunk(2)
                logits = u + (cfg_scale + 1) * (c - u)
            logits[..., mask_id] = float("-inf")
            x0 = logits.argmax(-1)
            conf = logits.softmax(-1).gather(-1, x0[..., None]).squeeze(-1)
            conf[:, hi:] = float("-inf")
            conf = torch.where(masked, conf, torch.tensor(float("-inf"), dtype=conf.dtype))
            x0 = torch.where(masked, x0, x)
            for r in range(b):
                if plan[r][j] == 0:
                    continue
                idx = conf[r].topk(plan[r][j]).indices
                x[r, idx] = x0[r, idx]
    return x[:, p:]


@pytest.mark.parametrize("batch", [[[7, 8, 9, 10]], [[7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18]]])
def test_one_token_per_step_equals_reference_llada_generate(ckpt_dir, batch):
    model = dinfer_rt.load_model(ckpt_dir("llada"))
    params = SamplingParams(gen_length=12, block_length=4, strategy="low_confidence", early_stop=False)
    got = run_batch(model, batch, params)
    want = reference_llada_generate(model, batch, 12, 4, 12)
    assert torch.equal(got.tokens, want)
    assert got.nfe == 12


def test_classifier_free_guidance_equals_reference(ckpt_dir):
    model = dinfer_rt.load_model(ckpt_dir("llada"))
    prompts = [[7, 8, 9, 10], [11, 12]]
    params = SamplingParams(gen_length=8, block_length=4, cfg_scale=1.5, early_stop=False)
    got = run_batch(model, prompts, params)
    assert torch.equal(got.tokens, reference_llada_generate(model, prompts, 8, 4, 8, cfg_scale=1.5))
    assert not torch.equal(got.tokens, reference_llada_generate(model, prompts, 8, 4, 8))


def test_batched_greedy_equals_each_prompt_alone(ckpt_dir):
    model = dinfer_rt.load_model(ckpt_dir("llada"))
    prompts = [[7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18]]
    for strategy in ("low_confidence", "threshold"):
        params = SamplingParams(gen_length=8, block_length=4, strategy=strategy, threshold=0.3, early_stop=False)
        together = run_batch(model, prompts, params).tokens
        for r, p in enumerate(prompts):
            alone = run_batch(model, [p], params).tokens
            assert torch.equal(together[r], alone[0]), (strategy, r)


@pytest.mark.parametrize("name", ["llada", "dream", "llada_moe", "llada2"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "vicinity", "adaptive", "anchored", "delayed"])
def test_every_family_and_cache_policy_decodes_to_completion(ckpt_dir, name, cache):
    model = dinfer_rt.load_model(ckpt_dir(name))
    params = SamplingParams(
        gen_length=8,
        block_length=4,
        strategy="threshold",
        threshold=0.5,
        cache=cache,
        early_stop=False,
        vicinity_warmup=1,
    )
    res = run_batch(model, [[7, 8, 9], [10, 11]], params)
    assert not (res.tokens == model.mask_id).any()
    assert 2 <= res.nfe <= 8
    assert res.committed.tolist() == [8, 8]


@pytest.mark.parametrize("cache", ["prefix", "dual", "adaptive", "anchored", "delayed"])
def test_caches_are_exact_on_a_block_causal_model(ckpt_dir, cache):
    """On LLaDA2 (block-causal) earlier blocks never see later ones, so K/V cached at a block's start
    never go stale inside the block: cached decoding equals uncached decoding token for token.
    (On bidirectional models the caches are approximate by design; the benchmark measures that.)"""
    model = dinfer_rt.load_model(ckpt_dir("llada2"))
    base = SamplingParams(gen_length=8, block_length=4, strategy="low_confidence", early_stop=False)
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]  # blocks aligned to 0: the first holds the prompt tail
    plain = run_batch(model, prompts, base)
    base.cache = cache
    cached = run_batch(model, prompts, base)
    assert torch.equal(plain.tokens, cached.tokens)
    assert not (plain.tokens == model.mask_id).any()
    assert plain.nfe == cached.nfe


def test_sync_every_counts_wasted_forwards(ckpt_dir):
    model = dinfer_rt.load_model(ckpt_dir("llada"))
    p = SamplingParams(gen_length=8, block_length=8, strategy="threshold", threshold=0.01, early_stop=False)
    once = run_batch(model, [[7, 8]], p)
    unrolled = run_batch(model, [[7, 8]], p, args=EngineArgs(sync_every=4))
    assert torch.equal(once.tokens, unrolled.tokens)
    assert unrolled.nfe >= once.nfe and unrolled.nfe % 4 == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gen_length": 10, "block_length": 4}, "gen_length 10 is not a multiple of block_length 4"),
        ({"threshold": 1.5}, "threshold 1.5 must be in (0, 1]"),
        ({"threshold": 0.0}, "threshold 0.0 must be in (0, 1]"),
        ({"strategy": "greedy"}, "unknown strategy 'greedy'"),
        ({"cache": "paged"}, "unknown cache 'paged'"),
        ({"cfg_scale": 1.0, "cache": "dual"}, "supports cache='none' only"),
        ({"steps": 3, "gen_length": 8, "block_length": 4}, "steps 3 must be a positive multiple of the 2 blocks"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(GenerationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**kwargs).validate()


def test_prompt_too_long_and_empty_prompt(ckpt_dir):
    llm = dinfer_rt.LLM(ckpt_dir("llada"))
    with pytest.raises(GenerationError, match="exceeds the model's max length 256"):
        llm.generate([[7] * 250], SamplingParams(gen_length=8, block_length=8))
    with pytest.raises(GenerationError, match="is an empty prompt"):
        llm.generate("   ")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rules_keep_their_tensors_on_the_logits_device(strategy, temperature):
    """Every rule runs on the device its logits live on (the first H200 runs found credit,
    hierarchical and the sampler building tensors on the host, and credit mixing in the host-side
    mask). On these CPU machines the logits go to torch's ``meta`` device, which refuses host
    tensors the way CUDA does."""
    rule = strategies.build(SamplingParams(strategy=strategy, temperature=temperature).validate())
    logits = torch.randn(2, 5, 7).to("meta")
    # as the scheduler holds them: the mask and the quota on the host, the logits on the device
    masked = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    quota = torch.tensor([2, 1])
    gen = torch.Generator().manual_seed(0)
    x0, commit = rule(strategies.on_logits_device(logits, masked, quota, temperature, gen, {}))
    assert (x0.device.type, commit.device.type) == ("meta", "meta")
    assert x0.shape == commit.shape == (2, 5)


# ------------------------------------------------------------------ rule invariants (hypothesis)


@settings(max_examples=60, deadline=None)
@given(
    strategy=st.sampled_from(STRATEGIES),
    seed=st.integers(0, 10_000),
    length=st.integers(1, 12),
    batch=st.integers(1, 3),
    temperature=st.sampled_from([0.0, 1.0]),
)
def test_rule_invariants_over_random_logits(strategy, seed, length, batch, temperature):
    """Never commits the mask token or an unmasked slot, >= 1 commit per step per row with masks,
    committed tokens never change, and the block finishes within ``length`` steps."""
    mask_id, vocab = 3, 9
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(strategy=strategy, threshold=0.7, temperature=temperature).validate()
    rule = strategies.build(params)
    x = torch.full((batch, length), mask_id)
    x[:, 0] = torch.where(torch.rand(batch, generator=g) < 0.5, 1, mask_id)  # some rows start partly decoded
    plan = strategies.linear_schedule((x == mask_id).sum(-1), length)
    state: dict = {}
    for step in range(length):
        masked = x == mask_id
        if not masked.any():
            break
        logits = torch.randn(batch, length, vocab, generator=g) * 3
        logits[..., mask_id] += 10  # the model loves the mask token: it must still never be committed
        logits[..., mask_id] = float("-inf")  # (the scheduler bans it before any rule runs)
        quota = plan[:, step] if strategy in strategies.SCHEDULED else torch.ones(batch, dtype=torch.long)
        x0, commit = rule(strategies.StepInput(logits, masked, quota, temperature, g, state))
        assert not (commit & ~masked).any()
        assert ((commit.sum(-1) >= 1) | ~masked.any(-1)).all()
        assert not (x0[commit] == mask_id).any()
        before = x.clone()
        x = torch.where(commit, x0, x)
        assert torch.equal(x[~masked], before[~masked])
    assert not (x == mask_id).any()


@pytest.mark.parametrize("name", ["llada", "dream", "llada2"])
@pytest.mark.parametrize("strategy", strategies.STATS_ONLY)
@pytest.mark.parametrize("cache", ["none", "dual", "vicinity", "adaptive", "anchored", "delayed"])
def test_confidence_head_equals_the_logits_path(ckpt_dir, name, strategy, cache):
    """Greedy threshold-style rules through the fused confidence head (LM head only at masked
    positions, no [positions x vocab] probabilities) commit exactly what the logits path commits."""
    model = dinfer_rt.load_model(ckpt_dir(name))
    kw = dict(
        gen_length=8, block_length=4, strategy=strategy, threshold=0.3, cache=cache, early_stop=False, vicinity_warmup=1
    )
    fused = run_batch(model, [[7, 8, 9], [10, 11]], SamplingParams(**kw))
    plain = run_batch(model, [[7, 8, 9], [10, 11]], SamplingParams(**kw), args=EngineArgs(confidence_head=False))
    assert torch.equal(fused.tokens, plain.tokens) and fused.nfe == plain.nfe
    graph = model.executable(cache != "none", 4, head="confidence").graph
    assert graph.op_counts().get("lm_head_confidence") == 1
    last = {f"layers.{model.spec.n_layers - 1}.{w}" for w in ("o", "down", "experts_down")}
    tail = [n for n in graph.nodes if any(v is not None and v.kind == "param" and v.name in last for v in n.inputs)]
    assert tail and all(n.outputs[0].type.shape[1] == "M" for n in tail)  # the last layer after attention: M rows


def test_cache_pool_lends_zeroed_buffers_once_and_keeps_few(ckpt_dir):
    """The scheduler's KV caches come from the model's pool: a returned cache of the same shape is
    lent again (same addresses, zeroed like a new one), a cache in use is never lent twice, and
    only the ``keep`` most recently returned idle caches are held."""
    from dinfer_rt.model import CachePool

    model = dinfer_rt.load_model(ckpt_dir("llada"), backend="cpu")
    assert model.cache_pool.keep == 0  # no graphs on the cpu backend: caches are freed as before
    pool = CachePool(model.new_cache, keep=2)  # as a backend that replays graphs gets
    a = pool.acquire(2, 12)
    b = pool.acquire(2, 12)  # a is in use: a second buffer
    assert a.k[0].data_ptr() != b.k[0].data_ptr()
    a.k[0].fill_(1.0)
    a.v[-1].fill_(2.0)
    pool.release(a)
    again = pool.acquire(2, 12)
    assert again.k[0].data_ptr() == a.k[0].data_ptr()
    assert not any(t.any() for t in (*again.k, *again.v))  # zeroed, as a new cache
    assert pool.acquire(1, 12).length == 12 and pool.acquire(2, 16).k[0].shape[:2] == (2, 16)  # other shapes: new
    for cache in (again, b, pool.acquire(3, 12)):
        pool.release(cache)
    assert len(pool.idle) == pool.keep == 2 and all(c is not again for c in pool.idle)  # the oldest went


def test_generate_returns_its_cache_to_the_pool_even_on_error(ckpt_dir):
    """A cached generate hands its cache back when it ends, also when a stop callback raises."""
    model = dinfer_rt.load_model(ckpt_dir("llada"), backend="cpu")
    model.cache_pool.keep = 2  # as a backend that replays graphs sets it
    params = SamplingParams(strategy="threshold", cache="dual", gen_length=8, block_length=4)
    run_batch(model, [[5, 6, 7]], params)
    (cache,) = model.cache_pool.idle

    def boom(row, tokens):
        raise RuntimeError("stop check failed")

    with pytest.raises(RuntimeError, match="stop check failed"):
        run_batch(model, [[5, 6, 7]], params, stop=boom)
    assert len(model.cache_pool.idle) == 1 and model.cache_pool.idle[0] is cache  # lent, and back again
