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
    assert os.environ["DINFER_BACKEND"] == "cpu:reference"
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
    assert set(reg.backends) == {"cpu"} and not reg.failures


def test_flavour_and_arch_are_parsed(monkeypatch):
    monkeypatch.setenv("DINFER_BACKEND", "cpu:reference:x86")
    b = plugins.select_backend()
    assert (b.name, b.flavour, b.arch) == ("cpu", "reference", "x86")
