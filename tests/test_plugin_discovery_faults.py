"""Faults of third-party backends and hooks met at discovery and selection, and bad backend
choices: each is refused (or skipped with a warning) naming the plugin or backend and why, and
never takes the other backends down; echoed values are cut to envs.SHOWN_CHARS characters."""

from __future__ import annotations

import sys
import types
from importlib.metadata import EntryPoint

import pytest

from dinfer_rt import plugins
from dinfer_rt.backend import Availability, Backend
from dinfer_rt.errors import BackendError

LONG = "x" * 5000


def _plugin(monkeypatch, name: str, *backends: type[Backend], api: object = 2, **hooks) -> None:
    """Install a fake plugin module ``name`` (its backends and hooks) besides the real ones."""
    module = types.ModuleType(f"_fake_{name}")
    module.DINFER_RT_HOOK_API = api
    if backends:
        hooks["dinfer_rt_register_backends"] = lambda: list(backends)
    for hook, fn in hooks.items():
        fn.__name__ = hook
        setattr(module, hook, plugins.hookimpl(fn))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    real = plugins.entry_points
    monkeypatch.setattr(
        plugins, "entry_points", lambda group: list(real(group=group)) + [EntryPoint(name, module.__name__, group)]
    )
    plugins.registry.cache_clear()


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in ("DINFER_BACKEND", "DINFER_PLUGINS", "DINFER_DISABLE_PLUGIN_AUTOLOAD", "DINFER_INTERPRET"):
        monkeypatch.delenv(var, raising=False)
    plugins.registry.cache_clear()
    yield
    plugins.registry.cache_clear()


def _failure(plugin: str) -> str:
    return " | ".join(f.reason for f in plugins.registry().failures if f.name == plugin)


