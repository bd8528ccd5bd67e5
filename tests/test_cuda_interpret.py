"""The cuda backend's Triton kernels under the interpreter (DINFER_INTERPRET=1), on CPU tensors,
against the float64 IR reference, odd sizes included. Tolerance: max error relative to the
largest reference value, float32 <= 1e-5, float16 <= 2e-3, bfloat16 <= 1e-2. Kernels widen every
load to fp32 and round stores to nearest even (kernels._round/_narrow), which is what makes bf16
checkable in the interpreter; 16-bit dot tiles are widened there too (exact products)."""

from __future__ import annotations

import re

import pytest
import torch

import dinfer_rt
from dinfer_rt import plugins
from dinfer_rt.ir import ops

pytest.importorskip("triton")
# Padding lanes (rows past the end, masked experts) hold -inf and produce NaN there in numpy; they
# are never stored. On a GPU the same lanes are computed and discarded silently.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    backend = plugins.select_backend("cuda")
    assert backend.device_type == "cpu" and backend.arch == "interpret"
    return backend


# The interpreter's own tuning row, the shipped sm_90 row, and rocm_dcu's wave64 rows (an MFMA
# arch and gfx906's smaller FMA tiles): the same kernel source under every launch configuration.
CONFIGS = ["cuda", "cuda::sm_90", "rocm_dcu::gfx942", "rocm_dcu::gfx906"]


@pytest.fixture(params=CONFIGS)
def kernels(request, monkeypatch):
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    return plugins.select_backend(request.param).kernels()


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def close(got, want, dtype, scale=1.0):
    """The module's tolerance rule (``scale`` widens it for ops with more roundings)."""
    err = rel(got, want)
    assert err <= TOL[dtype] * scale, f"{dtype}: error {err:.3g} > {TOL[dtype] * scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [56, 192, 1000])
