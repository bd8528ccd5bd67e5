"""The ascend backend against the documented torch_npu contract, on the CPU: a simulated
torch_npu (dinfer_rt.testing.simulated_torch_npu) stands in for the real one, so these tests
check the lowering's argument conventions and the results through them, not the hardware.
Tolerances are the validation suite's (bf16 model level; kernels: see each test)."""

from __future__ import annotations

import pytest
import torch

import dinfer_rt
from dinfer_rt import plugins
from dinfer_rt.backend import Availability
from dinfer_rt.backends.ascend import launch as tk
from dinfer_rt.backends.ascend import ops as ascend_ops
from dinfer_rt.backends.ascend.plugin import AscendBackend
from dinfer_rt.ir import ops
from dinfer_rt.testing import simulated_torch_npu

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter padding lanes


@pytest.fixture
def ascend(monkeypatch):
    """The ascend backend with the simulated torch_npu, on CPU tensors (device "npu" needs the
    real one), triton-ascend's kernel under the interpreter."""
    simulated_torch_npu.install(monkeypatch)
    monkeypatch.setattr(AscendBackend, "is_available", lambda self: Availability(True, "simulated torch_npu"))
    monkeypatch.setattr(AscendBackend, "device_type", "cpu")
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    return plugins.select_backend("ascend")


def test_every_mapped_op_is_native(ascend):
    table = ascend.kernel_table()
    native = {op for op, (_, src) in table.items() if src == "native"}
    assert native == {
        "rms_norm",
        "add_rms_norm",
        "rope",
        "swiglu",
        "attention",
        "router_softmax_topk",
        "router_sigmoid_grouped",
        "moe_experts",
        "confidence",
        "linear_wq",
    }


def test_ascend_pass_pipeline_keeps_only_its_fusions(ascend, ckpt_dir):
    model = dinfer_rt.load_model(ckpt_dir("llada2"), backend="ascend", dtype="bfloat16")
    counts = model.executable(False).graph.op_counts()
    assert counts.get("add_rms_norm", 0) > 0 and counts.get("swiglu", 0) > 0
    assert "rope_attention" not in counts and "moe_routed" not in counts and "lm_head_confidence" not in counts


def test_model_level_validation_passes_for_every_family(ascend, tmp_path):
    """The model-level validation (teacher-forced logits, lock-step decisions, free running, task
    accuracy on the embedded model; every tiny family) through the simulated operators: the quick
    suite, whose tiny family is LLaDA2, then the same family checks on the other three (the full
    suite's extra items on the embedded model took 4 more minutes and checked nothing new here)."""
    from dinfer_rt.validation.runner import family_checks, tiny_checkpoints, validate

    report = validate("ascend", quick=True)  # model level in fp32 (npu_fusion_attention), ops in fp32 and bf16
    (result,) = report["results"]
    assert set(result["models"]) == {"embedded", "llada2"}
    assert result["verdict"] == "pass", result["failures"]
    assert "simulated torch_npu" in result["performance"]["skipped"]  # its timings would be the simulation's
    for name, path in tiny_checkpoints(tmp_path, quick=False).items():
        if name != "llada2":
            checks = family_checks(ascend, path, torch.float32)
            assert checks and all(c["passed"] for c in checks.values()), (name, checks)