# ------------------------------------------------------------------ 1. flavour and arch


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        ("cpu::banana", "backend cpu has no arch 'banana'; known: "),
        ("reference::x", "backend reference takes no arch (got 'x')"),
        ("cuda:foo", "backend cuda has no flavour 'foo'; its flavour is 'nvidia'"),
        ("cuda::sm_bogus", "backend cuda has no arch 'sm_bogus'; known: sm_80, sm_90, interpret"),
        ("ascend:foo", "backend ascend has no flavour 'foo'; its flavour is '910b'"),
        ("ascend::b1", "backend ascend takes no arch (got 'b1')"),
    ],
)
def test_an_unknown_flavour_or_arch_is_refused(choice, message):
    with pytest.raises(BackendError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        plugins.construct_backend(choice, "test")


@pytest.mark.parametrize("choice", ["cpu:native", "reference:torch", "cuda::sm_90", "cuda::sm_86", "ascend:910b"])
def test_documented_choices_still_validate(choice):
    plugins.construct_backend(choice, "test")  # sm_86: an identified arch written back to DINFER_BACKEND


def test_long_flavour_and_name_are_cut(monkeypatch):
    for choice in (f"cpu:{LONG}", LONG, f"rocm_dcu:{LONG}"):
        monkeypatch.setenv("DINFER_BACKEND", choice)
        with pytest.raises(BackendError) as e:
            plugins.select_backend()
        assert "(5000 characters)" in str(e.value) and LONG[:200] not in str(e.value)


# ------------------------------------------------------------------ 2. backends that raise or are malformed


class CtorRaises(Backend):
    name, priority = "ctorraise", 1000

    def __init__(self):
        raise RuntimeError("boom in __init__")


class IdentifyRaises(Backend):
    name, priority = "iraise", 1001

    def identify(self):
        raise RuntimeError("boom in identify")


class ValidateRaises(Backend):
    name = "vraise"

    def validate_choice(self):
        raise KeyError("boom in validate_choice")


class OkNotBool(Backend):
    name, priority = "okstr", 2000

    def is_available(self):
        return Availability("no", "string ok")


@pytest.mark.parametrize(
    ("cls", "what"),
    [
        (CtorRaises, "constructor raised RuntimeError: boom in __init__"),
        (IdentifyRaises, "identify raised RuntimeError"),
    ],
)
def test_a_raising_backend_is_skipped_by_auto_detect_and_named_when_chosen(monkeypatch, cls, what):
    _plugin(monkeypatch, "raiser", cls)
    with pytest.warns(RuntimeWarning, match=f"plugin 'raiser' fault: backend '{cls.name}' {what}.*skips it"):
        assert plugins.select_backend().name == "cpu"
    with pytest.raises(BackendError, match=f"plugin 'raiser' fault: backend '{cls.name}' {what}"):
        plugins.select_backend(cls.name)


def test_validate_choice_raising_is_named(monkeypatch):
    _plugin(monkeypatch, "vr", ValidateRaises)
    with pytest.raises(BackendError, match="plugin 'vr' fault: backend 'vraise' validate_choice raised KeyError"):
        plugins.select_backend("vraise")


def test_an_availability_whose_ok_is_not_a_bool_leaves_it_unavailable(monkeypatch):
    _plugin(monkeypatch, "okstr", OkNotBool)
    assert plugins.select_backend().name == "cpu"
    assert "Availability(ok='no'), ok must be a bool" in plugins.describe_all()


def test_a_bad_priority_or_name_is_refused_at_registration(monkeypatch):
    bad = [
        type(f"B{i}", (Backend,), attrs) for i, attrs in enumerate([{"name": "hi", "priority": "high"}, {"name": 5}])
    ]
    bad += [type(f"N{i}", (Backend,), {"name": n}) for i, n in enumerate(["", "my:back"])] + [type("Q", (Backend,), {})]
    _plugin(monkeypatch, "weird", *bad, type("Fine", (Backend,), {"name": "fine"}))
    reg = plugins.registry()
    assert set(reg.backends) & {"hi", 5, "", "my:back", "?"} == set() and "fine" in reg.backends
    why = _failure("weird")
    assert "has priority 'high', expected a number" in why and "has name 5 (a int" in why
    assert "has name ''" in why and "has name 'my:back'" in why and "'?' (the Platform default" in why
    assert plugins.select_backend().name == "cpu"
    with pytest.raises(BackendError, match="unknown backend '\\?'"):
        plugins.select_backend("?")
    from dinfer_rt.cli import main

    assert main(["backends"]) == 0


class VersionsRaises(Backend):
    name, priority = "vraise", 1002

    def is_available(self) -> Availability:
        return Availability(True, "fine")

    def versions(self):
        raise KeyError("no version")


def test_the_backends_listing_names_a_raising_backend_and_lists_the_others(monkeypatch, capsys):
    """``dinfer-rt backends`` built each backend itself: a raising constructor was a traceback."""
    import json

    from dinfer_rt.cli import main

    _plugin(monkeypatch, "raiser", CtorRaises, VersionsRaises)
    capsys.readouterr()
    assert main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "constructor raised RuntimeError: boom in __init__" in rows["ctorraise"]["reason"]
    assert rows["vraise"]["reason"] == "plugin 'raiser' fault: KeyError: 'no version'"
    assert not rows["ctorraise"]["available"] and not rows["vraise"]["available"]
    assert rows["cpu"]["available"] and rows["reference"]["available"]


# ------------------------------------------------------------------ 3. hook results


class Unprintable:
    def __str__(self):
        raise ValueError("no str")


def test_hook_values_are_checked_where_collected(monkeypatch):
    _plugin(
        monkeypatch,
        "hooks",
        dinfer_rt_env_info=lambda: {"x": Unprintable()},
        dinfer_rt_compile_targets=lambda: {"cpu:x": 5},
    )
    with pytest.warns(RuntimeWarning, match="'hooks' failed in dinfer_rt_env_info: returned a value whose str"):
        assert "x" not in plugins.env_info()
    with pytest.warns(RuntimeWarning, match="'hooks' failed in dinfer_rt_compile_targets: returned int 5 as target"):
        targets = plugins.compile_targets()
    assert "cpu:x" not in targets and all(callable(t) for t in targets.values())


# ------------------------------------------------------------------ 4. hook API spelt as a string


def test_a_string_hook_api_is_said_to_be_not_an_int(monkeypatch):
    _plugin(monkeypatch, "strapi", api="2", dinfer_rt_env_info=lambda: {"a": 1})
    assert "declares DINFER_RT_HOOK_API = '2', which is not an int" in _failure("strapi")


# ------------------------------------------------------------------ 5, 7. unknown names


def test_an_excluded_backend_is_said_to_be_excluded(monkeypatch):
    monkeypatch.setenv("DINFER_PLUGINS", "cpu")
    with pytest.raises(BackendError, match="its plugin 'reference' is installed but excluded by DINFER_PLUGINS='cpu'"):
        plugins.select_backend("reference")


def test_a_miscased_backend_gets_a_suggestion(monkeypatch):
    monkeypatch.setenv("DINFER_BACKEND", "CPU")
    with pytest.raises(
        BackendError, match="unknown backend 'CPU' from DINFER_BACKEND='CPU' \\(did you mean 'cpu'\\?\\)"
    ):
        plugins.select_backend()


def test_a_plugin_pass_under_a_name_already_used_is_skipped_with_a_warning(monkeypatch):
    """porting.md's example pass, copied as is, is named add_rms_norm: it ran after the shipped
    one and overwrote that pass's rewrite count with its own 0."""
    from dinfer_rt.passes import Pass

    mine = Pass("mychip_fuse", "fusion", lambda graph, ctx: 0)

    def dinfer_rt_register_passes(backend_name):
        return [Pass("add_rms_norm", "fusion", lambda g, c: 0), mine, Pass("mychip_fuse", "fusion", lambda g, c: 0)]

    _plugin(monkeypatch, "dup", dinfer_rt_register_passes=dinfer_rt_register_passes)
    with pytest.warns(RuntimeWarning) as caught:
        backend = plugins.select_backend("cpu")
    said = " | ".join(str(w.message) for w in caught)
    assert "returned pass 'add_rms_norm', a name the shared pipeline already uses" in said, said
    assert "returned pass 'mychip_fuse', a name plugin 'dup' already uses" in said, said
    assert backend.contributions.passes == (mine,)
