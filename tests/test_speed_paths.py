"""The per-forward fast paths (issue #19): generated straight-line code, the CPU kernels' per-forward
memos, and the adaptive cache policy. Each must give what the slow path gives."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dinfer_rt
from dinfer_rt import plugins
from dinfer_rt.backends.cpu.kernels import AttentionKernels
from dinfer_rt.demo import task
from dinfer_rt.engine import run_batch
from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import DinferError
from dinfer_rt.executor import Executable
from dinfer_rt.ir import ops
from dinfer_rt.sampling import SamplingParams

FAMILIES = ["llada", "llada_gqa_sharded", "dream", "llada_moe", "llada2"]


def _interpreted_twin(exe: Executable) -> Executable:
    """The same graph, kernels and weights, run step by step."""
    twin = Executable.__new__(Executable)
    twin.__dict__.update(exe.__dict__)
    twin.run = twin._interpret
    return twin


def _inputs(model, cached: bool, head: str, b: int = 2, n: int = 10):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, model.spec.vocab, (b, n), generator=g)
    attn = torch.ones(b, n, dtype=torch.long)
    attn[-1, :3] = 0  # a left-padded row
    cache = model.new_cache(b, n) if cached else None
    compute = torch.arange(3, 7) if cached else None
    inputs, run, _ = model._inputs(ids, attn, cache, compute)
    if head == "confidence":
        inputs["select"] = torch.arange(len(run))[-2:]
    return inputs


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("head", ["logits", "confidence"])
def test_generated_code_equals_the_interpreted_executor(ckpt_dir, name, cached, head):
    model = dinfer_rt.load_model(ckpt_dir(name))
    exe = model.executable(cached, 4, head=head)
    assert exe.mode == "generated"
    want_inputs = _inputs(model, cached, head)
    got_inputs = {k: v.clone() for k, v in want_inputs.items()}
    want = _interpreted_twin(exe)(want_inputs)
    got = exe(got_inputs)
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for k in want_inputs:  # the caches were spliced alike
        assert torch.equal(got_inputs[k], want_inputs[k]), k


def test_generated_code_equals_interpreted_on_the_triton_interpreter(ckpt_dir, monkeypatch):
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    model = dinfer_rt.load_model(ckpt_dir("llada"), backend="cuda")
    exe = model.executable(True, head="confidence")
    inputs = _inputs(model, True, "confidence", b=1, n=8)
    twin_inputs = {k: v.clone() for k, v in inputs.items()}
    got, want = exe(inputs), _interpreted_twin(exe)(twin_inputs)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_input_check_skips_unchanged_inputs_but_still_catches_a_mismatch(ckpt_dir):
    """The caches come back as the same tensors every step: check_inputs binds their dims without
    matching them again, and a new input that disagrees with them is still refused."""
    model = dinfer_rt.load_model(ckpt_dir("llada"))
    exe = model.executable(True, None)
    inputs = _inputs(model, True, "logits")
    exe(inputs)
    calls = []
    for _, typ, _ in exe.input_slots:
        real = typ.matches
        object.__setattr__(typ, "matches", lambda t, b=None, real=real: calls.append(1) or real(t, b))
    try:
        exe(inputs)  # every input the same tensor: nothing matched again
        assert calls == []
        wrong = dict(inputs, input_ids=inputs["input_ids"][:1], positions=inputs["positions"][:1])
        wrong["key_valid"] = inputs["key_valid"][:1]
        with pytest.raises(DinferError, match="k_cache.0"):  # batch 1 against the caches' batch 2
            exe(wrong)
        resized = dict(inputs, **{"k_cache.0": inputs["k_cache.0"].clone()[:1]})
        with pytest.raises(DinferError, match="k_cache.0"):  # a new cache tensor is matched again
            exe(resized)
        cache = inputs["k_cache.0"]
        cache.data = cache.data.double()  # the same tensor object, another dtype: matched again
        with pytest.raises(DinferError, match="'k_cache.0' is torch.float64"):
            exe(inputs)
    finally:
        for _, typ, _ in exe.input_slots:
            object.__delattr__(typ, "matches")


def test_generated_source_frees_every_intermediate_after_its_last_use(ckpt_dir):
    exe = dinfer_rt.load_model(ckpt_dir("llada_moe")).executable(True)
    lines = exe.source.splitlines()
    freed = 0
    for i, line in enumerate(lines):
        if line.strip().startswith("del "):
            for name in line.strip()[4:].split(", "):
                freed += 1
                later = [ln for ln in lines[i + 1 :] if re.search(rf"\b{name}\b", ln)]
                assert not later, f"{name} is used after its del: {later[0]}"
    internal = sum(1 for st in exe.steps for _ in st.free)
    assert freed == internal > 0
    assert sum(1 for ln in lines if " = k" in ln) == len(exe.steps)


def test_unknown_executor_mode_is_refused(ckpt_dir, monkeypatch):
    monkeypatch.setenv("DINFER_EXECUTOR", "jit")
    with pytest.raises(DinferError, match="executor mode 'jit' unknown.*DINFER_EXECUTOR.*generated, interpreted"):
        dinfer_rt.load_model(ckpt_dir("llada"))


def test_interpreted_mode_from_the_environment(ckpt_dir, monkeypatch):
    monkeypatch.setenv("DINFER_EXECUTOR", "interpreted")
    model = dinfer_rt.load_model(ckpt_dir("llada"))
    assert model.executable(False).mode == "interpreted"


def _rope_attention_case(g, dtype=torch.float32):
    q = torch.randn(2, 5, 4, 8, generator=g).to(dtype)
    k = torch.randn(2, 5, 2, 8, generator=g).to(dtype)
    v = torch.randn(2, 5, 2, 8, generator=g).to(dtype)
    key_valid = torch.ones(2, 5, dtype=torch.bool)
    return q, k, v, key_valid, torch.arange(5)


ATTRS = dict(scale=0.3, block_size=None, theta=10000.0, rotary_dim=8, eps=1e-6)


def test_cpu_memos_follow_in_place_changes_and_new_tensors():
    """The memo keys on the tensor object and its version: an in-place edit or a new tensor with
    other values must never reuse stale angles or masks."""
    g = torch.Generator().manual_seed(0)
    kern = AttentionKernels()
    q, k, v, key_valid, ti = _rope_attention_case(g)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])

    def check():
        args = (q, k, v, key_valid, ti, positions, None, None, None, None)
        torch.testing.assert_close(kern.rope_attention(*args, **ATTRS), ops.rope_attention(*args, **ATTRS))

    check()
    positions += 300  # in place: the table must grow and the angles be gathered again
    check()
    positions = torch.tensor([[5, 4, 3, 2, 1], [0, 0, 0, 0, 0]])  # a new tensor
    check()
    key_valid[1, :2] = False  # padding appears in place: the mask must come back
    check()
    key_valid = torch.ones(2, 5, dtype=torch.bool)
    check()


def test_cpu_fast_kernels_equal_the_reference_in_float64():
    g = torch.Generator().manual_seed(1)
    kern = AttentionKernels()
    q, k, v, key_valid, ti = _rope_attention_case(g, torch.float64)
    key_valid[0, 0] = False
    positions = torch.randint(0, 50, (2, 5), generator=g)
    qn, kn = torch.rand(8, dtype=torch.float64, generator=g), torch.rand(8, dtype=torch.float64, generator=g)
    for attrs in (ATTRS, {**ATTRS, "block_size": 2, "rotary_dim": 4}):
        args = (q, k, v, key_valid, ti, positions, qn, kn, None, None)
        got, want = kern.rope_attention(*args, **attrs), ops.rope_attention(*args, **attrs)
        assert (got - want).abs().max() < 1e-12


def _decode(model, prompts, args: EngineArgs | None = None, **kw):
    params = SamplingParams(gen_length=8, block_length=4, strategy="threshold", threshold=0.5, early_stop=False, **kw)
    return run_batch(model, prompts, params, args=args)


@pytest.mark.parametrize("cache", ["adaptive", "anchored", "delayed"])
@pytest.mark.parametrize("name", ["llada", "dream", "llada_moe"])
def test_refreshing_caches_with_bound_zero_are_no_cache_decoding(ckpt_dir, name, cache):
    model = dinfer_rt.load_model(ckpt_dir(name))
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14]]
    plain = _decode(model, prompts)
    cached = _decode(model, prompts, cache=cache, refresh_bound=0)
    assert torch.equal(plain.tokens, cached.tokens)
    assert plain.nfe == cached.nfe


@pytest.mark.parametrize("cache", ["adaptive", "anchored", "delayed"])
def test_refreshing_caches_bound_zero_equal_no_cache_on_the_embedded_task(cache):
    llm = dinfer_rt.LLM()
    items = [it.letters for it in task.heldout(24)]
    kw = dict(strategy="threshold", block_length=8, batch_size=24, early_stop=False)
    plain = llm.generate(items, SamplingParams(**kw))
    cached = llm.generate(items, SamplingParams(cache=cache, refresh_bound=0, **kw))
    assert [o.token_ids for o in plain] == [o.token_ids for o in cached]


def test_adaptive_and_anchored_caches_keep_the_embedded_task_where_dual_breaks_it():
    """The prompt listens to the block: recomputing it each step keeps accuracy (adaptive and
    anchored measured 100% on 200 items), the dual cache's stale prompt K/V do not (1.5%)."""
    llm = dinfer_rt.LLM()
    items = task.heldout(40)
    kw = dict(strategy="threshold", block_length=8, batch_size=40, early_stop=False)

    def accuracy(**extra):
        outs = llm.generate([it.letters for it in items], SamplingParams(**kw, **extra))
        return sum(task.check(it.letters, o.text) for it, o in zip(items, outs)) / len(items)

    assert accuracy(cache="adaptive") >= 0.95
    assert accuracy(cache="anchored") >= 0.95
    assert accuracy(cache="dual") <= 0.2


