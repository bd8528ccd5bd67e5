"""The rocm_dcu backend without a device: flavour/arch detection on simulated environments
(device names, gcnArchName strings, hy-smi / rocm-smi present or absent), choice validation,
capability records, the unavailable reason here, and the embedded model under the interpreter
with this backend's wave64 tuning. Kernel numerics under its tuning rows are in
test_cuda_interpret.py (same source, parametrized over both backends' rows)."""

from __future__ import annotations

import pytest
import torch

import dinfer_rt
from dinfer_rt import plugins
from dinfer_rt.backends.rocm_dcu import detect, tuning

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter padding lanes


def tools(*present):
    return lambda name: f"/opt/dtk/bin/{name}" if name in present else None


@pytest.mark.parametrize(
    "name, gcn, present, flavour, arch",
    [
        ("BW1000", "gfx936:sramecc+:xnack-", ("hy-smi",), "hygon", "gfx936"),
        ("K500SM_AI", "gfx928:sramecc+:xnack-", ("hy-smi", "rocm-smi"), "hygon", "gfx928"),
        ("Z100L", "gfx906:sramecc-:xnack-", (), "hygon", "gfx906"),  # the name alone says Hygon
        ("Device 66a1", "gfx906", ("hy-smi",), "hygon", "gfx906"),  # the tool decides a gfx906
        ("Device 66a1", "gfx906", ("rocm-smi",), "amd", "gfx906"),
        ("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", ("rocm-smi",), "amd", "gfx942"),
        ("AMD Instinct MI250X", "gfx90a:sramecc+:xnack-", (), "amd", "gfx90a"),
        ("", "gfx942", (), "amd", "gfx942"),  # only the arch: its own vendor
        ("Hygon DCU", "gfx938", ("hy-smi",), "hygon", "gfx936"),  # unknown arch: the flavour's default row
    ],
)
def test_identify_flavour_and_tuning_row(name, gcn, present, flavour, arch):
    ident = detect.identify(name, gcn, tools(*present))
    assert (ident.flavour, ident.arch) == (flavour, arch), ident
    assert ident.arch in tuning.TUNING and ident.how


def test_identify_on_a_simulated_hip_device(monkeypatch):
    """A HIP build of torch reporting a Hygon device: the backend reads the properties only
    after selection and picks the gfx928 record (bf16 offered, wave64)."""
    monkeypatch.delenv("DINFER_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", "6.3.0-dtk2504")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)

    class Props:
        name = "K500SM_AI"
        gcnArchName = "gfx928:sramecc+:xnack-"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr("shutil.which", tools("hy-smi"))
    plugins.registry.cache_clear()
    backend = plugins.select_backend("rocm_dcu")
    caps = backend.capabilities()
    assert (backend.flavour, backend.arch) == ("hygon", "gfx928")
    assert caps.warp_size == 64 and torch.bfloat16 in caps.dtypes and caps.extra["confirmed"] is False
    assert backend.describe() == "rocm_dcu:hygon:gfx928"
    assert backend.default_launch_config("attention") == {}  # attention tiles come from the row
    assert backend.tuning() == tuning.TUNING["gfx928"]


def test_gfx906_offers_fp16_not_bf16(monkeypatch):
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    caps = plugins.select_backend("rocm_dcu:hygon:gfx906").capabilities()
    assert torch.bfloat16 not in caps.dtypes and torch.float16 in caps.dtypes
    assert caps.extra["matrix_dtypes"] == ()


@pytest.mark.parametrize(
    "choice, message",
    [
        ("rocm_dcu:nvidia", "rocm_dcu flavour 'nvidia' is not one of hygon, amd"),
        ("rocm_dcu:amd:gfx1100", "rocm_dcu arch 'gfx1100' has no tuning row; known: gfx906, gfx928"),
        ("rocm_dcu:hygon:gfx942", "rocm_dcu arch gfx942 is a amd arch, not hygon"),
    ],
)
def test_bad_choice_is_a_clean_error(monkeypatch, choice, message):
    monkeypatch.setenv("DINFER_BACKEND", choice)
    plugins.registry.cache_clear()
    with pytest.raises(dinfer_rt.DinferError) as e:
        plugins.select_backend()
    assert message in str(e.value) and f"DINFER_BACKEND={choice!r}" in str(e.value)


def test_listed_unavailable_here_with_its_reason(monkeypatch, capsys):
    monkeypatch.delenv("DINFER_INTERPRET", raising=False)
    plugins.registry.cache_clear()
    from dinfer_rt.cli import main

    assert main(["backends"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split() and ln.split()[0] == "rocm_dcu")
    assert line.split()[2] == "no" and "is not a HIP/DTK build (torch.version.hip is None)" in line  # available: no


@pytest.mark.parametrize("choice", ["rocm_dcu:amd:gfx942", "rocm_dcu:hygon:gfx936"])
def test_embedded_model_same_greedy_output_as_cpu(monkeypatch, choice):
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    from dinfer_rt.demo import task

    prompts = [it.letters for it in task.heldout(2)]
    params = dinfer_rt.SamplingParams(strategy="threshold", threshold=0.9, batch_size=2)
    want = [o.token_ids for o in dinfer_rt.LLM(backend="cpu").generate(prompts, params)]
    llm = dinfer_rt.LLM(backend=choice)
    assert llm.model.executable(False).fallbacks.get("attention", 0) == 0  # the flash kernel ran
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_dtk_only_targets_say_so():
    from dinfer_rt.backends.rocm_dcu.aot import compile_hip

    with pytest.raises(dinfer_rt.DinferError, match="rocm_dcu:gfx936 .* not an upstream Triton target: .*DTK build"):
        compile_hip("gfx936")
