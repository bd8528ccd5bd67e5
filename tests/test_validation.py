"""The validation suite: the cpu backend passes; planted faults are caught and named."""

from __future__ import annotations

import json
from importlib.metadata import EntryPoint

import pytest
import torch

from dinfer_rt import plugins
from dinfer_rt.validation import model_checks
from dinfer_rt.validation.conformance import run_conformance


@pytest.fixture
def faulty(monkeypatch):
    real = plugins.entry_points

    def with_faulty(group):
        return list(real(group=group)) + [EntryPoint("faulty", "tests.fake_plugins.faulty", group)]

    monkeypatch.setattr(plugins, "entry_points", with_faulty)
    plugins.registry.cache_clear()


def test_cpu_passes_op_conformance_in_every_dtype():
    results = run_conformance(plugins.select_backend("cpu"), [torch.float32, torch.bfloat16, torch.float16])
    assert {r["op"] for r in results} >= {"attention", "rope", "rms_norm", "moe_experts", "add_rms_norm", "swiglu"}
    bad = [r for r in results if r["status"] != "pass"]
    assert not bad, bad


def test_every_ir_op_has_a_conformance_case_in_the_quick_suite_too():
    """A port is proven op by op: an op without a case (the paged pool's kv_gather / kv_scatter had
    none) would never be checked by `dinfer-rt validate`, however wrong its kernel."""
    from dinfer_rt.ir import OPS
    from dinfer_rt.validation.opdb import cases

    assert set(OPS) - {c.op for c in cases()} == set()
    assert set(OPS) - {c.op for c in cases(quick=True)} == set()


def test_planted_kernel_faults_fail_and_are_named(faulty):
    """Every planted fault fails op conformance in quick mode, and only on the op it is in."""
    from tests.fake_plugins.faulty import FAULTS

    for backend, (op, _, _) in FAULTS.items():
        results = run_conformance(plugins.select_backend(backend), [torch.float32], quick=True)
        failed = {r["op"] for r in results if r["status"] == "fail"}
        assert failed == {op} or (op == "rms_norm" and failed == {"rms_norm", "add_rms_norm"}), (backend, failed)
        first = next(r for r in results if r["status"] == "fail")
        assert "worst element" in first["detail"] and first["max_rel"] > first["tolerance"]["rel"]


@pytest.mark.parametrize("backend", ["faulty_attention", "faulty_rope_attention"])
def test_validate_self_check_fails_a_planted_fault_naming_the_op(faulty, backend, monkeypatch):
    """The suite checks itself: `validate --quick` of a faulty copy of the cpu kernels fails and its
    failures name the op (an unfused and a fused attention that ignore padding). Every other
    planted fault is caught by the same op conformance in ``test_planted_kernel_faults_...``."""
    from dinfer_rt.validation.runner import validate
    from tests.fake_plugins.faulty import FAULTS

    monkeypatch.delenv("DINFER_BACKEND", raising=False)  # earlier selections in this process wrote it
    report = validate(backend, quick=True, dtypes="float32")
    assert report["verdict"] == "fail"
    assert "DINFER_BACKEND" not in report["header"]["env"]  # the user's environment, not what selecting wrote
    assert report["results"][0]["performance"]["step_ms_p50"] > 0  # real kernels: timings are measured
    failures = report["results"][0]["failures"]
    assert any(f.startswith(f"op {FAULTS[backend][0]}/") for f in failures), failures


def test_model_level_checks_catch_a_padding_bug_on_mixed_length_prompts(faulty, ckpt_dir):
    """Beyond the op database: teacher-forced logits of a left-padded mixed-length batch."""
    import dinfer_rt

    path = ckpt_dir("llada")
    bad = dinfer_rt.load_model(path, backend="faulty_rope_attention")
    ref = dinfer_rt.load_model(path, backend="cpu", dtype="float64")
    assert bad.pass_counts["fold_rope_into_attention"] > 0  # the faulty fused kernel is the one running
    assert not model_checks.teacher_forced(bad, ref, [[7, 8, 9, 10], [11, 12]], None, 8)["passed"]
    assert model_checks.teacher_forced(bad, ref, [[7, 8, 9, 10], [11, 12, 13, 14]], None, 8)["passed"]


def test_planted_fault_diverges_a_free_running_generation(faulty, ckpt_dir):
    import dinfer_rt

    path = ckpt_dir("dream")
    bad = dinfer_rt.load_model(path, backend="faulty_rope")
    ref = dinfer_rt.load_model(path, backend="cpu", dtype="float64")
    params = dinfer_rt.SamplingParams(gen_length=8, block_length=4, early_stop=False)
    res = model_checks.free_running(bad, ref, [[7, 8, 9, 10], [11, 12, 13, 14]], params)
    assert not res["passed"]
    fd = res["first_divergence"]
    assert set(fd) == {"row", "position", "step", "test_token", "ref_token"} and fd["test_token"] != fd["ref_token"]
    tf = model_checks.teacher_forced(bad, ref, [[7, 8, 9, 10]], None, 8)
    assert not tf["passed"]