def test_delayed_cache_computes_the_prompt_the_masked_slots_and_the_last_commits(ckpt_dir, monkeypatch):
    """After the first (full) forward a delayed step computes the prompt, the block's masked slots
    and the slots the previous step committed (their K/V once more, now from their tokens)."""
    from dinfer_rt.model import Model

    model = dinfer_rt.load_model(ckpt_dir("llada"))
    seen, confidence = [], Model.confidence

    def spy(self, x, attn=None, **kw):
        seen.append((x.clone(), kw["compute"].tolist()))
        return confidence(self, x, attn, **kw)

    monkeypatch.setattr(Model, "confidence", spy)
    p_len, n, block = 3, 11, 4
    res = _decode(model, [[7, 8, 9]], cache="delayed")
    assert res.nfe == len(seen) >= 3 and seen[0][1] == list(range(n))
    for (before, _), (x, compute) in zip(seen, seen[1:]):
        masked = (x[0] == model.mask_id).nonzero().flatten().tolist()
        s = p_len + (masked[0] - p_len) // block * block
        active = {q for q in masked if q < s + block} | set((before[0] != x[0]).nonzero().flatten().tolist())
        assert compute == sorted(set(range(p_len)) | active)
        assert len(compute) < n


def test_delayed_cache_decides_the_same_with_the_native_commit_and_on_the_host(monkeypatch):
    """The CPU backend's native commit kernel and the host rule see the same computed slots (the
    batch's union of masked and just-committed slots), so they commit the same tokens."""
    llm = dinfer_rt.LLM()
    items = [it.letters for it in task.heldout(12)]
    params = SamplingParams(strategy="threshold", cache="delayed", block_length=40, batch_size=12, early_stop=False)
    assert llm.model.backend.commit_kernel() is not None  # native.c is built here
    native = llm.generate(items, params)
    monkeypatch.setattr(type(llm.model.backend), "commit_kernel", lambda self: None)
    host = llm.generate(items, params)
    assert [o.token_ids for o in native] == [o.token_ids for o in host]


