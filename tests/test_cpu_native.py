"""The CPU backend's native kernels (backends/cpu/native.c): the float64 reference, the torch
kernels they replace, their bounds check, the fallbacks, and a model decoding the same tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dinfer_rt
from dinfer_rt import envs
from dinfer_rt.backends.cpu import native
from dinfer_rt.backends.cpu.kernels import AttentionKernels, NativeRowKernels, add_rms_norm, rms_norm
from dinfer_rt.engine import run_batch
from dinfer_rt.ir import ops
from dinfer_rt.loader import EMBEDDED_MODEL
from dinfer_rt.sampling import SamplingParams


@pytest.fixture(scope="module")
def fast(native_build) -> native.NativeKernels:
    """Every test taking it runs once per vector width this CPU has (conftest.native_build)."""
    return native.NativeKernels(native_build.lib)


@pytest.fixture
def fresh_load(monkeypatch):
    """native.load() re-run under the test's environment, and forgotten afterwards."""
    native.load.cache_clear()
    yield native.load
    native.load.cache_clear()


def _close(got: torch.Tensor, want64: torch.Tensor, tol: float = 2e-6) -> None:
    err = (got.double() - want64).abs().max().item()
    assert err <= tol * max(1.0, want64.abs().max().item()), err


@pytest.mark.parametrize("dim", [192, 33, 8])
def test_norms_match_float64_and_the_torch_kernels(fast, dim):
    g = torch.Generator().manual_seed(dim)
    x, r = torch.randn(3, 5, dim, generator=g), torch.randn(3, 5, dim, generator=g)
    w = torch.rand(dim, generator=g) + 0.5
    norms = NativeRowKernels(fast)
    want = ops.rms_norm(x.double(), w.double(), eps=1e-5)
    _close(norms.rms_norm(x, w, eps=1e-5), want)
    torch.testing.assert_close(norms.rms_norm(x, w, eps=1e-5), rms_norm(x, w, eps=1e-5), rtol=1e-6, atol=1e-6)
    out, total = norms.add_rms_norm(x, r, w, eps=1e-5)
    want_out, want_total = ops.add_rms_norm(x.double(), r.double(), w.double(), eps=1e-5)
    _close(out, want_out)
    _close(total, want_total)
    torch_out, _ = add_rms_norm(x, r, w, eps=1e-5)
    torch.testing.assert_close(out, torch_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 96: above PARALLEL_MIN_ELEMENTS, split over threads
def test_swiglu_matches_float64_and_torch_without_overflow(fast, rows):
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 2 * 96, generator=g) * 4
    h[0, :4] = torch.tensor([-100.0, 100.0, -1e-30, 0.0])  # exp(-|x|) underflows to 0, never overflows
    got = NativeRowKernels(fast).swiglu(h)
    _close(got, ops.swiglu(h.double()))
    torch.testing.assert_close(got, ops.swiglu(h), rtol=1e-6, atol=1e-6)
    assert NativeRowKernels(fast).swiglu(h.double()).dtype == torch.float64  # other dtypes: the torch kernel
    assert fast.swiglu(h[:, :-1].contiguous()) is None  # an odd last dim is not [gate | up]


def test_norms_hand_other_layouts_to_torch(fast):
    x = torch.randn(4, 6, dtype=torch.float64)
    assert fast.rms_norm(x, torch.ones(6, dtype=torch.float64), 1e-5) is None  # float64: the oracle's path
    strided = torch.randn(6, 4).t()
    assert fast.rms_norm(strided, torch.ones(6), 1e-5) is None
    norms = NativeRowKernels(fast)
    _close(
        norms.rms_norm(strided, torch.ones(6), eps=1e-5),
        ops.rms_norm(strided.double(), torch.ones(6).double(), eps=1e-5),
    )


def _qkv(g, b, t, h, kv, d):
    """q, k, v as the fused QKV projection leaves them: strided views of one [B, T, (H+2KV)D] tensor."""
    fused = torch.randn(b, t, (h + 2 * kv) * d, generator=g)
    q, k, v = fused.split([h * d, kv * d, kv * d], dim=-1)
    return q.unflatten(-1, (h, d)), k.unflatten(-1, (kv, d)), v.unflatten(-1, (kv, d))


