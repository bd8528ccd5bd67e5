"""The pass pipeline: fused == unfused numerically, rules that must not fire, the manager's
switches, and golden IR snapshots per family and backend (UPDATE_SNAPSHOTS=1 rewrites them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import dinfer_rt
from dinfer_rt.errors import DinferError
from dinfer_rt.ir import Graph, IRError, TensorType
from dinfer_rt.passes import Pass, PassContext, PassManager, default_pipeline
from dinfer_rt.passes import fusion as rules

FAMILIES = ["llada", "dream", "llada_moe", "llada2"]
ALL_PASSES = ",".join(p.name for p in default_pipeline())
SNAPSHOTS = Path(__file__).parent / "snapshots"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_fused_equals_unfused(ckpt_dir, name, dtype, monkeypatch):
    path = ckpt_dir(name)
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(1))
    fused = dinfer_rt.load_model(path, dtype=dtype)
    assert sum(v for k, v in fused.pass_counts.items() if k in ("merge_projections", "add_rms_norm")) > 0
    monkeypatch.setenv("DINFER_DISABLE_PASSES", ALL_PASSES)
    plain = dinfer_rt.load_model(path, dtype=dtype)
    assert plain.pass_counts == {}
    a, b = fused.forward(ids, block_size=4).float(), plain.forward(ids, block_size=4).float()
    # float32: only summation order differs. bfloat16: merged matmuls round differently, so the
    # bound is the same 5e-2 of the logit scale the bf16-vs-fp32 test uses.
    tol = 1e-5 if dtype == "float32" else 5e-2
    assert ((a - b).abs().max() / b.abs().max()).item() <= tol


def _graph_with_swiglu(extra_silu_user: bool = False, up_dtype=torch.float32) -> tuple[Graph, dict]:
    g = Graph("t")
    x = g.input("x", TensorType(("B", 8), torch.float32))
    wg = g.param("wg", TensorType((6, 8), torch.float32))
    wu = g.param("wu", TensorType((6, 8), up_dtype))
    act = g.op("silu", g.op("linear", x, wg))
    up = g.op("linear", g.op("cast", x, dtype=up_dtype), wu) if up_dtype != torch.float32 else g.op("linear", x, wu)
    if up_dtype != torch.float32:
        up = g.op("cast", up, dtype=torch.float32)
    g.output("y", g.op("mul", act, up))
    if extra_silu_user:
        g.output("act", act)
    weights = {"wg": torch.randn(6, 8), "wu": torch.randn(6, 8).to(up_dtype)}
    return g.verify(), weights


def test_gate_up_merge_fires_and_matches():
    g, w = _graph_with_swiglu()
    x = torch.randn(3, 8)
    want = torch.nn.functional.silu(x @ w["wg"].T) * (x @ w["wu"].T)
    ctx = PassContext(w)
    assert rules.merge_gate_up(g, ctx) == 1
    assert g.verify().op_counts() == {"linear": 1, "swiglu": 1}
    exe = dinfer_rt.backend.Executable(g, {n: o.reference for n, o in dinfer_rt.ir.OPS.items()}, w)
    torch.testing.assert_close(exe({"x": x})["y"], want)


def test_gate_up_merge_does_not_fire_when_an_intermediate_escapes():
    g, w = _graph_with_swiglu(extra_silu_user=True)
    assert rules.merge_gate_up(g, PassContext(w)) == 0


def test_projection_merge_does_not_fire_on_mismatched_dtypes():
    g = Graph("t")
    x = g.input("x", TensorType(("B", 8), torch.float32))
    a = g.op("linear", x, g.param("a", TensorType((4, 8), torch.float32)))
    xb = g.op("cast", x, dtype=torch.bfloat16)
    b = g.op("linear", xb, g.param("b", TensorType((4, 8), torch.bfloat16)))
    g.output("a", a)
    g.output("b", b)
    assert rules.merge_projections(g, PassContext({})) == 0


def test_add_rms_norm_exports_the_sum_to_its_other_users():
    g = Graph("t")
    a = g.input("a", TensorType(("B", 8), torch.float32))
    b = g.input("b", TensorType(("B", 8), torch.float32))
    s = g.op("add", a, b)
    n = g.op("rms_norm", s, g.param("w", TensorType((8,), torch.float32)), eps=1e-6)
    g.output("y", g.op("add", s, n))  # the residual stream goes on
    w = {"w": torch.rand(8) + 0.5}
    kern = {k: o.reference for k, o in dinfer_rt.ir.OPS.items()}
    ins = {"a": torch.randn(2, 8), "b": torch.randn(2, 8)}
    want = dinfer_rt.backend.Executable(g, kern, w)(ins)["y"]
    assert rules.add_rms_norm(g, PassContext(w)) == 1
    assert g.verify().op_counts() == {"add_rms_norm": 1, "add": 1}
    torch.testing.assert_close(dinfer_rt.backend.Executable(g, kern, w)(ins)["y"], want)


def test_cse_and_dce():
    from dinfer_rt.passes import cleanup

    g = Graph("t")
    x = g.input("x", TensorType((4,), torch.float32))
    a, b = g.op("silu", x), g.op("silu", x)
    g.op("mul", a, a)  # dead
    g.output("y", g.op("add", a, b))
    assert cleanup.common_subexpressions(g, None) == 1
    assert cleanup.dead_code(g, None) == 1
    assert g.verify().op_counts() == {"silu": 1, "add": 1}


def test_disable_passes_and_dump_ir(ckpt_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DINFER_DUMP_IR", str(tmp_path))
    monkeypatch.setenv("DINFER_DISABLE_PASSES", "add_rms_norm")
    m = dinfer_rt.load_model(ckpt_dir("llada"))
    assert "add_rms_norm" not in m.pass_counts and m.pass_counts["merge_gate_up"] == 2
    dumps = sorted(p.name for p in tmp_path.iterdir())
    assert dumps[0] == "llada.00.lowered.ir" and "llada.03.fusion.merge_gate_up.ir" in dumps
    monkeypatch.setenv("DINFER_DISABLE_PASSES", "no_such_pass")
    with pytest.raises(DinferError, match=r"DINFER_DISABLE_PASSES names unknown pass\(es\) \['no_such_pass'\]"):
        dinfer_rt.load_model(ckpt_dir("llada"))


def test_verifier_runs_after_every_pass():
    def breaks_ssa(graph, ctx):
        graph.nodes.append(graph.nodes[0])
        return 1

    g = Graph("t")
    g.output("y", g.op("silu", g.input("x", TensorType((4,), torch.float32))))
    with pytest.raises(IRError, match="after pass 'breaker'.*defined twice"):
        PassManager([Pass("breaker", "fusion", breaks_ssa)]).run(g, {})


def test_fusions_need_a_native_kernel_for_the_fused_op():
    names = {p.name for p in PassManager(default_pipeline(), native_ops={"split"}).passes}
    assert "merge_projections" in names and "add_rms_norm" not in names and "merge_gate_up" not in names


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("name", FAMILIES)
def test_golden_ir_after_pipeline(ckpt_dir, name, backend):
    """The optimised graph of each family on each backend (cuda: only the fusions whose fused op
    has a Triton kernel, gate/up + SwiGLU and add + RMSNorm) is a reviewed snapshot: a pipeline
    change shows up as a diff here."""
    from dinfer_rt.lowering import lower
    from dinfer_rt.model_spec import parse_spec
    from dinfer_rt.plugins import registry

    spec = parse_spec(ckpt_dir(name))
    be = registry().backends[backend]()
    weights: dict = {}
    from dinfer_rt.model_spec import param_plan

    for p in param_plan(spec):  # shapes only: the passes read weights only to merge them
        weights[p.name] = torch.zeros(p.shape)
    graph, counts = be.optimize(lower(spec, torch.float32, block_size=spec.default_block_size), weights)
    text = f"# passes: {counts}\n{graph}\n"
    snap = SNAPSHOTS / f"{name}.{backend}.ir"
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        snap.write_text(text)
    assert snap.exists(), f"no snapshot {snap.name}: run with UPDATE_SNAPSHOTS=1 and review it"
    assert text == snap.read_text()


def test_confidence_head_never_builds_the_probability_tensor():
    """An LLaDA-8B-shaped denoising step (block of 32 masked positions, vocab 126,464), weights on
    the meta device: fusing the LM head with the confidence reduction lowers the simulated peak by
    at least the float32 [32 x 126464] tensor the unfused graph materialises."""
    from dinfer_rt.config_writers import LLADA_8B
    from dinfer_rt.lowering import lower
    from dinfer_rt.model_spec import param_plan, parse_spec
    from dinfer_rt.passes import reorder
    from dinfer_rt.plugins import select_backend

    spec = parse_spec(Path("LLaDA-8B"), LLADA_8B)  # config only: no files, no weights
    weights = {p.name: torch.empty(p.shape, device="meta") for p in param_plan(spec)}  # nothing allocated
    bind = {"B": 1, "T": 32, "S": 1024, "M": 32}
    before = lower(spec, torch.float32, cached=True, head="confidence", mask_id=126336)
    peak_before = reorder.peak_bytes(before, list(range(len(before.nodes))), bind)
    after, counts = select_backend("cpu").optimize(
        lower(spec, torch.float32, cached=True, head="confidence", mask_id=126336), weights
    )
    assert counts["lm_head_confidence"] == 1 and "linear" not in [n.op for n in after.nodes[-2:]]
    peak_after = reorder.peak_bytes(after, list(range(len(after.nodes))), bind)
    # The unfused graph holds the f32 logits while its confidence op builds f32 probabilities of the
    # same size (op workspace, simulated); the fused kernel holds one vocabulary chunk.
    assert peak_before - peak_after >= 32 * 126464 * 4


def test_rope_fold_does_not_fire_when_a_rotated_value_escapes(ckpt_dir):
    from dinfer_rt.lowering import lower
    from dinfer_rt.model_spec import parse_spec

    g = lower(parse_spec(ckpt_dir("llada_moe")), torch.float32)
    first_rope = next(n for n in g.nodes if n.op == "rope")
    g.output("peek", first_rope.outputs[0])  # another user of the rotated q of layer 0
    assert rules.fold_rope_into_attention(g, PassContext({})) == 1  # only layer 1 folds
    assert g.verify().op_counts()["rope_attention"] == 1


def test_routing_fold_does_not_fire_when_router_weights_escape(ckpt_dir):
    from dinfer_rt.lowering import lower
    from dinfer_rt.model_spec import parse_spec

    g = lower(parse_spec(ckpt_dir("llada2")), torch.float32)
    router = next(n for n in g.nodes if n.op == "router_sigmoid_grouped")
    g.output("weights", router.outputs[0])
    assert rules.fold_routing_into_moe(g, PassContext({})) == 1  # the other MoE layer still folds
    assert g.verify().op_counts()["moe_routed"] == 1


def test_backend_cost_decision_and_priority(ckpt_dir):
    from dinfer_rt.backends.cpu import CpuBackend
    from dinfer_rt.lowering import lower
    from dinfer_rt.model_spec import param_plan, parse_spec

    seen = []

    class Picky(CpuBackend):
        def wants_fusion(self, pass_name):
            return pass_name != "add_rms_norm"

        def reorder_priority(self):
            def reverse_original_order(node, uses, bindings):
                seen.append(node.op)
                return 0.0

            return reverse_original_order

    spec = parse_spec(ckpt_dir("llada"))
    weights = {p.name: torch.zeros(p.shape) for p in param_plan(spec)}
    graph, counts = Picky().optimize(lower(spec, torch.float32), weights)
    assert "add_rms_norm" not in counts and counts["merge_gate_up"] == 2
    assert seen  # the backend's priority drove the list scheduler


def test_confidence_fusion_does_not_fire_when_logits_escape(ckpt_dir):
    from dinfer_rt.lowering import lower
    from dinfer_rt.model_spec import parse_spec

    g = lower(parse_spec(ckpt_dir("llada")), torch.float32, head="confidence", mask_id=5)
    conf = next(n for n in g.nodes if n.op == "confidence")
    g.output("logits", conf.inputs[0])  # someone still wants the full logits
    assert rules.lm_head_confidence(g, PassContext({})) == 0
    g.outputs.pop("logits")
    assert rules.lm_head_confidence(g, PassContext({})) == 1
    assert g.verify().op_counts()["lm_head_confidence"] == 1
