"""``dinfer-rt validate`` checks the editing rule (joint_threshold): its per-step decisions on a
backend against an independent float64 oracle, with the near-tie rule; a planted fault in the
edit criterion (``>=`` for ``>``) or in the prompt mask (prompt slots editable) fails it, and the
failure names the rule. The same check runs on every backend ``validate`` is given (the cuda /
rocm_dcu interpreters and the onnxruntime plugin in their own test files' runs)."""

from __future__ import annotations

import pytest
import torch

import dinfer_rt
from dinfer_rt import strategies
from dinfer_rt.decode import Cohort
from dinfer_rt.validation import editing, runner

SMALL = runner.EDIT_SMALL


def _greater_or_equal(monkeypatch):
    """The edit and commit criteria with >= (the planted fault)."""

    def make(tau, edit_tau, penalty):
        def rule(s):
            z = strategies.penalize_previous(s.logits, s.current, penalty)
            x0 = strategies.sample(z, s.temperature, s.generator)
            conf = z.float().softmax(-1).gather(-1, x0[..., None]).squeeze(-1)
            m2t = strategies._at_least_one(s.masked & (conf >= tau), conf, s.masked)
            return x0, m2t | (s.editable & (x0 != s.current) & (conf >= edit_tau))

        return rule

    monkeypatch.setattr(strategies, "make_joint_threshold", make)


def _prompt_editable(monkeypatch):
    """The block's prompt mask forgotten (the planted fault): prompt slots become editable."""
    real = Cohort._start_block

    def start(self):
        real(self)
        if self.editing:
            self.prompt_block = torch.zeros_like(self.prompt_block)

    monkeypatch.setattr(Cohort, "_start_block", start)


@pytest.fixture(scope="module")
def llada2(ckpt_dir):
    path = ckpt_dir("llada2")
    return dinfer_rt.load_model(path, backend="cpu"), dinfer_rt.load_model(path, backend="reference", dtype="float64")


def test_the_editing_check_passes_on_cpu(llada2):
    test, ref = llada2
    res = editing.check(test, ref, [[7, 8, 9, 10, 11, 12]], SMALL, 1e-3)
    assert res["passed"] and res["rule"] == "joint_threshold", res
    assert res["decisions"]["steps"] > 2 and len(res["probes"]["cases"]) == 3


@pytest.mark.parametrize("fault", [_greater_or_equal, _prompt_editable])
def test_a_planted_fault_in_the_rule_fails_the_check(llada2, monkeypatch, fault):
    test, ref = llada2
    fault(monkeypatch)
    res = editing.check(test, ref, [[7, 8, 9, 10, 11, 12]], SMALL, 1e-3)
    assert not res["passed"]
    assert any(c["violations"] for c in res["probes"]["cases"])


def test_validate_names_the_rule_when_its_decisions_fail(monkeypatch):
    """The runner's verdict: with the >= fault planted, ``validate --quick`` fails and its
    failures name the check of the rule (the other sections are cut short here: they are
    tested in tests/test_validation.py)."""
    monkeypatch.setattr(runner, "run_conformance", lambda *a, **k: [])
    monkeypatch.setattr(runner, "measure", lambda *a, **k: {})
    monkeypatch.setattr(runner.model_checks, "task_accuracy", lambda *a, **k: {"passed": True})
    monkeypatch.setattr(runner.model_checks, "precision_report", lambda *a, **k: {"rows": []})
    monkeypatch.setattr(runner.model_checks, "decisions", lambda *a, **k: {"passed": True})
    monkeypatch.setattr(runner.model_checks, "teacher_forced", lambda *a, **k: {"passed": True})
    monkeypatch.setattr(runner.model_checks, "free_running", lambda *a, **k: {"passed": True})
    _greater_or_equal(monkeypatch)
    report = runner.validate("cpu", quick=True, dtypes="float32")
    failures = report["results"][0]["failures"]
    assert report["verdict"] == "fail"
    assert "embedded: decisions (joint_threshold)" in failures and "llada2: decisions (joint_threshold)" in failures


def _ascend(monkeypatch) -> str:
    from dinfer_rt.backend import Availability
    from dinfer_rt.backends.ascend.plugin import AscendBackend
    from dinfer_rt.testing import simulated_torch_npu

    simulated_torch_npu.install(monkeypatch)
    monkeypatch.setattr(AscendBackend, "is_available", lambda self: Availability(True, "simulated torch_npu"))
    monkeypatch.setattr(AscendBackend, "device_type", "cpu")
    return "ascend"


@pytest.mark.parametrize("backend", ["cuda", "rocm_dcu:amd:gfx942", "onnxruntime", "ascend"])
def test_the_editing_check_passes_on_every_backend(ckpt_dir, monkeypatch, backend):
    """cuda and rocm_dcu under Triton's interpreter, the out-of-tree onnxruntime plugin (when
    installed), ascend through the simulated torch_npu: the rule's decisions on each backend's
    logits equal the oracle's (near ties aside) and the boundary probes match exactly."""
    from dinfer_rt import plugins
    from dinfer_rt.validation.model_checks import NEAR_TIE

    pytest.importorskip("triton")
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
        if "onnxruntime" not in plugins.registry().backends:
            pytest.skip("the onnxruntime plugin is not installed (tests/test_onnxruntime_plugin.py installs it)")
    if backend == "ascend":
        _ascend(monkeypatch)
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    path = ckpt_dir("llada2")
    test = dinfer_rt.load_model(path, backend=backend, dtype="float32")
    ref = dinfer_rt.load_model(path, backend="reference", dtype="float64")
    res = editing.check(test, ref, [[7, 8, 9, 10, 11, 12]], SMALL, NEAR_TIE[torch.float32])
    assert res["passed"], res