CASES = {
    # name: (B, T, H, KV, D, rotary_dim, qk_norm, cache rows S (None: no cache), per-row slots,
    #        padding (1: one key of row 1, "row": every key of row 1), block size)
    "no-cache": (2, 5, 4, 4, 8, 8, False, None, False, 0, None),
    "no-cache-gqa-partial-rotary-padding": (2, 5, 4, 2, 16, 8, False, None, False, 1, None),
    "qk-norm": (1, 6, 2, 2, 8, 8, True, None, False, 0, None),
    "cache-shared-slots": (2, 3, 4, 2, 8, 8, False, 9, False, 1, None),
    "cache-per-row-slots": (2, 3, 4, 4, 8, 4, True, 9, True, 0, None),
    "cache-fully-padded-row": (2, 3, 4, 2, 8, 8, False, 9, False, "row", None),
    "cache-block-causal": (2, 3, 4, 2, 8, 8, False, 9, False, 1, 4),
    # above PARALLEL_MIN_WORK multiply-adds: the (row, kv head) pairs split over OpenMP threads
    "threaded-no-cache-gqa": (3, 40, 4, 2, 16, 16, False, None, False, 1, None),
    "threaded-cache-per-row-slots": (3, 7, 4, 4, 16, 8, True, 100, True, "row", None),
    # the register tiles' edges: 32 + 16 dims, 32 + scalar dims, query rows not a multiple of 4,
    # keys not a multiple of 16
    "tiles-d48-gqa-21-rows": (2, 7, 6, 2, 48, 48, False, None, False, 1, None),
    "tiles-d40-cache-37-keys": (2, 5, 4, 4, 40, 40, True, 37, True, "row", None),
}


