"""The CPU layer blocks (``attention_block`` / ``mlp_block``: a dense decoder layer in two native
calls): the float64 reference, the composed fallback, the panel GEMM and its packing policy, and
where the fusion passes fire."""

from __future__ import annotations

import pytest
import torch

import dinfer_rt
from dinfer_rt import envs
from dinfer_rt.backends.cpu import native
from dinfer_rt.backends.cpu.kernels import AttentionKernels, LayerBlockKernels, NativeRowKernels
from dinfer_rt.errors import ConfigError
from dinfer_rt.ir import ops
from dinfer_rt.loader import EMBEDDED_MODEL


@pytest.fixture(scope="module")
def fast(native_build) -> native.NativeKernels:
    """Every test here runs once per vector width this CPU has (conftest.native_build)."""
    kernels = native.NativeKernels(native_build.lib)
    assert kernels.blas is not None, native_build.reason  # torch's x86 wheels carry MKL's sgemm
    return kernels


def _blocks(fast) -> LayerBlockKernels:
    return LayerBlockKernels(AttentionKernels(fast), NativeRowKernels(fast))


def _close(got: torch.Tensor, want64: torch.Tensor, tol: float = 1e-5) -> None:
    err = (got.double() - want64).abs().max().item()
    assert err <= tol * max(1.0, want64.abs().max().item()), err