def test_norm_kernels(kernels, dtype, hidden):
    k = kernels
    g = torch.Generator().manual_seed(hidden)
    x, r = torch.randn(3, 7, hidden, generator=g).to(dtype), torch.randn(3, 7, hidden, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    close(k["rms_norm"](x, w, eps=1e-6), ops.rms_norm(x.double(), w.double(), eps=1e-6), dtype)
    y, s = k["add_rms_norm"](x, r, w, eps=1e-5)
    want_y, want_s = ops.add_rms_norm(x.double(), r.double(), w.double(), eps=1e-5)
    close(y, want_y, dtype)
    close(s, want_s, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [37, 512, 2500])
def test_swiglu_kernel(kernels, dtype, inter):
    h = torch.randn(2, 5, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype)
    close(kernels["swiglu"](h), ops.swiglu(h.double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotary", [(16, 16), (16, 8), (12, 12), (24, 10), (128, 64)])
def test_rope_kernel_full_and_partial(kernels, dtype, head_dim, rotary):
    g = torch.Generator().manual_seed(head_dim + rotary)
    x = torch.randn(2, 9, 3, head_dim, generator=g).to(dtype)
    pos = torch.randint(0, 2000, (2, 9), generator=g)
    got = kernels["rope"](x, pos, theta=500000.0, rotary_dim=rotary)
    want = ops.rope(x, pos, theta=500000.0, rotary_dim=rotary)  # fp32 angles, as the model runs them
    close(got, want, dtype)
    torch.testing.assert_close(got[..., rotary:], x[..., rotary:], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["max", "margin", "entropy"])
def test_lm_head_confidence_kernel(kernels, dtype, kind):
    """Vocabulary chunks of 64 with a vocab that is not a multiple of it, hidden not a multiple of
    the K block; the reference is the float64 decomposition (logits, softmax, reduction)."""
    g = torch.Generator().manual_seed(len(kind))
    h = torch.randn(3, 7, 40, generator=g).to(dtype)
    w = (torch.randn(1001, 40, generator=g) * 0.3).to(dtype)
    score, token = kernels["lm_head_confidence"](h, w, banned=5, kind=kind)
    want, want_token = ops.lm_head_confidence(h.double(), w.double(), banned=5, kind=kind)
    assert rel(score, want) <= (1e-5 if dtype == torch.float32 else 5e-3)
    assert (token == want_token).float().mean() >= (1.0 if dtype == torch.float32 else 0.95)


def _attention_case(dtype, groups, seed, cached):
    g = torch.Generator().manual_seed(seed)
    b, t, kv, d, s = 2, 11, 2, 12, 24  # head_dim 12: not a power of two
    q = torch.randn(b, t, kv * groups, d, generator=g).to(dtype)
    k, v = (torch.randn(b, t, kv, d, generator=g).to(dtype) for _ in range(2))
    if not cached:
        valid = torch.ones(b, t, dtype=torch.bool)
        valid[1, :3] = False  # left padding
        return (q, k, v, valid, torch.arange(t))
    cache = [torch.randn(b, s, kv, d, generator=g).to(dtype) for _ in range(2)]
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[0, :5] = False
    return (q, k, v, valid, torch.arange(8, 8 + t), *cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [1, 4, 8])
@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("cached", [False, True])
def test_attention_kernel(kernels, dtype, groups, block_size, cached):
    """GQA ratios 1/4/8, padding, bidirectional and block-causal masks; with a cache the block's
    K/V are spliced in place at token_index and all S slots are attended."""
    args = _attention_case(dtype, groups, groups + 10 * cached, cached)
    ref_args = [a.double() if a.is_floating_point() else a for a in args]
    got = kernels["attention"](*args, scale=12**-0.5, block_size=block_size)
    want = ops.attention(*ref_args, scale=12**-0.5, block_size=block_size)
    if cached:
        (got, k_cache, v_cache), (want, want_k, want_v) = got, want
        assert k_cache is args[5] and v_cache is args[6]  # spliced in place
        torch.testing.assert_close(k_cache.double(), want_k, rtol=0, atol=0)
        torch.testing.assert_close(v_cache.double(), want_v, rtol=0, atol=0)
    close(got, want, dtype)


def test_key_splits_fill_the_device_only_for_small_launches():
    """The LLaDA-8B block step at batch 1 (32 programs, 1024 cache slots) splits its keys into
    4 ranges (128 programs); a launch that already fills the device, a short cache, and the
    interpreter's own row keep one."""
    from dinfer_rt.backends.cuda.tuning import table
    from dinfer_rt.backends.triton.ops import key_splits

    row = table("sm_90")
    assert key_splits(32, 1024, 64, row) == 4
    assert key_splits(8, 4096, 64, row) == 16  # capped at attn_max_splits
    assert key_splits(256, 1024, 64, row) == 1
    assert key_splits(32, 200, 64, row) == 1  # fewer than two ranges of attn_split_keys
    assert key_splits(1, 4096, 64, table("interpret")) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("cached", [False, True])
def test_split_key_attention_equals_the_reference(monkeypatch, dtype, block_size, cached):
    """Split-key attention (flash-decoding) with the sm_90 row and 16-key tiles and ranges:
    partial states merged by the combine kernel match the float64 reference (GQA 4, head_dim
    12), also for ranges whose keys are all padding (they must weigh nothing) and a batch row
    that sees no key at all."""
    from dinfer_rt.backends.cuda.tuning import table
    from dinfer_rt.backends.triton import ops as cuda_ops
    from dinfer_rt.backends.triton.launch import default_config

    monkeypatch.setenv("DINFER_INTERPRET", "1")
    row = {**table("sm_90"), "attn_n": 16, "attn_split_keys": 16, "attn_split_below": 1000}
    k = cuda_ops.make_kernels(row, True, lambda name: default_config(name, row))
    seen = []
    real = cuda_ops.key_splits
    monkeypatch.setattr(cuda_ops, "key_splits", lambda *a: seen.append(real(*a)) or seen[-1])
    g = torch.Generator().manual_seed(7)
    b, t, kv, groups, d, slots = 2, (5 if cached else 40), 2, 4, 12, 70
    q = torch.randn(b, t, kv * groups, d, generator=g).to(dtype)
    fresh = [torch.randn(b, t, kv, d, generator=g).to(dtype) for _ in range(2)]
    n_k = slots if cached else t
    valid = torch.ones(b, n_k, dtype=torch.bool)
    valid[0, : n_k // 2 + 1] = False  # row 0: its first ranges all padding
    valid[1] = False  # row 1 sees no key: it attends to every key, as the reference
    index = torch.arange(60, 60 + t) if cached else torch.arange(t)
    args = [q, *fresh, valid, index]
    if cached:
        args += [torch.randn(b, slots, kv, d, generator=g).to(dtype) for _ in range(2)]
    ref_args = [a.double() if a.is_floating_point() else a for a in args]
    got = k["attention"](*args, scale=12**-0.5, block_size=block_size)
    want = ops.attention(*ref_args, scale=12**-0.5, block_size=block_size)
    got, want = (got[0], want[0]) if cached else (got, want)
    assert seen and min(seen) >= 2  # the split path ran
    assert torch.isfinite(got).all()
    close(got, want, dtype, scale=2.0)


def test_attention_rows_that_see_no_key_attend_everywhere(kernels):
    """A fully padded batch row, and block-causal queries whose blocks hold only padding: the
    reference lets such a query see every key (no NaN); the kernel must agree."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 9, 4, 16, generator=g) for _ in range(3))
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0] = False
    valid[1, :4] = False  # with block 4, queries 0..3 of row 1 see nothing
    for block_size in (None, 4):
        got = kernels["attention"](q, k, v, valid, torch.arange(9), scale=0.25, block_size=block_size)
        want = ops.attention(
            q.double(), k.double(), v.double(), valid, torch.arange(9), scale=0.25, block_size=block_size
        )
        assert torch.isfinite(got).all()
        close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_attention_kernel(kernels, dtype):
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(2, 8, 8, 16, generator=g),
        torch.randn(2, 8, 2, 16, generator=g),
        torch.randn(2, 8, 2, 16, generator=g),
    )
    norms = [1 + 0.1 * torch.randn(16, generator=g) for _ in range(2)]
    args = [
        q,
        k,
        v,
        torch.ones(2, 8, dtype=torch.bool),
        torch.arange(8),
        torch.arange(8).expand(2, 8),
        *norms,
        None,
        None,
    ]
    attrs = {"scale": 0.25, "block_size": 4, "theta": 10000.0, "rotary_dim": 8, "eps": 1e-6}
    got = kernels["rope_attention"](
        *[a.to(dtype) if a is not None and a.is_floating_point() else a for a in args], **attrs
    )
    want = ops.rope_attention(*[a.double() if a is not None and a.is_floating_point() else a for a in args], **attrs)
    close(got, want, dtype, scale=2.0)  # norm, rope and attention each round once in 16-bit


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_router_kernel(kernels, renormalize):
    logits = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(1))
    w, idx = kernels["router_softmax_topk"](logits, k=3, renormalize=renormalize)
    want_w, want_idx = ops.router_softmax_topk(logits.double(), k=3, renormalize=renormalize)
    assert torch.equal(idx, want_idx) and w.dtype == torch.float32
    close(w, want_w, torch.float32)


@pytest.mark.parametrize(
    "experts, n_group, topk_group, k", [(12, 4, 2, 3), (12, 1, 1, 4), (12, 3, 2, 2), (10, 5, 3, 4)]
)
def test_grouped_sigmoid_router_kernel(kernels, experts, n_group, topk_group, k):
    g = torch.Generator().manual_seed(experts + n_group)
    logits, bias = torch.randn(4, 6, experts, generator=g), 0.1 * torch.randn(experts, generator=g)
    attrs = {"k": k, "n_group": n_group, "topk_group": topk_group, "renormalize": True, "scale": 2.5}
    w, idx = kernels["router_sigmoid_grouped"](logits, bias, **attrs)
    want_w, want_idx = ops.router_sigmoid_grouped(logits.double(), bias.double(), **attrs)
    assert torch.equal(idx, want_idx)
    close(w, want_w, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts, top", [(6, 2), (5, 1), (16, 4)])
def test_grouped_moe_kernels(kernels, dtype, experts, top):
    """Expert-sorted, tile-padded grouped GEMMs (gate/up with the SwiGLU epilogue, then down times
    the routing weight) and the gather-sum finalize, against the per-expert reference loop;
    hidden 40 and width 24 are not multiples of the tiles, and some experts get no token."""
    g = torch.Generator().manual_seed(experts * 10 + top)
    hidden, inter = 40, 24
    x = torch.randn(2, 9, hidden, generator=g).to(dtype)
    gate_up = (0.2 * torch.randn(experts, 2 * inter, hidden, generator=g)).to(dtype)
    down = (0.2 * torch.randn(experts, hidden, inter, generator=g)).to(dtype)
    router_w = torch.randn(experts, hidden, generator=g)
    w, idx = ops.router_softmax_topk(torch.randn(2, 9, experts, generator=g), k=top, renormalize=False)
    got = kernels["moe_experts"](x, w, idx, gate_up, down)
    close(got, ops.moe_experts(x.double(), w.double(), idx, gate_up.double(), down.double()), dtype)
    attrs = {"router": "softmax", "k": top, "renormalize": False}
    got = kernels["moe_routed"](x, router_w, None, gate_up, down, **attrs)  # fp32 router, as lowered
    want = ops.moe_routed(x.double(), router_w.double(), None, gate_up.double(), down.double(), **attrs)
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_moe_kernels_compute_only_this_ranks_experts(kernels, dtype):
    """Expert parallelism: with experts 4..7 of 8 and global ids, the kernels give the routed
    output of those experts alone (other slots skipped, not computed with weight 0); the
    reference is the whole model's MoE with the other experts' weights zeroed, in float64."""
    g = torch.Generator().manual_seed(8)
    hidden, inter, experts, top = 40, 24, 8, 3
    x = torch.randn(2, 9, hidden, generator=g).to(dtype)
    gate_up = (0.2 * torch.randn(experts, 2 * inter, hidden, generator=g)).to(dtype)
    down = (0.2 * torch.randn(experts, hidden, inter, generator=g)).to(dtype)
    w, idx = ops.router_softmax_topk(torch.randn(2, 9, experts, generator=g), k=top, renormalize=False)
    want = ops.moe_experts(x.double(), torch.where(idx >= 4, w, 0).double(), idx, gate_up.double(), down.double())
    for fn in (kernels["moe_experts"], ops.moe_experts):
        close(fn(x, w, idx, gate_up[4:], down[4:], first_expert=4), want, dtype)


def test_kernels_and_fallbacks_are_shown(cuda, ckpt_dir, capsys):
    from dinfer_rt.cli import main

    assert main(["ir", "--model", str(ckpt_dir("llada")), "--backend", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "= attention(" in out and "rope(%" in out and "# native" in out
    assert "linear(" in out and "# fallback:reference" in out  # plain matmuls stay torch (cuBLAS)
    graph = dinfer_rt.load_model(ckpt_dir("llada"), backend="cuda").executable(False).graph
    assert graph.op_counts().get("rope_attention") == 2  # the flash kernel lets RoPE fold into attention


def test_embedded_model_same_greedy_output_as_cpu(cuda):
    from dinfer_rt.demo import task

    prompts = [it.letters for it in task.heldout(2)]
    params = dinfer_rt.SamplingParams(strategy="threshold", threshold=0.9, batch_size=2)
    want = [o.token_ids for o in dinfer_rt.LLM(backend="cpu").generate(prompts, params)]
    llm = dinfer_rt.LLM(backend="cuda")
    assert llm.model.executable(False).fallbacks["rms_norm"] == 0  # the Triton kernel, not the fallback
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    confidence_graph = llm.model.executable(False, head="confidence").graph
    assert confidence_graph.op_counts().get("lm_head_confidence") == 1  # the Triton fused head ran


def test_the_interpreter_is_named_as_emulation_and_a_report_says_why_no_timings(cuda):
    """Timings under the interpreter measure the interpreter: the backend says it runs emulated, and
    validate's report names that instead of a performance table (real kernels: measured)."""
    from dinfer_rt.validation import markdown

    assert "interpreter" in cuda.emulation() and plugins.select_backend("cpu").emulation() is None
    header = {"dinfer_rt": "0", "commit": "x", "torch": "t", "python": "p", "platform": "p", "command": "c"}
    header |= {"seed": 0, "env": {}, "plugins": {}}
    header["backends"] = [{"name": "cuda", "flavour": "nvidia", "arch": "interpret", "device": "cpu"}]
    header["backends"][0] |= {"emulation": cuda.emulation(), "versions": {}}
    result = {"backend": "cuda:nvidia:interpret", "verdict": "pass", "failures": [], "unexpected_passes": []}
    result |= {"coverage": {"native_node_fraction": 1.0}, "conformance": [], "passes": {"rows": []}}
    result |= {"models": {}, "precision": {"rows": []}}
    result["performance"] = {"skipped": "not measured: the kernels ran on X"}
    text = markdown.render({"verdict": "pass", "quick": True, "dtypes": [], "header": header, "results": [result]})
    assert "(emulated: Triton's interpreter" in text and "not measured: the kernels ran on X" in text


def test_cuda_without_gpu_or_interpreter_is_a_clean_error(monkeypatch):
    monkeypatch.delenv("DINFER_INTERPRET", raising=False)
    plugins.registry.cache_clear()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(dinfer_rt.DinferError, match="backend 'cuda' chosen by the backend argument is unavailable"):
        plugins.select_backend("cuda")


KERNELS = {
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "rope",
    "lm_head_confidence",
    "attention",
    "attention_split_keys",
    "attention_combine",
    "router_softmax_topk",
    "router_sigmoid_grouped",
    "moe_gate_up",
    "moe_down",
    "commit_top_k",
    "commit_threshold",
    "commit_edit",
}


@pytest.mark.parametrize(
    "target", ["cuda:sm_80", "cuda:sm_90", "rocm_dcu:gfx906", "rocm_dcu:gfx90a", "rocm_dcu:gfx942"]
)
def test_every_kernel_compiles_ahead_of_time_without_spills(target):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DINFER_INTERPRET")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run(
        [sys.executable, "-m", "dinfer_rt", "kernels", "compile", "--target", target, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert {row["kernel"] for row in rows} == KERNELS
    assert all(row["registers"] and row["spill_stores"] == 0 for row in rows), rows
    assert all(row.get("sgpr_spills", 0) == 0 and row["spill_loads"] in (0, None) for row in rows), rows


def test_unknown_compile_target_is_a_clean_error():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DINFER_INTERPRET")}
    r = subprocess.run(
        [sys.executable, "-m", "dinfer_rt", "kernels", "compile", "--target", "cuda:sm_75"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert (
        r.returncode == 2
        and "unknown kernel target 'cuda:sm_75'; supported: cuda:sm_80, cuda:sm_90, rocm_dcu:gfx906" in r.stderr
    )


@pytest.mark.parametrize("rule", ["top_k", "threshold"])
@pytest.mark.parametrize("slots", [8, 37])
def test_commit_selection_kernel_matches_the_rules(cuda, rule, slots):
    """The device-side decisions equal strategies' low_confidence (rank-masked top-k with the
    schedule's quota) and threshold (with the at-least-one rule), and write the block in place."""
    from dinfer_rt import strategies
    from dinfer_rt.backends.triton.ops import commit

    g = torch.Generator().manual_seed(slots)
    b = 5
    conf = torch.rand(b, slots, generator=g)
    masked = torch.rand(b, slots, generator=g) < 0.6
    masked[:, 0] = True
    quota = torch.randint(0, 4, (b,), generator=g)
    x0 = torch.randint(0, 100, (b, slots), generator=g)
    seq = torch.full((b, slots + 9), -1)
    step = strategies.StepInput(None, masked, quota, 0.0, None, x0=x0, conf=conf)
    want_x0, want = (strategies.low_confidence if rule == "top_k" else strategies.make_threshold(0.7))(step)
    got = commit(conf, masked, quota, x0, seq[:, 4 : 4 + slots], rule=rule, threshold=0.7)
    assert torch.equal(got, want)
    assert torch.equal(seq[:, 4 : 4 + slots], torch.where(want, want_x0, -1))
    assert (seq[:, :4] == -1).all() and (seq[:, 4 + slots :] == -1).all()


def test_autotuner_times_once_and_remembers_on_disk(tmp_path):
    from dinfer_rt.backends.triton.autotune import Autotuner

    ticks = iter(range(10_000))
    speed = {16: 3.0, 32: 1.0, 64: 2.0}  # fake seconds per run: 32 wins
    clock_state = {"t": 0.0}

    def run(cfg):
        clock_state["t"] += speed[cfg["BLOCK_N"]]

    def clock():
        next(ticks)
        return clock_state["t"]

    cands = [{"BLOCK_N": n} for n in (16, 32, 64)]
    versions = {"triton": "3.9.0", "torch": "2.13.0"}
    tuner = Autotuner("sm_90", versions, tmp_path, clock=clock, iters=3)
    assert tuner.best("attention", (32, 1024, 128, 4, "bf16"), cands, run) == {"BLOCK_N": 32}
    assert tuner.measured == 3
    again = Autotuner("sm_90", versions, tmp_path, clock=clock)
    assert again.best("attention", (32, 1024, 128, 4, "bf16"), cands, run) == {"BLOCK_N": 32}
    assert again.measured == 0  # read from disk, nothing timed
    entry = again.entries["attention|32x1024x128x4xbf16"]
    assert entry["candidates"] == 3 and entry["ms"] == pytest.approx(1000.0)
    upgraded = Autotuner("sm_90", {**versions, "triton": "3.10.0"}, tmp_path, clock=clock)
    assert upgraded.entries == {}  # another Triton: a fresh cache file
    for corrupt in ("{not json", "[]", '{"entries": {"k": 3}}', "\udcff"):  # re-tuned with a warning naming it
        (tmp_path / again.path.name).write_text(corrupt, errors="surrogateescape")
        with pytest.warns(UserWarning, match=f"autotuning cache {re.escape(str(again.path))} is .* re-tuning"):
            fresh = Autotuner("sm_90", versions, tmp_path, clock=clock, iters=1)
        assert fresh.entries == {}
        assert fresh.best("attention", (32, 1024, 128, 4, "bf16"), cands, run) == {"BLOCK_N": 32}
        assert Autotuner("sm_90", versions, tmp_path).entries.keys() == {"attention|32x1024x128x4xbf16"}  # rewritten


def test_a_tuning_cache_variable_that_is_not_a_folder_is_named(monkeypatch, tmp_path):
    from dinfer_rt.backends.triton.autotune import Autotuner, default_cache_dir
    from dinfer_rt.errors import ConfigError

    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setenv("DINFER_TUNING_CACHE", str(afile))
    with pytest.raises(ConfigError, match=r"DINFER_TUNING_CACHE='.*afile' is not a folder"):
        default_cache_dir()
    monkeypatch.setenv("DINFER_TUNING_CACHE", str(afile / "below"))  # a folder that can never be made
    tuner = Autotuner("sm_90", {"triton": "3.9.0"}, clock=iter(range(100)).__next__, iters=1)
    with pytest.warns(UserWarning, match="cannot be written .* not remembered"):
        assert tuner.best("k", (1,), [{"B": 1}], lambda cfg: None) == {"B": 1}


def test_autotuned_attention_is_correct_and_cached(monkeypatch, tmp_path):
    import json

    monkeypatch.setenv("DINFER_INTERPRET", "1")
    monkeypatch.setenv("DINFER_AUTOTUNE", "1")
    monkeypatch.setenv("DINFER_TUNING_CACHE", str(tmp_path))
    plugins.registry.cache_clear()
    k = plugins.select_backend("cuda").kernels()
    q, key, v = (torch.randn(1, 5, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    valid, idx = torch.ones(1, 5, dtype=torch.bool), torch.arange(5)
    close(
        k["attention"](q, key, v, valid, idx, scale=0.25),
        ops.attention(q, key, v, valid, idx, scale=0.25),
        torch.float32,
    )
    (cache,) = tmp_path.glob("interpret-*.json")
    entries = json.loads(cache.read_text())["entries"]
    (name,) = entries
    assert (
        name == "attention|8x8x16x1xtorch.float32xFalse" and entries[name]["candidates"] == 6
    )  # T, S, D, GQA, dtype, causal


class _ReplayByRerun:
    """CPU stand-in for torch.cuda graphs: capture runs the function once (as warm-up does) and
    keeps its outputs as the static buffers; replay re-runs it and copies into those buffers."""

    def __init__(self):
        self.captured = 0

    def capture(self, fn, warmup):
        for _ in range(warmup):
            fn()
        self.captured += 1
        outputs = fn()

        class Graph:
            def replay(self):
                for name, t in fn().items():
                    outputs[name].copy_(t)

        return Graph(), outputs


def test_graphed_forward_replays_with_static_buffers_and_recaptures_on_new_shapes(cuda, ckpt_dir):
    """The graph bookkeeping on the CPU: one capture per input signature, inputs copied into
    static buffers, KV caches bound by address (a new cache is a new capture), results equal to
    the eager executable, outputs overwritten in place by the next replay."""
    from dinfer_rt.backends.triton.graphs import GraphedExecutable, mutated_inputs

    model = dinfer_rt.load_model(ckpt_dir("llada"), backend="cuda")
    eager = model.executable(True)
    assert mutated_inputs(eager) == {f"{kv}_cache.{i}" for kv in "kv" for i in range(model.spec.n_layers)}
    api = _ReplayByRerun()
    graphed = GraphedExecutable(eager, api)
    model._compiled[(True, None, "logits", "", False, None)] = graphed
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 60, (2, 12), generator=g)
    cache, ref_cache = model.new_cache(2, 12), model.new_cache(2, 12)
    blk = torch.arange(8, 12)
    first = model.forward(ids, cache=cache).clone()
    torch.testing.assert_close(first, eager(model._inputs(ids, None, ref_cache, None)[0])["logits"])
    out1 = model.forward(ids, cache=cache, compute=blk)
    keep = out1.clone()
    ids2 = ids.clone()
    ids2[:, 9] = 3
    out2 = model.forward(ids2, cache=cache, compute=blk)
    assert api.captured == 2 and graphed.graphs.captures == 2  # the full refresh and the block step
    assert out2.data_ptr() == out1.data_ptr()  # static output buffer, overwritten by the replay
    # the reference cache holds ids' K/V, as the graphed one did before this step
    torch.testing.assert_close(out2, eager(model._inputs(ids2, None, ref_cache, blk)[0])["logits"])
    assert not torch.equal(keep, out2)
    model.forward(ids, cache=model.new_cache(2, 12), compute=blk)  # another cache: another address
    assert api.captured == 3


def test_graphed_cached_decoding_captures_once_for_many_prompts(cuda, ckpt_dir, monkeypatch):
    """Cached decoding replays its graphs across ``generate`` calls: the scheduler's KV caches
    come from the model's pool, so the second and third prompt of a shape reuse the first one's
    buffers (addresses) and capture nothing new (on the H200 a fresh cache per prompt made cached
    decoding with graphs 3-6x slower than uncached). Tokens equal the eager cpu backend's."""
    from dinfer_rt.backends.triton.graphs import GraphedExecutable
    from dinfer_rt.engine import run_batch
    from dinfer_rt.sampling import SamplingParams

    path = ckpt_dir("llada")
    model = dinfer_rt.load_model(path, backend="cuda")
    api = _ReplayByRerun()
    compile_eager = model.backend.compile
    monkeypatch.setattr(model.backend, "compile", lambda g, w: GraphedExecutable(compile_eager(g, w), api))
    model.cache_pool.keep = 2  # what a backend whose replays_graphs() is true gets at load
    params = SamplingParams(strategy="threshold", cache="dual", gen_length=8, block_length=4, early_stop=False)
    prompts = [[5, 6, 7], [9, 8, 7], [11, 12, 13]]
    outs = [run_batch(model, [p], params).tokens for p in prompts[:1]]
    after_first = api.captured
    outs += [run_batch(model, [p], params).tokens for p in prompts[1:]]
    assert after_first >= 2 and api.captured == after_first  # refresh + block step, captured once
    reference = dinfer_rt.load_model(path, backend="cpu")
    for p, got in zip(prompts, outs):
        assert torch.equal(got, run_batch(reference, [p], params).tokens)


@pytest.mark.parametrize("strategy", ["threshold", "low_confidence"])
def test_scheduler_decides_on_the_device_with_the_same_tokens(cuda, monkeypatch, strategy):
    """With a backend commit kernel, greedy threshold / top-k decoding keeps the sequence on the
    device and decides there (no per-step host sync); tokens equal the host path on cpu, for a
    padded batch of different prompt lengths with early stop. Top-k commits two tokens a step
    (20 steps for 40 tokens: half the interpreted forwards of one a step, and k > 1 on the kernel)."""
    from dinfer_rt.backends.triton import ops as cuda_ops
    from dinfer_rt.demo import task

    calls = []
    real = cuda_ops.commit
    monkeypatch.setattr(cuda_ops, "commit", lambda *a, **k: calls.append(k["rule"]) or real(*a, **k))
    prompts = [it.letters for it in task.heldout(3)]
    prompts[1] = prompts[1][:4]
    steps = {"steps": 20} if strategy == "low_confidence" else {}
    params = dinfer_rt.SamplingParams(
        strategy=strategy, threshold=0.9, batch_size=3, cache="dual", block_length=8, **steps
    )
    want = [o.token_ids for o in dinfer_rt.LLM(backend="cpu").generate(prompts, params)]
    got = [o.token_ids for o in dinfer_rt.LLM(backend="cuda").generate(prompts, params)]
    assert got == want
    assert calls and set(calls) == {"threshold" if strategy == "threshold" else "top_k"}


@pytest.mark.parametrize("name", ["llada_gqa_sharded", "llada2"])
def test_per_row_query_windows_match_cpu(cuda, ckpt_dir, name):
    """Continuous batching's per-row token_index [B, T] through the flash kernel (block-causal too)."""
    from dinfer_rt.testing import per_row_windows

    path = ckpt_dir(name)
    model = dinfer_rt.load_model(path, backend="cuda")
    assert per_row_windows.per_row_error(model, dinfer_rt.load_model(path, backend="cpu")) <= 1e-5