def test_known_failure_and_unexpected_pass(monkeypatch, faulty):
    from dinfer_rt.validation import conformance

    real = conformance.load_json

    def patched(name):
        data = real(name)
        if name == "known_failures.json":
            data["backends"] = {"faulty_rope": {"rope/full/float32": "planted", "silu/odd/float32": "stale entry"}}
        return data

    monkeypatch.setattr(conformance, "load_json", patched)
    results = {
        f"{r['op']}/{r['bucket']}": r for r in run_conformance(plugins.select_backend("faulty_rope"), [torch.float32])
    }
    assert results["rope/full"]["status"] == "xfail" and "known failure: planted" in results["rope/full"]["detail"]
    assert results["silu/odd"]["status"] == "unexpected-pass"
    assert results["rope/partial-long"]["status"] == "fail"


def test_tolerance_files_are_valid_json():
    from dinfer_rt.validation.conformance import HERE

    for name in ("tolerances.json", "known_failures.json"):
        data = json.loads((HERE / name).read_text())
        assert data["schema"] == 1


def test_pytest_plugin_form_runs_the_op_suite(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "dinfer_rt.validation",
            "--dinfer-backend=cpu",
            "--dinfer-dtypes=float32",
            "-k",
            "op_conformance",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:]
    from dinfer_rt.validation.opdb import cases

    assert f"{len(cases())} passed" in r.stdout


@pytest.fixture
def raising(monkeypatch):
    real = plugins.entry_points
    fakes = [EntryPoint(n, f"tests.fake_plugins.{n}", "g") for n in ("raising_kernels", "bad_tables")]
    monkeypatch.setattr(plugins, "entry_points", lambda group: list(real(group=group)) + fakes)
    plugins.registry.cache_clear()


def test_a_wrong_output_shape_or_dtype_is_a_named_conformance_failure(raising):
    from dinfer_rt.ir import ops
    from dinfer_rt.validation import conformance
    from dinfer_rt.validation.opdb import cases

    results = run_conformance(plugins.select_backend("shapechip"), [torch.float32], quick=True)
    add = [r for r in results if r["op"] == "add"]
    assert add and all(r["status"] == "fail" and r["max_rel"] == float("inf") for r in add)
    assert any("output 0 shape (" in r["detail"] and ") != reference (" in r["detail"] for r in add), add
    case = next(c for c in cases(quick=True) if c.op == "rms_norm")
    ins = case.build(torch.Generator().manual_seed(0))
    want = ops.rms_norm(*ins, **case.attrs)
    got = want.to(torch.float16)  # right shape, wrong dtype for float32 inputs
    prepared = [x.float() for x in ins]
    rel, _, note = conformance.compare(got, want, {"rel": 1e-3}, conformance.expected_dtypes(case, prepared))
    assert rel == float("inf") and note == "output 0 dtype torch.float16 != torch.float32 (the op's inferred type)"
    rel, _, note = conformance.compare((want, want), want, {"rel": 1e-3})
    assert rel == float("inf") and note == "2 output(s) != reference 1"


@pytest.mark.parametrize(
    ("backend", "raised"),
    [("raisechip", "RuntimeError: planted rms_norm fault"), ("shapechip", "RuntimeError: The size of tensor")],
)
def test_validate_records_a_raising_kernel_in_every_check_and_writes_its_report(raising, backend, raised, tmp_path):
    """A kernel that raises (or returns a wrong shape the next op trips on) fails each op and model
    check with the exception named; the verdict, the JSON and the Markdown report are all written."""
    from dinfer_rt.cli import main

    out, md = tmp_path / "report.json", tmp_path / "report.md"
    args = ["validate", "--backends", backend, "--quick", "--dtypes", "float32", "--json", str(out)]
    assert main([*args, "--markdown", str(md)]) == 1
    report = json.loads(out.read_text())
    assert report["verdict"] == "fail"
    failures = report["results"][0]["failures"]
    op = "rms_norm" if backend == "raisechip" else "add"
    assert any(f.startswith(f"op {op}/") for f in failures), failures
    for check in ("teacher_forced", "decisions", "free_running", "accuracy"):
        assert any(f.startswith(f"embedded: {check} raised {raised}") for f in failures), (check, failures)
    assert any(f.startswith("llada2: teacher_forced raised") for f in failures)
    assert any(f.startswith("fused vs unfused (llada2: ") for f in failures)
    assert any(f.startswith(f"performance: raised {raised}") for f in failures)
    text = md.read_text()
    assert "# dinfer-rt validation: **FAIL**" in text and f"- teacher_forced: FAIL, raised {raised}" in text