ATTENTION_CASES = {
    # name: (B, T, H, KV, D, rotary_dim, qk_norm, qkv bias, cache rows S (None: none), per-row
    #        slots, a padded key, block size (not None: the composed route))
    "no-cache": (2, 5, 4, 4, 8, 8, False, False, None, False, False, None),
    "no-cache-gqa-partial-rotary-bias-padding": (2, 5, 4, 2, 16, 8, False, True, None, False, True, None),
    "qk-norm": (1, 6, 2, 2, 8, 8, True, False, None, False, False, None),
    "cache-shared-slots": (2, 3, 4, 2, 8, 8, False, True, 9, False, True, None),
    "cache-per-row-slots-qk-norm": (2, 3, 4, 4, 8, 4, True, False, 9, True, False, None),
    "threaded-cache": (3, 20, 4, 2, 16, 16, False, False, 40, True, True, None),
    "block-causal-composed": (2, 3, 4, 2, 8, 8, False, False, 9, False, True, 4),
    # >= OUTER_MIN_ROWS batch rows per thread: the rows split over the threads, one block each
    "row-split-no-cache-gqa": (9, 7, 6, 2, 48, 48, False, True, None, False, True, None),
    "row-split-cache-per-row-slots": (8, 5, 4, 4, 40, 40, True, False, 37, True, True, None),
    "row-split-cache-shared-slots": (8, 3, 4, 2, 8, 8, False, False, 9, False, False, None),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_block_matches_float64_reference(fast, monkeypatch, case):
    b, t, h, kv, d, rot, qk_norm, bias, s, per_row, padded, block = ATTENTION_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    dim = 24
    x = torch.randn(b, t, dim, generator=g)
    w = torch.randn((h + 2 * kv) * d, dim, generator=g) / dim**0.5
    bq = torch.randn(w.shape[0], generator=g) if bias else None
    qn = kn = None
    if qk_norm:
        qn, kn = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    caches = (None, None)
    if s is None:
        slots, positions = torch.arange(t), torch.randint(0, 40, (b, t), generator=g)
        key_valid = torch.ones(b, t, dtype=torch.bool)
    else:
        caches = (torch.randn(b, s, kv, d, generator=g), torch.randn(b, s, kv, d, generator=g))
        if per_row:
            slots = torch.stack([torch.randperm(s, generator=g)[:t] for _ in range(b)])
            positions = slots
        else:
            slots = torch.tensor([6, 2, 4])
            positions = slots.expand(b, t).contiguous()
        key_valid = torch.ones(b, s, dtype=torch.bool)
    if padded:
        key_valid[1, 0] = False
    attrs = dict(
        sizes=(h * d, kv * d, kv * d), heads=h, kv_heads=kv, scale=d**-0.5, block_size=block, theta=10000.0,
        rotary_dim=rot, eps=1e-6,
    )  # fmt: skip
    calls, real = [], fast.attention_block
    monkeypatch.setattr(fast, "attention_block", lambda *a, **k: calls.append(r := real(*a, **k)) or r)
    ref_caches = tuple(None if c is None else c.double().clone() for c in caches)
    got = _blocks(fast).attention_block(x, w, bq, key_valid, slots, positions, qn, kn, *caches, **attrs)
    assert bool(calls) == (block is None)  # the native route, except under a block-causal rule
    d64 = [None if v is None else v.double() for v in (x, w, bq)]
    n64 = [None if v is None else v.double() for v in (qn, kn)]
    want = ops.attention_block(*d64, key_valid, slots, positions, *n64, *ref_caches, **attrs)
    if s is None:
        assert got.shape == (b, t, h * d)
        _close(got, want)
    else:
        for got_i, want_i in zip(got, want):  # the output and both caches, written in place
            _close(got_i, want_i)
        assert got[1] is caches[0] and got[2] is caches[1]


@pytest.mark.parametrize("rows, bias", [(1, False), (7, True), (600, True)])  # 600: three row slices
def test_mlp_block_matches_float64_reference(fast, rows, bias):
    g = torch.Generator().manual_seed(rows)
    dim, hidden, heads_dim = 48, 80, 40
    attn, residual = torch.randn(1, rows, heads_dim, generator=g), torch.randn(1, rows, dim, generator=g)
    w_o = torch.randn(dim, heads_dim, generator=g) / heads_dim**0.5
    b_o = torch.randn(dim, generator=g) if bias else None
    w_gu = torch.randn(2 * hidden, dim, generator=g) / dim**0.5
    w_d = torch.randn(dim, hidden, generator=g) / hidden**0.5
    n1, n2 = torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5
    args = (attn, w_o, b_o, residual, n1, w_gu, w_d, n2)
    assert fast.mlp_block(*args, 1e-5) is not None  # the native route
    normed, total = _blocks(fast).mlp_block(*args, eps=1e-5)
    want = ops.mlp_block(*(None if v is None else v.double() for v in args), eps=1e-5)
    _close(normed, want[0])
    _close(total, want[1])


def _on_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def test_row_split_gives_the_bits_of_one_thread(fast):
    """Many batch rows split over the threads, each row's whole block on one thread (two threads
    here whatever the machine has): the same arithmetic per value as on one thread, so the same
    bits, for both blocks."""
    g = torch.Generator().manual_seed(5)
    b, t, h, kv, d, dim, hidden = 9, 6, 4, 2, 16, 24, 40
    x = torch.randn(b, t, dim, generator=g)
    w = torch.randn((h + 2 * kv) * d, dim, generator=g) / dim**0.5
    positions, key_valid = torch.randint(0, 40, (b, t), generator=g), torch.ones(b, t, dtype=torch.bool)
    cos, sin = AttentionKernels(fast).rotary.tables(positions, d, 10000.0, torch.float32)
    attrs = dict(heads=h, kv_heads=kv, scale=d**-0.5, rotary_dim=d, eps=1e-6)
    args = (x, w, None, key_valid, torch.arange(t), positions, None, None, None, None, cos, sin)
    split, one = (_on_threads(n, lambda: fast.attention_block(*args, **attrs)) for n in (2, 1))
    assert split is not None and torch.equal(split, one)
    rows = 600  # >= 2 passes of 64 rows per thread
    attn, residual = torch.randn(rows, h * d, generator=g), torch.randn(rows, dim, generator=g)
    w_o, w_gu = torch.randn(dim, h * d, generator=g) / 8, torch.randn(2 * hidden, dim, generator=g) / 5
    w_d, n1, n2 = torch.randn(dim, hidden, generator=g) / 6, torch.rand(dim, generator=g) + 0.5, torch.ones(dim)
    margs = (attn, w_o, None, residual, n1, w_gu, w_d, n2, 1e-5)
    split, one = (_on_threads(n, lambda: fast.mlp_block(*margs)) for n in (2, 1))
    assert torch.equal(split[0], one[0]) and torch.equal(split[1], one[1])


def test_mlp_block_hands_other_layouts_to_the_composition(fast):
    g = torch.Generator().manual_seed(3)
    attn = torch.randn(6, 16, generator=g).t()  # not row-major: the native block declines
    residual = torch.randn(16, 8, generator=g)
    w_o, w_gu, w_d = torch.randn(8, 6, generator=g), torch.randn(20, 8, generator=g), torch.randn(8, 10, generator=g)
    n1, n2 = torch.ones(8), torch.ones(8)
    assert fast.mlp_block(attn, w_o, None, residual, n1, w_gu, w_d, n2, 1e-5) is None
    got = _blocks(fast).mlp_block(attn, w_o, None, residual, n1, w_gu, w_d, n2, eps=1e-5)
    want = ops.mlp_block(attn.double(), w_o.double(), None, residual.double(), n1.double(), w_gu.double(),
                         w_d.double(), n2.double(), eps=1e-5)  # fmt: skip
    _close(got[0], want[0])
    _close(got[1], want[1])


@pytest.mark.parametrize("policy, packs_small, packs_big", [("small", True, False), ("all", True, True),
                                                            ("off", False, False)])  # fmt: skip
def test_panel_packing_policy(fast, monkeypatch, policy, packs_small, packs_big):
    monkeypatch.setenv(envs.DINFER_CPU_PACKED_WEIGHTS, policy)
    panels = native.PanelWeights(native.load().lib)
    small = torch.randn(64, 32)
    big = torch.randn(native.SMALL_WEIGHT_BYTES // 4 // 128 + 1, 128)  # one row over the bound
    assert (panels.get(small) is not None) == packs_small
    assert (panels.get(big) is not None) == packs_big
    assert panels.get(small) is panels.get(small)  # one copy per weight


def test_panel_copy_is_dropped_with_its_weight(fast):
    panels = native.PanelWeights(native.load().lib)
    w = torch.randn(16, 16)
    assert panels.get(w) is not None
    assert len(panels._packed) == 1
    del w
    assert not panels._packed


def test_bad_packing_policy_names_the_variable(monkeypatch):
    monkeypatch.setenv(envs.DINFER_CPU_PACKED_WEIGHTS, "most")
    with pytest.raises(ConfigError, match=r"DINFER_CPU_PACKED_WEIGHTS='most' is not one of small, all, off"):
        native.pack_policy()


@pytest.mark.parametrize("rows, n, k", [(1, 33, 7), (6, 64, 48), (13, 100, 40), (40, 96, 300)])
def test_panel_gemm_matches_float64(fast, monkeypatch, rows, n, k):
    """Tiles of 6 rows and panels of 32 columns, with their remainders (n not a multiple of 32,
    rows not of 6), one thread and split over threads: through mlp_block's output projection."""
    monkeypatch.setenv(envs.DINFER_CPU_PACKED_WEIGHTS, "all")
    g = torch.Generator().manual_seed(rows * n)
    attn, residual = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
    w_o = torch.randn(n, k, generator=g) / k**0.5
    w_gu, w_d = torch.randn(2 * 8, n, generator=g), torch.randn(n, 8, generator=g)
    ones = torch.ones(n)
    kernels = native.NativeKernels(native.load().lib)
    kernels.panels = native.PanelWeights(native.load().lib)  # this test's policy, not the shared registry's
    normed, total = kernels.mlp_block(attn, w_o, None, residual, ones, w_gu, w_d, ones, 1e-5)
    assert kernels.panels.get(w_o) is not None  # the panel GEMM ran
    want = ops.mlp_block(*(v.double() for v in (attn, w_o)), None, residual.double(), ones.double(),
                         w_gu.double(), w_d.double(), ones.double(), eps=1e-5)  # fmt: skip
    _close(normed, want[0])
    _close(total, want[1])


@pytest.mark.parametrize(
    "rows, n, k",
    [(1, 5, 7), (8, 13, 40), (15, 13, 40), (17, 25, 300), (33, 36, 64), (128, 24, 16), (100, 12, 2100), (129, 20, 30)],
)
def test_unpacked_gemm_matches_float64(fast, monkeypatch, rows, n, k):
    """Unpacked weights: the transposed-input GEMM at 8-128 rows (tiles of 12 weight rows x 32
    or 16 input rows with their remainders; k 2100: row chunks of 32, the last one of 4), torch's
    sgemm outside (1, 129). Through mlp_block's output projection, one thread and split over
    threads."""
    monkeypatch.setenv(envs.DINFER_CPU_PACKED_WEIGHTS, "off")
    g = torch.Generator().manual_seed(rows * n + k)
    attn, residual = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
    w_o = torch.randn(n, k, generator=g) / k**0.5
    w_gu, w_d = torch.randn(2 * 8, n, generator=g), torch.randn(n, 8, generator=g)
    ones = torch.ones(n)
    kernels = native.NativeKernels(native.load().lib)
    kernels.panels = native.PanelWeights(native.load().lib)
    normed, total = kernels.mlp_block(attn, w_o, None, residual, ones, w_gu, w_d, ones, 1e-5)
    assert kernels.panels.get(w_o) is None  # not packed: the unpacked path ran
    want = ops.mlp_block(*(v.double() for v in (attn, w_o)), None, residual.double(), ones.double(),
                         w_gu.double(), w_d.double(), ones.double(), eps=1e-5)  # fmt: skip
    _close(normed, want[0])
    _close(total, want[1])


def test_native_linear_matches_float64_and_declines_what_it_does_not_handle(fast):
    """The CPU ``linear`` kernel (LM head, unfused layers): [B, T, in] with a bias through the
    transposed-input GEMM; too few or too many rows, too little work or another layout go back
    to torch."""
    g = torch.Generator().manual_seed(11)
    x, w, b = torch.randn(2, 20, 192, generator=g), torch.randn(300, 192, generator=g), torch.randn(300, generator=g)
    low, high = fast.xt_rows
    if low > high:  # a build below AVX-512 leaves every row count to the BLAS (native.c: XT_MIN_ROWS)
        assert fast.linear(x, w, b) is None
        low, high = 8, 128  # the kernel itself is still checked, called directly
    else:
        got = fast.linear(x, w, b)
        assert got is not None and got.shape == (2, 20, 300)
        _close(got, torch.nn.functional.linear(x.double(), w.double(), b.double()))
        assert fast.linear(torch.randn(low - 1, 192), torch.randn(4000, 192)) is None
        assert fast.linear(torch.randn(high + 1, 192), w) is None
    for rows in (low, 40, high):  # one 32-row tile and a 16-row tail, the full chunk
        xr, out = torch.randn(rows, 192, generator=g), torch.empty(rows, 300)
        assert fast._xt_linear(w.data_ptr(), 300, 192, xr.data_ptr(), rows, out.data_ptr()) == 0
        _close(out, xr.double() @ w.double().T)
    assert fast.linear(torch.randn(40, 192), torch.randn(31, 192)) is None  # the embedded LM head: torch's
    assert fast.linear(x.transpose(0, 1), w) is None
    assert fast.linear(x.double(), w.double()) is None
    kernels = NativeRowKernels(fast)
    _close(kernels.linear(x.transpose(0, 1), w), torch.nn.functional.linear(x.transpose(0, 1).double(), w.double()))


@pytest.mark.parametrize("policy", ["all", "off"])
def test_packed_and_plain_blocks_agree_on_the_embedded_model(monkeypatch, policy):
    monkeypatch.setenv(envs.DINFER_CPU_PACKED_WEIGHTS, policy)
    native._PANELS.clear()
    try:
        fused = dinfer_rt.load_model(EMBEDDED_MODEL)
        plain = dinfer_rt.load_model(EMBEDDED_MODEL, disable_passes=("fuse_attention_block", "fuse_mlp_block"))
        ids = torch.randint(3, 20, (2, 30), generator=torch.Generator().manual_seed(5))
        a, b = fused.forward(ids), plain.forward(ids)
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5
    finally:
        native._PANELS.clear()


def _counts(model) -> dict:
    return model.executable(False, None).graph.op_counts()


def test_blocks_fuse_every_dense_layer_of_the_embedded_model():
    model = dinfer_rt.load_model(EMBEDDED_MODEL)
    counts = _counts(model)
    assert model.pass_counts["fuse_attention_block"] == 6 and model.pass_counts["fuse_mlp_block"] == 6
    assert counts["attention_block"] == 6 and counts["mlp_block"] == 6
    assert "linear" not in counts or counts["linear"] <= 1  # at most the LM head is left


def test_blocks_fire_on_dense_layers_only(ckpt_dir):
    """Dream (q/k/v biases) fuses like LLaDA; MoE layers keep their routed experts (no mlp_block)."""
    dream = dinfer_rt.load_model(ckpt_dir("dream"))
    assert _counts(dream)["attention_block"] == dream.spec.n_layers == _counts(dream)["mlp_block"]
    moe = dinfer_rt.load_model(ckpt_dir("llada_moe"))
    counts = _counts(moe)
    assert counts.get("attention_block", 0) == moe.spec.n_layers
    dense = sum(1 for i in range(moe.spec.n_layers) if not moe.spec.is_moe_layer(i))
    assert counts.get("mlp_block", 0) == dense


def test_without_native_kernels_the_layers_stay_apart(monkeypatch):
    monkeypatch.setenv(envs.DINFER_CPU_NATIVE, "0")
    native.load.cache_clear()
    try:
        model = dinfer_rt.load_model(EMBEDDED_MODEL)
        assert "fuse_attention_block" not in model.pass_counts and "attention_block" not in _counts(model)
    finally:
        native.load.cache_clear()


def test_a_weight_modified_in_place_is_packed_again(fast, monkeypatch):
    """The panel copy and the plan are keyed on the weight's in-place version: never stale."""
    monkeypatch.setenv(envs.DINFER_CPU_PACKED_WEIGHTS, "all")
    g = torch.Generator().manual_seed(2)
    attn, residual = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g)
    w_o, w_gu, w_d = (
        torch.randn(40, 40, generator=g),
        torch.randn(64, 40, generator=g),
        torch.randn(40, 32, generator=g),
    )
    ones = torch.ones(40)
    kernels = native.NativeKernels(native.load().lib)
    kernels.panels = native.PanelWeights(native.load().lib)
    kernels.mlp_block(attn, w_o, None, residual, ones, w_gu, w_d, ones, 1e-5)
    w_o.mul_(-2.0)
    normed, total = kernels.mlp_block(attn, w_o, None, residual, ones, w_gu, w_d, ones, 1e-5)
    want = ops.mlp_block(attn.double(), w_o.double(), None, residual.double(), ones.double(), w_gu.double(),
                         w_d.double(), ones.double(), eps=1e-5)  # fmt: skip
    _close(normed, want[0])
    _close(total, want[1])
