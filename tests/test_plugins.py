"""Backend discovery and selection through the dinfer_rt.backends entry-point group."""

from __future__ import annotations

import os
from importlib.metadata import EntryPoint

import pytest

from dinfer_rt import plugins
from dinfer_rt.errors import BackendError


def test_cpu_is_found_through_the_public_entry_point_group():
    eps = [ep for ep in plugins.entry_points(group="dinfer_rt.backends") if ep.name == "cpu"]
    assert eps and eps[0].value == "dinfer_rt.backends.cpu.plugin"
    reg = plugins.registry()
    assert reg.plugin_of["cpu"] == "cpu"


@pytest.fixture
def fake_plugins(monkeypatch):
    real = plugins.entry_points

    def with_fakes(group):
        fakes = [
            EntryPoint("fakes", "tests.fake_plugins.good", group),
            EntryPoint("broken", "tests.fake_plugins.broken", group),
        ]
        return list(real(group=group)) + fakes

    monkeypatch.setattr(plugins, "entry_points", with_fakes)
    plugins.registry.cache_clear()


def test_env_var_selects_and_writes_back(monkeypatch):
    monkeypatch.setenv("DINFER_BACKEND", "cpu")
    b = plugins.select_backend()
    assert b.name == "cpu"
    assert os.environ["DINFER_BACKEND"] == "cpu:native"
    assert plugins.select_backend().name == "cpu"  # the written-back value resolves again


def test_auto_detect_takes_highest_priority_available(fake_plugins):
    assert plugins.select_backend().name == "fastfake"
    assert os.environ["DINFER_BACKEND"] == "fastfake:fake"


def test_unknown_backend_lists_every_backend(monkeypatch, fake_plugins):
    monkeypatch.setenv("DINFER_BACKEND", "tpu")
    with pytest.raises(BackendError) as e:
        plugins.select_backend()
    msg = str(e.value)
    assert "unknown backend 'tpu' from DINFER_BACKEND='tpu'" in msg
    assert "cpu: available" in msg and "missingchip: unavailable (libmissing.so not found)" in msg
    assert "plugin broken: not loaded" in msg


def test_unavailable_backend_says_why(monkeypatch, fake_plugins):
    monkeypatch.setenv("DINFER_BACKEND", "missingchip")
    with pytest.raises(
        BackendError,
        match="backend 'missingchip' chosen by DINFER_BACKEND='missingchip' is unavailable: libmissing.so not found",
    ):
        plugins.select_backend()


def test_broken_plugin_is_skipped_unless_chosen(monkeypatch, fake_plugins):
    reg = plugins.registry()
    assert [f.name for f in reg.failures] == ["broken"]
    assert "libbroken.so" in reg.failures[0].reason
    assert plugins.select_backend("cpu").name == "cpu"
    with pytest.raises(BackendError, match="unknown backend 'broken'.*its plugin failed.*libbroken.so"):
        plugins.select_backend("broken")


def test_allowlist_and_autoload_switch(monkeypatch, fake_plugins):
    monkeypatch.setenv("DINFER_PLUGINS", "cpu")
    plugins.registry.cache_clear()
    assert set(plugins.registry().backends) == {"cpu"}
    monkeypatch.delenv("DINFER_PLUGINS")
    monkeypatch.setenv("DINFER_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugins.registry.cache_clear()
    reg = plugins.registry()
    assert set(reg.backends) == {"cpu", "reference", "cuda", "rocm_dcu", "ascend"} and not reg.failures


def test_flavour_and_arch_are_parsed(monkeypatch):
    from dinfer_rt.backends.cpu.backend import host_archs

    arch = host_archs()[-1]  # this host's: another arch is refused (nothing else runs here)
    monkeypatch.setenv("DINFER_BACKEND", f"cpu:native:{arch}")
    b = plugins.select_backend()
    assert (b.name, b.flavour, b.arch) == ("cpu", "native", arch)


def test_every_in_tree_backend_is_listed_with_its_reason():
    reg = plugins.registry()
    assert {"cpu", "reference", "cuda", "rocm_dcu", "ascend"} <= set(reg.backends)
    reasons = {n: plugins.availability(c) for n, c in reg.backends.items()}
    assert reasons["cpu"].ok
    import torch

    if torch.version.cuda is None:
        assert not reasons["cuda"].ok and "CPU-only build" in reasons["cuda"].reason
    if torch.version.hip is None:
        assert not reasons["rocm_dcu"].ok and "not a HIP/DTK build" in reasons["rocm_dcu"].reason


def test_ascend_probe_names_missing_cann_without_importing_torch_npu(monkeypatch):
    import importlib.util
    import sys

    from dinfer_rt.backends.ascend import plugin as ascend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "torch_npu" else real(n, *a))
    monkeypatch.setattr(ascend, "find_cann_library", lambda name="hccl": None)
    a = ascend.AscendBackend().is_available()
    assert not a.ok and "cannot import without CANN: libhccl.so not found" in a.reason
    assert "torch_npu" not in sys.modules