@pytest.mark.parametrize("core", ["native", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_rope_attention_matches_float64_reference(fast, monkeypatch, case, core):
    """Both native routes: the whole op in C (few scores), and C rotary + K/V writes then SDPA
    (many scores, or a block-causal mask)."""
    if core == "sdpa":
        monkeypatch.setattr(native, "MAX_NATIVE_SCORES", 0)
        monkeypatch.setattr(native, "MAX_NATIVE_KEYS", 0)
    b, t, h, kv, d, rot, qk_norm, s, per_row, padding, block = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    q, k, v = _qkv(g, b, t, h, kv, d)
    attrs = dict(scale=d**-0.5, block_size=block, theta=10000.0, rotary_dim=rot, eps=1e-6)
    qn = kn = None
    if qk_norm:
        qn, kn = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    caches = (None, None)
    if s is None:
        slots = torch.arange(t)
        positions = torch.randint(0, 40, (b, t), generator=g)
        key_valid = torch.ones(b, t, dtype=torch.bool)
    else:
        caches = (torch.randn(b, s, kv, d, generator=g), torch.randn(b, s, kv, d, generator=g))
        slots = (
            torch.stack([torch.randperm(s, generator=g)[:t] for _ in range(b)]) if per_row else torch.tensor([6, 2, 4])
        )
        positions = slots if per_row else slots.expand(b, t).contiguous()
        key_valid = torch.ones(b, s, dtype=torch.bool)
    if padding == 1:
        key_valid[1, 0] = False
    elif padding == "row":
        key_valid[1] = False  # a query that may see nothing sees everything (ir.ops.attention_mask)
    kern = AttentionKernels(fast)
    whole, real = [], fast.rope_attention
    monkeypatch.setattr(fast, "rope_attention", lambda *a: whole.append(r := real(*a)) or r)
    ref_caches = tuple(None if c is None else c.double().clone() for c in caches)
    got = kern.rope_attention(q, k, v, key_valid, slots, positions, qn, kn, *caches, **attrs)
    assert any(r is not None for r in whole) == (core == "native" and block is None)  # the route tested
    d64 = [None if x is None else x.double() for x in (q, k, v, qn, kn)]
    want = ops.rope_attention(*d64[:3], key_valid, slots, positions, *d64[3:], *ref_caches, **attrs)
    if s is None:
        _close(got, want)
    else:
        for got_i, want_i in zip(got, want):  # the output and both caches, written in place
            _close(got_i, want_i)
        assert got[1] is caches[0] and got[2] is caches[1]


def test_rope_attention_rejects_slots_outside_the_cache(fast):
    """The native write has no bounds check of its own: the kernel checks once per forward."""
    g = torch.Generator().manual_seed(0)
    q, k, v = _qkv(g, 1, 2, 2, 2, 8)
    kc, vc = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8)
    attrs = dict(scale=0.3, block_size=None, theta=10000.0, rotary_dim=8, eps=1e-6)
    kern = AttentionKernels(fast)
    with pytest.raises(IndexError, match=r"token_index holds slots outside \[0, 4\)"):
        kern.rope_attention(q, k, v, torch.ones(1, 4, dtype=torch.bool), torch.tensor([1, 4]),
                            torch.tensor([[1, 4]]), None, None, kc, vc, **attrs)  # fmt: skip
    assert not kc.any() and not vc.any()  # nothing was written


def test_load_reports_why_it_is_off(monkeypatch, fresh_load, tmp_path):
    monkeypatch.setenv(envs.DINFER_CPU_NATIVE, "0")
    off = fresh_load()
    assert off.lib is None and "DINFER_CPU_NATIVE=0" in off.reason
    native.load.cache_clear()
    monkeypatch.delenv(envs.DINFER_CPU_NATIVE)
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    missing = fresh_load()
    assert missing.lib is None and "no-such-compiler-xyz" in missing.reason
    native.load.cache_clear()
    monkeypatch.delenv("CC")
    broken = tmp_path / "native.c"
    broken.write_text("this is not C;\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    failed = fresh_load()
    assert failed.lib is None and "compiling native.c" in failed.reason and "failed" in failed.reason


def test_load_shares_torchs_openmp_runtime_or_builds_without_it(monkeypatch, fresh_load, tmp_path, fast):
    loaded = fresh_load()
    assert "OpenMP threads shared with torch" in loaded.reason  # torch's bundled libgomp, one pool
    assert len(native._openmp_runtimes()) == 1
    native.load.cache_clear()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "OPENMP_FLAGS", ("-fno-such-openmp-flag",))  # a compiler without OpenMP
    plain = fresh_load()
    assert plain.lib is not None and "one thread: the OpenMP build failed" in plain.reason, plain.reason
    assert "-fno-such-openmp-flag" in plain.reason  # the compiler's own words
    assert not plain.lib.dinfer_native_openmp()
    assert not hasattr(plain.lib, "dinfer_native_threaded")  # a dead export, removed (#37)
    h = torch.randn(300, 2 * 96)  # the size that is split over threads where OpenMP is there
    _close(native.NativeKernels(plain.lib).swiglu(h), ops.swiglu(h.double()))


def test_backend_without_native_kernels_uses_torch_and_says_so(monkeypatch, fresh_load):
    monkeypatch.setenv(envs.DINFER_CPU_NATIVE, "0")
    model = dinfer_rt.load_model(EMBEDDED_MODEL)
    assert "native kernels off" in model.backend.is_available().reason
    kernels = model.backend.kernels()
    assert kernels["rms_norm"] is rms_norm and kernels["add_rms_norm"] is add_rms_norm


def test_embedded_model_decodes_the_same_tokens_with_and_without_native_kernels(monkeypatch, fresh_load, fast):
    prompts = [[1, 5, 9, 12, 7, 3], [1, 8, 4, 6, 11, 10, 2, 13]]
    on = dinfer_rt.load_model(EMBEDDED_MODEL)
    assert isinstance(on.backend.kernels()["rms_norm"].__self__, NativeRowKernels)
    monkeypatch.setenv(envs.DINFER_CPU_NATIVE, "0")
    native.load.cache_clear()
    off = dinfer_rt.load_model(EMBEDDED_MODEL)
    ids = torch.tensor([prompts[0] + [on.mask_id] * 10])
    torch.testing.assert_close(on.forward(ids), off.forward(ids), rtol=1e-4, atol=1e-4)
    for cache in ("none", "dual", "adaptive"):
        params = SamplingParams(gen_length=16, block_length=8, strategy="threshold", threshold=0.9, cache=cache)
        a = run_batch(on, prompts, params)
        b = run_batch(off, prompts, params)
        assert torch.equal(a.tokens, b.tokens), cache


def test_native_attention_handles_a_sharp_softmax_and_long_key_rows(fast):
    """Score spreads far past exp's float32 range (the kernel's -87 clamp) and key counts that
    are not multiples of the vector width: still the float64 reference."""
    g = torch.Generator().manual_seed(7)
    q, k, v = _qkv(g, 1, 3, 2, 2, 16)
    caches = (torch.randn(1, 37, 2, 16, generator=g), torch.randn(1, 37, 2, 16, generator=g))
    slots, valid = torch.tensor([30, 3, 17]), torch.ones(1, 37, dtype=torch.bool)
    attrs = dict(scale=40.0, block_size=None, theta=10000.0, rotary_dim=16, eps=1e-6)
    ref_caches = tuple(c.double().clone() for c in caches)
    out, _, _ = AttentionKernels(fast).rope_attention(q, k, v, valid, slots, slots[None], None, None, *caches, **attrs)
    want = ops.rope_attention(
        q.double(), k.double(), v.double(), valid, slots, slots[None], None, None, *ref_caches, **attrs
    )[0]
    assert torch.isfinite(out).all()
    _close(out, want, tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rule", ["threshold", "top_k"])
def test_native_commit_decides_like_the_strategies(fast, rule, dtype):
    """Ties (saturated 1.0 and repeated scores), rows with nothing masked, quotas of 0 and past
    the masked count: the same commits and the same writes as the host-side rules."""
    from dinfer_rt import strategies

    g = torch.Generator().manual_seed(11)
    b, n = 6, 9
    conf = torch.rand(b, n, generator=g).to(dtype)
    conf[0, [1, 4, 7]] = 1.0
    conf[1, [2, 3]] = 0.5
    conf[2] = 0.25
    masked = torch.rand(b, n, generator=g) < 0.6
    masked[2] = True
    masked[3] = False
    quota = torch.tensor([2, 1, 3, 4, 0, 20])
    x0 = torch.randint(3, 30, (b, n), generator=g)
    seq = torch.full((b, n + 4), 2, dtype=torch.long)  # the block is a strided view of the sequence
    want = strategies._top_quota(conf, masked, quota) if rule == "top_k" else strategies.threshold_commit(
        conf, masked, 0.7
    )  # fmt: skip
    got = fast.commit(conf, masked, quota, x0, seq[:, 2 : 2 + n], rule=rule, threshold=0.7)
    assert torch.equal(got, want)
    assert torch.equal(seq[:, 2 : 2 + n], torch.where(want, x0, 2)) and (seq[:, :2] == 2).all()
    with pytest.raises(ValueError, match="unknown rule 'sometimes'"):
        fast.commit(conf, masked, quota, x0, seq[:, 2 : 2 + n], rule="sometimes")


def test_generation_with_the_native_commit_equals_the_host_rules(monkeypatch):
    from dinfer_rt.backends.cpu import CpuBackend

    model = dinfer_rt.load_model(EMBEDDED_MODEL)
    prompts = [[1, 5, 9, 12, 7, 3], [1, 8, 4, 6, 11, 10, 2, 13]]
    for strategy in ("threshold", "low_confidence"):
        params = SamplingParams(gen_length=16, block_length=8, strategy=strategy, threshold=0.9, cache="anchored")
        native_commit = run_batch(model, prompts, params)
        with monkeypatch.context() as m:
            m.setattr(CpuBackend, "commit_kernel", lambda self: None)
            host = run_batch(model, prompts, params)
        assert torch.equal(native_commit.tokens, host.tokens), strategy
        assert torch.equal(native_commit.commit_step, host.commit_step), strategy


@pytest.mark.parametrize("kind", ["max", "margin", "entropy"])
@pytest.mark.parametrize(("rows", "k", "vocab"), [(40, 192, 31), (1, 7, 2), (300, 33, 31), (3, 16, 4096)])
def test_small_vocabulary_confidence_head_matches_float64(fast, kind, rows, k, vocab):
    g = torch.Generator().manual_seed(rows * vocab + k)
    h, w = torch.randn(rows, k, generator=g), torch.randn(vocab, k, generator=g) * 0.3
    banned = vocab // 2
    want, want_token = ops.confidence(F.linear(h.double(), w.double()), banned=banned, kind=kind)
    got = fast.lm_head_confidence(h, w, banned, kind)
    assert got is not None  # every case is within the native head's limits
    _close(got[0], want, tol=1e-5)
    assert torch.equal(got[1], want_token) and not (got[1] == banned).any()
    # the kernel the backend registers takes the same route
    head, token = NativeRowKernels(fast).lm_head_confidence(h, w, banned=banned, kind=kind)
    assert torch.equal(head, got[0]) and torch.equal(token, got[1])


def test_confidence_head_gives_nan_for_a_nan_logit_and_leaves_big_heads_to_torch(fast):
    h, w = torch.randn(2, 8), torch.randn(31, 8)
    h[1, 3] = float("nan")
    conf, token = fast.lm_head_confidence(h, w, 2, "max")
    assert torch.isfinite(conf[0]) and torch.isnan(conf[1]) and token[1] == 0  # the first NaN logit's id
    assert fast.lm_head_confidence(torch.randn(2, 768), torch.randn(32000, 768), 2, "max") is None  # not in L2
    assert fast.lm_head_confidence(torch.randn(2000, 192), w.new_zeros(31, 192), 2, "max") is None  # GEMM's size
    assert fast.lm_head_confidence(h, w, -1, "max") is None  # no banned id: the torch kernel's convention
    assert fast.lm_head_confidence(h.double(), w.double(), 2, "max") is None
