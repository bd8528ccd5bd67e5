"""The plugin interface as pluggy documents it (argument subsets, tryfirst, wrappers), hook API
versions, fault isolation in every hook, selection on one configured instance, and the layout
rules: no import cycle inside dinfer_rt/, no core module importing a particular backend."""

from __future__ import annotations

import ast
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import dinfer_rt
from dinfer_rt import plugins
from dinfer_rt.errors import BackendError

ROOT = Path(__file__).resolve().parents[1]


def _with(monkeypatch, *modules: str) -> None:
    real = plugins.entry_points

    def found(group):
        fakes = [EntryPoint(m.rsplit(".", 1)[1], m, group) for m in modules]
        return list(real(group=group)) + fakes

    monkeypatch.setattr(plugins, "entry_points", found)
    plugins.registry.cache_clear()


def test_tryfirst_has_the_last_word_and_argument_subsets_work(monkeypatch):
    _with(monkeypatch, "tests.fake_plugins.good", "tests.fake_plugins.early", "tests.fake_plugins.late")
    chip = plugins.select_backend("partialchip:default:v3")
    # early (tryfirst, registered before late) wins num_warps; late's other keys still apply
    assert chip.launch_config("rms_norm") == {"num_warps": 1, "num_stages": 3}
    # good.py's kernel hook takes only backend_name (the spec also passes arch): still called
    assert "rms_norm" in dict(chip.contributions.kernels[0][1]) and chip.contributions.kernels[0][0] == "good"


def test_new_style_wrappers_see_and_change_the_results(monkeypatch):
    _with(monkeypatch, "tests.fake_plugins.good", "tests.fake_plugins.early")
    info = plugins.env_info()
    assert info["wrapped by"] == "early" and info["fakechip driver"] == "1.2.3"


def test_a_plugin_for_another_hook_api_is_refused_naming_both_versions(monkeypatch):
    _with(monkeypatch, "tests.fake_plugins.old_api", "tests.fake_plugins.no_api")
    reasons = {f.name: f.reason for f in plugins.registry().failures}
    assert "was built for dinfer-rt hook API 1; this dinfer-rt speaks hook API 2" in reasons["old_api"]
    assert "declares no DINFER_RT_HOOK_API" in reasons["no_api"]
    with pytest.raises(BackendError, match="unknown backend 'oldchip'"):
        plugins.select_backend("oldchip")


def test_faults_in_every_contribution_hook_are_isolated_and_reported(monkeypatch, capsys):
    from dinfer_rt.cli import main

    _with(monkeypatch, "tests.fake_plugins.faulty_hooks")
    with pytest.warns(RuntimeWarning, match="faulty_hooks.*kernel table broken.*dropped"):
        model = dinfer_rt.load_model(backend="cpu")
    assert model.forward(__import__("torch").zeros(1, 4, dtype=__import__("torch").long)).shape[-1] == 33
    hooks = {f.hook for f in plugins.registry().failures if f.name == "faulty_hooks"}
    assert hooks == {"dinfer_rt_register_kernels", "dinfer_rt_register_passes", "dinfer_rt_launch_config"}
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "plugin faulty_hooks: failed in dinfer_rt_env_info (RuntimeError: env info broken)" in out
    assert "plugin faulty_hooks: failed in dinfer_rt_register_kernels (RuntimeError: kernel table broken)" in out
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "plugin failed in dinfer_rt_launch_config: RuntimeError: launch table broken" in out
    assert any(line.startswith("cpu ") and " yes " in line for line in out.splitlines())


def test_wrongly_typed_hook_results_are_the_plugins_fault(monkeypatch):
    _with(monkeypatch, "tests.fake_plugins.bad_results")
    with pytest.warns(RuntimeWarning, match="bad_results.*returned list"):
        backend = plugins.select_backend("cpu")
    assert backend.contributions.kernels == () and backend.contributions.launch == {}
    reasons = {f.hook: f.reason for f in plugins.registry().failures if f.name == "bad_results"}
    assert set(reasons) == {"dinfer_rt_register_backends", "dinfer_rt_register_kernels", "dinfer_rt_launch_config"}
    assert "returned int 5, expected a dict" in reasons["dinfer_rt_launch_config"]


def test_selection_probes_the_configured_instance(monkeypatch):
    """The flavour named in the choice is the one whose availability is checked."""
    _with(monkeypatch, "tests.fake_plugins.good")
    assert plugins.select_backend("flavouredchip:real").flavour == "real"
    with pytest.raises(BackendError, match="'flavouredchip:fake' .* unavailable: flavour fake has no driver"):
        plugins.select_backend("flavouredchip:fake")


@pytest.mark.parametrize("choice", ["cpu:::", "cpu:", ":reference", "cpu::", "cpu:a:b:c"])
def test_malformed_backend_choices_are_refused(choice):
    with pytest.raises(BackendError, match=r"is not name\[:flavour\[:arch\]\]"):
        plugins.select_backend(choice)


def test_cpu_has_one_flavour():
    with pytest.raises(BackendError, match="backend cpu has no flavour 'fast'"):
        plugins.select_backend("cpu:fast")


def test_plugins_allowlist_naming_a_missing_plugin_is_an_error(monkeypatch):
    monkeypatch.setenv("DINFER_PLUGINS", "cpu,nosuchplugin")
    plugins.registry.cache_clear()
    with pytest.raises(BackendError, match="DINFER_PLUGINS names plugin\\(s\\) not installed: nosuchplugin"):
        plugins.registry()


def test_compile_targets_come_from_the_backends():
    targets = plugins.compile_targets()
    assert {"cuda:sm_80", "cuda:sm_90", "rocm_dcu:gfx942", "rocm_dcu:gfx936"} <= set(targets)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """dinfer_rt modules ``path`` imports, at any level (lazy imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_core_has_no_import_cycle_and_names_no_backend():
    files = {}
    for f in (ROOT / "dinfer_rt").rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    modules = set(files)
    edges = {}
    for name, f in files.items():
        imported = _imports(f, modules | {"dinfer_rt.backends"})
        named = sorted(m for m in imported if m.startswith("dinfer_rt.backends") or m == "dinfer_rt_onnxruntime")
        assert not named, f"{name} imports a particular backend: {named}"
        # a package's __init__ re-exporting its modules is not a cycle; module-to-module edges are
        edges[name] = {m for m in imported if m in files and m != name and files[m].name != "__init__.py"}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in edges[m]:
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(n) :], n]))
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in edges:
        if m not in state:
            visit(m, [m])