def test_validate_fails_a_backend_whose_plugin_contribution_was_dropped(raising, monkeypatch):
    """A kernels hook whose table was refused at selection: validating the fallbacks instead of the
    porter's kernels must not read as a pass (the checks themselves are stubbed out here)."""
    from dinfer_rt.validation import runner

    def no_embedded_checks(test, ref, quick, emulated, models, out):
        out["precision"] = {"rows": []}

    monkeypatch.setattr(runner, "run_conformance", lambda *a, **k: [])
    monkeypatch.setattr(runner, "tiny_checkpoints", lambda root, quick: {})
    monkeypatch.setattr(runner, "_embedded_checks", no_embedded_checks)
    monkeypatch.setattr(runner, "measure", lambda *a, **k: {"step_ms_p50": 1.0})
    with pytest.warns(RuntimeWarning, match="int 42"):
        report = runner.validate("hook_nonfn", quick=True, dtypes="float32")
    assert report["verdict"] == "fail"
    assert report["results"][0]["failures"] == [
        "plugin bad_tables failed in dinfer_rt_register_kernels: returned a kernel table that maps IR op "
        "'rms_norm' to int 42, which is not callable"
    ]
    assert any("int 42" in f for f in report["header"]["plugin_failures"])


def test_validate_fails_a_misspelt_op_once_instead_of_passing_on_the_fallback(raising):
    from dinfer_rt.validation.runner import validate

    report = validate("typochip", quick=True, dtypes="float32")
    assert report["verdict"] == "fail"  # it passed: rms_norm quietly ran the reference
    (failure,) = report["results"][0]["failures"]
    assert failure.startswith("kernel table: BackendError: backend 'typochip'")
    assert "unknown IR op 'rms_nrom' (closest IR ops: rms_norm" in failure
    from dinfer_rt.validation.markdown import render

    assert "Kernel table: BackendError" in render(report)


def test_a_linear_kernel_that_needs_a_bias_argument_fails_conformance():
    """The lowered graphs call linear with two inputs; every case passed a bias (or None), so a
    ``linear(x, weight, bias)`` kernel passed conformance and broke every model."""
    from dinfer_rt.backends.cpu.backend import CpuBackend
    from dinfer_rt.validation.conformance import run_case
    from dinfer_rt.validation.opdb import cases

    class NeedsBias(CpuBackend):
        def kernel_table(self):
            table = dict(super().kernel_table())
            table["linear"] = (lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias), "plugin:t")
            return table

    quick = [c for c in cases(quick=True) if c.op == "linear"]
    results = {c.bucket: run_case(c, NeedsBias(), torch.float32, {}, {}) for c in quick}
    assert results["bias-odd"].status == "pass"
    assert results["two-inputs"].status == "error" and "missing 1 required positional argument: 'bias'" in (
        results["two-inputs"].detail
    )


def test_the_report_names_claimed_dtypes_no_check_ran():
    """A backend claiming float16 passed validate's default float32,bfloat16 run with no word
    that its float16 claim went unchecked (generate --dtype float16 then crashed)."""
    from dinfer_rt.validation.markdown import dtype_line
    from dinfer_rt.validation.runner import dtype_coverage

    cov = dtype_coverage(plugins.select_backend("reference"), [torch.float32, torch.bfloat16])
    assert cov == {"checked": ["float32"], "not_claimed": ["bfloat16"], "claimed_unchecked": ["float64"]}
    assert dtype_line(cov) == (
        "dtypes checked: float32; requested, not claimed by the backend (skipped): bfloat16; "
        "claimed, not checked (add them to --dtypes): float64"
    )
    cpu = dtype_coverage(plugins.select_backend("cpu"), [torch.float32])
    assert cpu["claimed_unchecked"] == ["bfloat16", "float16", "float64"] and not cpu["not_claimed"]


def test_a_backend_that_compiles_whole_graphs_is_told_what_op_conformance_covered():
    """Its op rows ran kernel_table() (for the ONNX Runtime plugin: the reference, 44 passes),
    not the graphs compile() builds: the report says so instead of implying they were checked."""
    from dinfer_rt.backends.cpu.backend import CpuBackend
    from dinfer_rt.validation.runner import compile_notes

    class WholeGraph(CpuBackend):
        name = "wholegraph"

        def compile(self, graph, weights):
            return super().compile(graph, weights)

    assert compile_notes(CpuBackend()) == []
    (note,) = compile_notes(WholeGraph())
    assert note.startswith("wholegraph overrides compile(): op conformance and coverage checked its kernel_table()")