@settings(max_examples=12, deadline=None)
@given(
    cache=st.sampled_from(["adaptive", "anchored", "delayed"]),
    bound=st.one_of(st.none(), st.integers(0, 10)),
    window=st.one_of(st.none(), st.integers(0, 6)),
    block=st.sampled_from([2, 4, 8]),
    threshold=st.floats(0.05, 0.99),
)
def test_refreshing_caches_keep_the_scheduler_invariants(ckpt_dir, cache, bound, window, block, threshold):
    model = dinfer_rt.load_model(ckpt_dir("llada"))
    params = SamplingParams(
        gen_length=8,
        block_length=block,
        strategy="threshold",
        threshold=threshold,
        cache=cache,
        refresh_bound=bound,
        refresh_window=window,
        early_stop=False,
    )
    res = run_batch(model, [[7, 8, 9], [10, 11]], params)
    assert not (res.tokens == model.mask_id).any()  # every slot committed
    assert res.committed.tolist() == [8, 8]  # each exactly once
    assert (res.commit_step >= 0).all() and (res.commit_step < res.nfe).all()
    blocks = res.commit_step.view(2, -1, block).amax(-1)  # a block finishes before the next commits
    firsts = res.commit_step.view(2, -1, block).amin(-1)
    assert (firsts[:, 1:] > blocks[:, :-1]).all()