def _teacher_forced_ok(ckpt, dtype="bfloat16") -> bool:
    from dinfer_rt.validation import model_checks

    test = dinfer_rt.load_model(ckpt, backend="ascend", dtype=dtype)
    ref = dinfer_rt.load_model(ckpt, backend="cpu", dtype="float64")
    return model_checks.teacher_forced(test, ref, [[7, 8, 9, 10], [11, 12, 13, 14]], None, 8)["passed"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # both attention operators
def test_correct_conventions_pass_teacher_forcing(ascend, ckpt_dir, dtype):
    assert _teacher_forced_ok(ckpt_dir("llada_gqa_sharded"), dtype)


@pytest.mark.parametrize(
    "constant, wrong, symptom",
    [
        ("ATTENTION_LAYOUT", "BSND", "error"),  # BNSD tensors announced as BSND
        ("ATTENTION_LAYOUT", "BSH", "error"),
        ("MASK_TRUE_MEANS_MASKED", False, "mismatch"),  # inverted mask polarity
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_wrong_convention_fails(ascend, ckpt_dir, monkeypatch, constant, wrong, symptom, dtype):
    monkeypatch.setattr(ascend_ops, constant, wrong)
    ckpt = ckpt_dir("llada_gqa_sharded")  # GQA 6/2 heads: layout letters cannot line up by accident
    if symptom == "error":
        with pytest.raises(Exception, match="npu_fus"):
            _teacher_forced_ok(ckpt, dtype)
    else:
        assert not _teacher_forced_ok(ckpt, dtype)


def test_wrong_attention_scale_fails(ascend):
    """A mapping that passed 1 / scale (or forgot it) would not match the reference."""
    k = ascend.kernels()
    g = torch.Generator().manual_seed(0)
    q, key, v = (torch.randn(2, 6, 4, 16, generator=g).bfloat16() for _ in range(3))
    valid, idx = torch.ones(2, 6, dtype=torch.bool), torch.arange(6)
    want = ops.attention(q.double(), key.double(), v.double(), valid, idx, scale=0.25)
    good = k["attention"](q, key, v, valid, idx, scale=0.25)
    bad = k["attention"](q, key, v, valid, idx, scale=4.0)
    err = lambda a: ((a.double() - want).abs().max() / want.abs().max()).item()
    assert err(good) <= 2e-2 < err(bad)


def test_grouped_router_maps_on_the_documented_shape_and_falls_back_elsewhere(ascend, monkeypatch):
    k = ascend.kernels()
    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(5, 256, generator=g), 0.05 * torch.randn(256, generator=g)
    attrs = {"k": 8, "n_group": 8, "topk_group": 4, "renormalize": True, "scale": 2.5}
    w, idx = k["router_sigmoid_grouped"](logits, bias, **attrs)
    want_w, want_idx = ops.router_sigmoid_grouped(logits.double(), bias.double(), **attrs)
    assert torch.equal(idx, want_idx) and torch.allclose(w.double(), want_w, rtol=1e-5)
    assert ascend.constraint_fallbacks == {}
    monkeypatch.setattr(ascend_ops, "GROUP_SELECT_TOP2_SUM", 0)  # groups ranked by max: a wrong convention
    _, wrong_idx = ascend.kernels()["router_sigmoid_grouped"](logits, bias, **attrs)
    assert not torch.equal(wrong_idx, want_idx)
    small = torch.randn(3, 8, generator=g)
    k["router_sigmoid_grouped"](small, torch.zeros(8), k=2, n_group=4, topk_group=2, renormalize=True, scale=1.0)
    assert ascend.constraint_fallbacks == {"router_sigmoid_grouped": 1}  # counted, not silent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["max", "margin", "entropy"])
def test_shared_confidence_kernel_on_a_persistent_grid(dtype, kind, monkeypatch):
    """Persistent grid of 5 programs over 13 rows in blocks of 2, vocab 1001 in sub-blocks of 64,
    the mask token banned; against the float64 reference (fp32 1e-5, 16-bit inputs 1e-5 too: the
    kernel widens them exactly)."""
    from dinfer_rt.backends.triton import kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(len(kind))
    logits = (3 * torch.randn(13, 1001, generator=g)).to(dtype)
    score, token = torch.empty(13), torch.empty(13, dtype=torch.int64)
    kind_id = ["max", "margin", "entropy"].index(kind)
    kernels.confidence_kernel[(5,)](logits, score, token, 13, 1001, 7, KIND=kind_id, BLOCK_V=64, ROWS=2)
    want, want_token = ops.confidence(logits.double(), banned=7, kind=kind)
    assert torch.equal(token, want_token)
    assert ((score.double() - want).abs().max() / want.abs().max()).item() <= 1e-5


@pytest.mark.parametrize("vocab", [40, 1001, 126464, 151936])
@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("cores", [40, 48])
@pytest.mark.parametrize("rows", [1, 700, 40960])
def test_confidence_launch_obeys_the_ascend_rules(vocab, elem_bytes, cores, rows):
    cfg = tk.launch_config(vocab, elem_bytes, cores, rows)
    assert cfg["grid"] == cores <= tk.MAX_CORE_DIM  # grid = physical vector cores, coreDim cap
    assert (cfg["BLOCK_V"] * elem_bytes) % tk.ALIGN_BYTES == 0  # 32-byte aligned vector access
    assert tk.working_set_bytes(cfg["BLOCK_V"], elem_bytes, cfg["ROWS"]) <= tk.UB_BYTES // 2  # UB, double-buffered
    assert cfg["BLOCK_V"] & (cfg["BLOCK_V"] - 1) == 0


def test_listed_unavailable_here_without_cann(monkeypatch, capsys):
    plugins.registry.cache_clear()
    from dinfer_rt.cli import main

    assert main(["backends"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split() and ln.split()[0] == "ascend")
    assert line.split()[2] == "no" and "torch_npu" in line


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_through_init_routing_grouped_matmul_finalize(ascend, dtype):
    """Init routing (expert-sorted copies), two grouped matmuls around npu_swiglu, finalize with
    the routing weights; some experts get no token; against the float64 per-expert loop."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 7, 24, generator=g).to(dtype)
    gate_up, down = (
        (0.2 * torch.randn(6, 32, 24, generator=g)).to(dtype),
        (0.2 * torch.randn(6, 24, 16, generator=g)).to(dtype),
    )
    w, idx = ops.router_softmax_topk(torch.randn(2, 7, 6, generator=g), k=2, renormalize=False)
    got = ascend.kernels()["moe_experts"](x, w, idx, gate_up, down)
    want = ops.moe_experts(x.double(), w.double(), idx, gate_up.double(), down.double())
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_acl_graphs_are_wired_through_torch_npu(ascend, ckpt_dir, monkeypatch):
    """DINFER_GRAPHS=1 on the npu device wraps executables in the graph cache with torch.npu's
    NPUGraph (the capture itself needs an NPU; its bookkeeping is tested with the cuda backend)."""
    import types

    from dinfer_rt.backends.triton.graphs import GraphedExecutable

    model = dinfer_rt.load_model(ckpt_dir("llada"), backend="ascend", dtype="bfloat16")
    exe = model.executable(True)
    fake_npu = types.SimpleNamespace(NPUGraph=type("NPUGraph", (), {}))
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    monkeypatch.setenv("DINFER_GRAPHS", "1")
    monkeypatch.setattr(ascend, "device_type", "npu")
    graphed = ascend.compile(exe.graph, model.weights)
    assert isinstance(graphed, GraphedExecutable) and graphed.graphs.api.graph_cls is fake_npu.NPUGraph
    assert graphed.graphs.pinned == {f"{kv}_cache.{i}" for kv in "kv" for i in range(model.spec.n_layers)}
    assert ascend.replays_graphs()  # so a model loaded now keeps its scheduler caches (cache_pool)
    monkeypatch.setenv("DINFER_GRAPHS", "0")
    assert not isinstance(ascend.compile(exe.graph, model.weights), GraphedExecutable)
    assert not ascend.replays_graphs()


@pytest.mark.parametrize("rule", ["top_k", "threshold"])
def test_shared_commit_kernel_persistent_over_vector_cores(rule, monkeypatch):
    """Persistent over 7 rows on a grid of 3 'cores'; equals strategies' low_confidence and
    threshold rules and writes the block of the sequence in place."""
    from dinfer_rt import strategies
    from dinfer_rt.backends.triton.ops import commit

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(2)
    b, slots = 7, 21
    conf, masked = torch.rand(b, slots, generator=g), torch.rand(b, slots, generator=g) < 0.5
    masked[:, 3] = True
    quota, x0 = torch.randint(0, 5, (b,), generator=g), torch.randint(0, 50, (b, slots), generator=g)
    seq = torch.full((b, slots + 4), -1)
    step = strategies.StepInput(None, masked, quota, 0.0, None, x0=x0, conf=conf)
    want_x0, want = (strategies.low_confidence if rule == "top_k" else strategies.make_threshold(0.6))(step)
    launch = tk.commit_launch(vector_cores=3)
    got = commit(conf, masked, quota, x0, seq[:, 2 : 2 + slots], rule=rule, threshold=0.6, **launch)
    assert torch.equal(got, want) and torch.equal(seq[:, 2 : 2 + slots], torch.where(want, want_x0, -1))


def test_per_row_query_windows_match_cpu(ascend, ckpt_dir):
    """Continuous batching's per-row token_index [B, T] through torch_npu's attention (simulated)."""
    from dinfer_rt.testing import per_row_windows

    path = ckpt_dir("llada2")
    model = dinfer_rt.load_model(path, backend="ascend", dtype="float32")
    assert per_row_windows.per_row_error(model, dinfer_rt.load_model(path, backend="cpu")) <= 1e-5