def test_fallback_and_plugin_kernels_are_used_counted_and_shown(fake_plugins, ckpt_dir, capsys):
    import torch

    import dinfer_rt
    from dinfer_rt.cli import main
    from tests.fake_plugins import good

    path = ckpt_dir("llada")
    ids = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(0))
    want = dinfer_rt.load_model(path, backend="cpu").forward(ids)
    model = dinfer_rt.load_model(path, backend="partialchip")
    before = dict(good.CALLS)
    torch.testing.assert_close(model.forward(ids), want)
    assert good.CALLS["silu"] > before["silu"] and good.CALLS["rms_norm"] > before["rms_norm"]
    assert model.pass_counts["count_attention"] == 2  # the plugin's own pass ran in partialchip's pipeline
    assert "add_rms_norm" not in model.pass_counts  # no native kernel for the fused op: rule dropped
    exe = model.executable(cached=False)
    assert "silu" not in exe.fallbacks and "rms_norm" not in exe.fallbacks and exe.fallbacks["linear"] > 0
    assert main(["ir", "--model", str(path), "--backend", "partialchip"]) == 0
    out = capsys.readouterr().out
    assert "= silu(%" in out and "# native" in out and "# plugin:fakes" in out and "# fallback:reference" in out
    assert "# backend partialchip:" in out and "fallback node(s): add x4" in out


def test_env_info_hook_reaches_dinfer_rt_env(fake_plugins, capsys):
    from dinfer_rt.cli import main

    assert main(["env"]) == 0
    assert "fakechip driver: 1.2.3" in capsys.readouterr().out


def test_trace_plugins_prints_hook_calls(fake_plugins, monkeypatch, capsys):
    monkeypatch.setenv("DINFER_TRACE_PLUGINS", "1")
    plugins.registry.cache_clear()
    plugins.registry()
    assert "[dinfer_rt plugins] fakes.dinfer_rt_register_backends({})" in capsys.readouterr().err


def test_launch_config_hook_overrides_the_backends_table(fake_plugins, monkeypatch):
    """Gathered once at selection, for the selected arch, and applied over the backend's table."""
    from tests.fake_plugins.good import PartialChip

    monkeypatch.setattr(
        PartialChip,
        "default_launch_config",
        lambda self, kernel: {"block_size": 128, "num_stages": 2} if kernel == "rms_norm" else {},
        raising=False,
    )
    chip = plugins.select_backend("partialchip")
    assert chip.launch_config("rms_norm") == {"block_size": 128, "num_stages": 2}
    chip = plugins.select_backend("partialchip:default:v2")
    assert chip.launch_config("rms_norm") == {"block_size": 256, "num_stages": 2, "num_warps": 8}
    assert chip.launch_config("silu") == {}


def test_ascend_with_the_real_torch_npu_wheel_and_no_cann(tmp_path):
    """The real torch_npu wheel (matching torch) installed beside the environment, without CANN:
    `import torch_npu` fails on libhccl.so, torch does not auto-import it through dinfer-rt, and
    `dinfer-rt backends` names exactly that reason instead of crashing."""
    import os
    import subprocess
    import sys

    import torch

    version = torch.__version__.split("+")[0]
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path), f"torch-npu=={version}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        pytest.skip(f"torch-npu=={version} could not be installed here: {r.stderr[-300:]}")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    bare = subprocess.run(
        [sys.executable, "-c", "import torch_npu"], capture_output=True, text=True, env=env, timeout=300
    )
    assert bare.returncode != 0 and "libhccl.so" in bare.stderr
    listed = subprocess.run(
        [sys.executable, "-m", "dinfer_rt", "backends"], capture_output=True, text=True, env=env, timeout=300
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    ascend = next(line for line in listed.stdout.splitlines() if line.startswith("ascend"))
    assert "torch_npu is installed but cannot import without CANN: libhccl.so not found" in ascend