def test_backend_kernel_table_names_the_cpu_fast_kernels():
    table = plugins.select_backend("cpu").kernel_table()
    for op in ("attention", "rope_attention", "rms_norm", "add_rms_norm", "swiglu"):
        kernel, source = table[op]
        assert source == "native" and kernel is not ops.OPS[op].reference, op


@pytest.mark.parametrize("kind", ["max", "margin", "entropy"])
@pytest.mark.parametrize("chunk", [7, 8, 64])  # online state across chunks (banned id on a boundary), one chunk
def test_cpu_confidence_head_paths_equal_the_reference(kind, chunk):
    from dinfer_rt.backends.cpu.kernels import lm_head_confidence_chunked

    g = torch.Generator().manual_seed(2)
    h = torch.randn(3, 4, 16, dtype=torch.float64, generator=g)
    w = torch.randn(40, 16, dtype=torch.float64, generator=g)
    got = lm_head_confidence_chunked(h, w, banned=8, kind=kind, chunk=chunk)
    want = ops.lm_head_confidence(h, w, banned=8, kind=kind)
    assert (got[0] - want[0]).abs().max() < 1e-12
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("budget, chunks", [(1 << 20, 1), (12 * 10, 4)])
def test_cpu_confidence_head_widens_its_chunk_to_the_logits_budget(monkeypatch, budget, chunks):
    """12 rows x 40 vocabulary: one chunk under the default budget, 10-column chunks under a
    budget of 120 logits; the reference's values either way."""
    from dinfer_rt.backends.cpu import kernels

    monkeypatch.setattr(kernels, "LOGITS_BUDGET", budget)
    calls, linear = [], torch.nn.functional.linear
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(3, 4, 16, generator=g), torch.randn(40, 16, generator=g)
    spy = lambda *a: calls.append(a[1].shape[0]) or linear(*a)  # noqa: E731
    got = kernels.lm_head_confidence_budgeted(h, w, banned=8, kind="entropy", chunk=4, linear=spy)
    assert len(calls) == chunks
    want = ops.lm_head_confidence(h.double(), w.double(), banned=8, kind="entropy")
    assert (got[0].double() - want[0]).abs().max() < 1e-5 and torch.equal(got[1], want[1])


@pytest.mark.parametrize("cache", ["none", "dual", "adaptive", "anchored", "delayed"])
@pytest.mark.parametrize("head", [True, False])
def test_row_slices_of_a_big_forward_decode_like_one_forward(ckpt_dir, cache, head):
    """``max_forward_tokens`` runs a batch's forward in row slices (each writing its rows of the
    KV cache in place): the decisions are those of one whole-batch forward."""
    model = dinfer_rt.load_model(ckpt_dir("dream"))  # padding-derived positions: slices must keep them
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14], [15], [16, 17]]
    whole = _decode(model, prompts, EngineArgs(max_forward_tokens=None, confidence_head=head), cache=cache)
    # 13 // 13 positions: one row per slice
    sliced = _decode(model, prompts, EngineArgs(max_forward_tokens=13, confidence_head=head), cache=cache)
    assert torch.equal(whole.tokens, sliced.tokens)
    assert whole.nfe == sliced.nfe


def test_confidence_select_memo_follows_in_place_changes(ckpt_dir):
    """Model.confidence keeps the checked head rows of a select tensor that comes back; an
    in-place change of it (or of compute) is checked again, never served stale."""
    model = dinfer_rt.load_model(ckpt_dir("llada"))
    ids = torch.randint(0, 50, (1, 12))
    cache = model.new_cache(1, 12)
    model.forward(ids, cache=cache)  # fill the cache
    compute, select = torch.arange(4, 12), torch.arange(6, 10)
    first = model.confidence(ids, select=select, cache=cache, compute=compute)
    again = model.confidence(ids, select=select, cache=cache, compute=compute)
    assert torch.equal(first[1], again[1]) and torch.allclose(first[0], again[0])
    fresh = model.confidence(ids, select=select.clone(), cache=cache, compute=compute)
    assert torch.equal(first[1], fresh[1])
    select[0] = 2  # position 2 is not computed
    with pytest.raises(DinferError, match="every selected position must be computed"):
        model.confidence(ids, select=select, cache=cache, compute=compute)
