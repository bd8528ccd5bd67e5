"""The out-of-tree ONNX Runtime plugin, pip-installed from its own folder: same numbers as cpu."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dinfer_rt
from dinfer_rt import plugins
from dinfer_rt.errors import BackendError

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples" / "onnxruntime_backend"


@pytest.fixture(scope="module", autouse=True)
def installed_plugin():
    pytest.importorskip("onnxruntime")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--force-reinstall",
            "--no-build-isolation",
            str(PLUGIN),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    plugins.registry.cache_clear()


def test_plugin_touches_no_core_file():
    core = [p for d in ("dinfer_rt", "ir", "backends") for p in (ROOT / d).rglob("*.py")]
    assert core and not [p for p in core if "onnx" in p.read_text().lower()]


def test_listed_and_selected_by_env_var(monkeypatch):
    reg = plugins.registry()
    assert reg.plugin_of["onnxruntime"] == "onnxruntime"
    monkeypatch.setenv("DINFER_BACKEND", "onnxruntime")
    assert plugins.select_backend().name == "onnxruntime"
    assert plugins.select_backend(None).name == "onnxruntime"


@pytest.mark.parametrize("name", ["llada", "dream_sharded_tied", "llada_moe", "llada2"])
def test_logits_and_cached_forward_match_cpu(ckpt_dir, name):
    path = ckpt_dir(name)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    want = dinfer_rt.load_model(path, backend="cpu").forward(ids, block_size=4)
    model = dinfer_rt.load_model(path, backend="onnxruntime")
    got = model.forward(ids, block_size=4)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    cache = model.new_cache(2, 12)
    model.forward(ids, cache=cache, block_size=4)
    part = model.forward(ids, cache=cache, compute=torch.arange(4, 8), block_size=4)
    torch.testing.assert_close(part, want[:, 4:8], rtol=1e-5, atol=1e-5)


def test_embedded_model_greedy_output_equals_cpu(monkeypatch):
    from dinfer_rt.demo import task

    prompts = [it.letters for it in task.heldout(8)]
    params = dinfer_rt.SamplingParams(strategy="threshold", threshold=0.9, batch_size=8)
    cpu = dinfer_rt.LLM(backend="cpu").generate(prompts, params)
    monkeypatch.setenv("DINFER_BACKEND", "onnxruntime")
    ort = dinfer_rt.LLM().generate(prompts, params)
    assert [o.token_ids for o in ort] == [o.token_ids for o in cpu]
    assert [o.stats.nfe for o in ort] == [o.stats.nfe for o in cpu]


def test_unsupported_dtype_is_refused(ckpt_dir):
    with pytest.raises(BackendError, match="backend onnxruntime does not support dtype torch.bfloat16"):
        dinfer_rt.load_model(ckpt_dir("llada"), backend="onnxruntime", dtype="bfloat16")


def test_a_flavour_the_plugin_cannot_run_is_refused():
    """The flavour named in the choice is the one probed (it used to be a fresh default instance)."""
    with pytest.raises(BackendError, match="unavailable: execution provider NoSuchProvider not in this build"):
        plugins.select_backend("onnxruntime:NoSuchProvider")


@pytest.mark.parametrize("name", ["llada", "llada2"])
def test_per_row_query_windows_match_cpu(ckpt_dir, name):
    """Continuous batching's per-row token_index [B, T]: a (row, slot) ScatterND and a per-row mask."""
    from dinfer_rt.testing import per_row_windows

    path = ckpt_dir(name)
    model = dinfer_rt.load_model(path, backend="onnxruntime")
    assert per_row_windows.per_row_error(model, dinfer_rt.load_model(path, backend="cpu")) <= 1e-5
