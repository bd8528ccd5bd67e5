"""The dinfer-rt command line: exit codes, one-line errors, --debug tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

from dinfer_rt.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dinfer_rt", *args], capture_output=True, text=True, timeout=300)


def test_ir_prints_the_graph(ckpt_dir, capsys):
    assert main(["ir", "--model", str(ckpt_dir("llada2")), "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("graph llada2(")
    assert "router_sigmoid_grouped(" in out and "block_size=4" in out and "rotary_dim=8" in out


def test_bad_model_exits_non_zero_without_traceback(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    r = run("ir", "--model", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: ") and "unsupported model_type 'bert'" in r.stderr
    assert "Traceback" not in r.stderr
    r = run("--debug", "ir", "--model", str(tmp_path))
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_unknown_backend_env_is_a_clean_error(ckpt_dir, monkeypatch, capsys):
    monkeypatch.setenv("DINFER_BACKEND", "nosuch")
    assert main(["generate", "abc", "--model", str(ckpt_dir("llada"))]) == 2
    err = capsys.readouterr().err
    assert "error: unknown backend 'nosuch'" in err and "cpu: available" in err


def test_backends_json(capsys):
    assert main(["backends", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    cpu = next(r for r in rows if r["name"] == "cpu")
    assert cpu["available"] is True and cpu["plugin"] == "cpu"


def test_env_lists_variables(capsys, monkeypatch):
    monkeypatch.setenv("DINFER_PLUGINS", "cpu")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "dinfer-rt 0.1.0" in out and "DINFER_PLUGINS=cpu" in out


def test_generate_json_on_a_tiny_model(ckpt_dir, capsys):
    assert (
        main(
            ["generate", "abc", "--model", str(ckpt_dir("llada")), "--gen-length", "4", "--block-length", "4", "--json"]
        )
        == 0
    )
    row = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert row["nfe"] == 4 and row["tokens"] == 4 and row["tokens_per_forward"] == 1.0


def test_bench_reports_latency_percentiles(ckpt_dir, capsys, monkeypatch):
    monkeypatch.setenv("DINFER_MODEL", str(ckpt_dir("llada")))
    # the tiny test tokenizer has no '=': run the held-out letters prompts raw
    assert main(["bench", "--raw", "--gen-length", "4", "--block-length", "4", "--iters", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["forwards"] == 8 and r["warmup"] == 1 and r["iters"] == 2
    assert 0 < r["step_ms_p50"] <= r["step_ms_p90"] <= r["step_ms_p99"]
    assert r["peak_rss_mb"] > 0 and r["tokens_per_batch_forward"] == 8.0


def test_interrupt_prints_one_line_and_exits_130():
    """A real Ctrl-C (SIGINT) while `dinfer-rt eval` decodes: `interrupted`, exit 130, no traceback."""
    import os
    import signal
    import time

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dinfer_rt", "eval", "--limit", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        seen = ""
        while "generate" not in seen and time.monotonic() < deadline:  # the progress bar: decoding runs
            seen += os.read(proc.stderr.fileno(), 4096).decode(errors="replace")
        assert "generate" in seen, seen
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = [ln for ln in (seen + "\n" + err).replace("\r", "\n").splitlines() if ln.strip() and "generate" not in ln]
    assert proc.returncode == 130 and lines and lines[-1] == "interrupted", (proc.returncode, seen[-500:], err[-500:])
    assert "Traceback" not in seen + err


def test_interrupted_report_leaves_no_half_written_file(tmp_path, monkeypatch, capsys):
    import dinfer_rt.validation.runner as runner

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "validate", interrupted)
    report = tmp_path / "report.json"
    assert main(["validate", "--backends", "cpu", "--json", str(report)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"
    assert not report.exists() and not list(tmp_path.iterdir())


def test_atomic_write_interrupted_mid_rename_leaves_nothing(tmp_path, monkeypatch):
    import os

    import pytest

    from dinfer_rt.files import write_text_atomic

    def boom(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(tmp_path / "out.md", "x" * 10000)
    assert not list(tmp_path.iterdir())


def test_generate_passes_the_engine_flags_to_the_engine(ckpt_dir, capsys, monkeypatch):
    """The engine flags of ``generate`` reach its engine (they were once dropped on one process):
    --graphs on is refused by the cpu backend; the others arrive as given."""
    model = str(ckpt_dir("llada"))
    argv = ["generate", "abc", "--model", model, "--gen-length", "4", "--block-length", "4"]
    assert main([*argv, "--graphs", "on"]) == 2
    assert "graphs=True but backend cpu replays no device graphs" in capsys.readouterr().err
    seen = []
    import dinfer_rt.llm as llm_mod

    real = llm_mod.LLM.__init__

    def spy(self, *args, **kw):
        seen.append(kw)
        real(self, *args, **kw)

    monkeypatch.setattr(llm_mod.LLM, "__init__", spy)
    assert main([*argv, "--sync-every", "2", "--max-forward-tokens", "64", "--no-confidence-head"]) == 0
    assert seen[-1]["sync_every"] == 2 and seen[-1]["max_forward_tokens"] == 64
    assert seen[-1]["confidence_head"] is False
