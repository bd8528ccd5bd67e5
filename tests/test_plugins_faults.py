"""Plugin faults a porter makes, each refused once where it is collected with a message naming the
plugin (or backend), the hook (or method) and why: a probe returning a bare bool, a kernel table
that is not ``{ir_op: callable}`` or names an op the IR does not have, launch parameters that are
not a dict, a backend name already taken, a misspelt hook name, and validate's oracle left out by
``DINFER_PLUGINS``."""

from __future__ import annotations

import json
from importlib.metadata import EntryPoint

import pytest
import torch

import dinfer_rt
from dinfer_rt import plugins
from dinfer_rt.errors import BackendError


def _with(monkeypatch, *modules: str, first: bool = False) -> None:
    """The installed entry points plus fake plugins (``first``: listed before the real ones)."""
    real = plugins.entry_points

    def found(group):
        fakes = [EntryPoint(m.rsplit(".", 1)[1], m, group) for m in modules]
        return fakes + list(real(group=group)) if first else list(real(group=group)) + fakes

    monkeypatch.setattr(plugins, "entry_points", found)
    plugins.registry.cache_clear()


def _failures(plugin: str) -> dict[str | None, str]:
    return {f.hook: f.reason for f in plugins.registry().failures if f.name == plugin}


# ---------------------------------------------------------------- 1. is_available's return type


def test_a_probe_returning_a_bare_bool_is_the_plugins_fault_everywhere(monkeypatch, capsys):
    from dinfer_rt.cli import main

    _with(monkeypatch, "tests.fake_plugins.bool_probe")
    a = plugins.availability(plugins.registry().backends["boolchip"])
    assert not a.ok and "is_available returned bool, expected Availability" in a.reason
    assert "plugin 'bool_probe'" in a.reason
    assert main(["backends"]) == 0  # crashed on `True.ok` before
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("boolchip"))
    assert " no " in row and "is_available returned bool, expected Availability" in row
    assert main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["boolchip"]["available"] is False
    with pytest.raises(BackendError, match="'boolchip' .* unavailable: .*is_available returned bool"):
        plugins.select_backend("boolchip")  # generate used to accept it
    assert "boolchip: unavailable" in plugins.describe_all()


# ---------------------------------------------------------------- 2. kernel and launch tables


@pytest.mark.parametrize(
    ("backend", "why"),
    [
        ("listchip", r"kernels\(\) returned list, expected a dict \{ir_op: kernel\}"),
        ("intchip", r"kernels\(\) maps IR op 'rms_norm' to int 42, which is not callable"),
    ],
)
def test_a_malformed_backend_kernel_table_is_a_named_error(monkeypatch, backend, why):
    _with(monkeypatch, "tests.fake_plugins.bad_tables")
    chip = plugins.select_backend(backend)
    with pytest.raises(BackendError, match=rf"backend '{backend}' \(tests.fake_plugins.bad_tables.\w+\): {why}"):
        chip.kernel_table()
    with pytest.raises(BackendError, match=why):  # at load, not as a TypeError at the first forward
        dinfer_rt.load_model(backend=backend)


def test_a_non_callable_kernel_from_the_hook_is_dropped_naming_the_hook(monkeypatch):
    _with(monkeypatch, "tests.fake_plugins.bad_tables")
    with pytest.warns(RuntimeWarning, match="bad_tables.*dinfer_rt_register_kernels.*'rms_norm' to int 42"):
        chip = plugins.select_backend("hook_nonfn")
    assert chip.contributions.kernels == ()
    assert (
        "maps IR op 'rms_norm' to int 42, which is not callable"
        in _failures("bad_tables")["dinfer_rt_register_kernels"]
    )
    again = plugins.select_backend("hook_nonfn")  # warned once, but every selection carries its faults
    assert [f.hook for f in again.contributions.faults] == ["dinfer_rt_register_kernels"]
    model = dinfer_rt.load_model(backend="hook_nonfn")  # runs on the fallback, no TypeError
    assert model.forward(torch.zeros(1, 4, dtype=torch.long)).shape[-1] == 33


def test_launch_parameters_that_are_not_a_dict_are_dropped_naming_the_hook(monkeypatch, capsys):
    _with(monkeypatch, "tests.fake_plugins.bad_tables")
    with pytest.warns(RuntimeWarning, match="dinfer_rt_launch_config: returned int 5 as the launch parameters"):
        chip = plugins.select_backend("hook_launch")  # was a TypeError in dict(params)
    assert chip.launch_config("rms_norm") == {}
    assert "kernel 'rms_norm', expected a dict {param: value}" in _failures("bad_tables")["dinfer_rt_launch_config"]


def test_a_pass_list_holding_no_pass_is_dropped_naming_the_hook(monkeypatch):
    _with(monkeypatch, "tests.fake_plugins.bad_tables")
    with pytest.warns(RuntimeWarning, match="dinfer_rt_register_passes: returned str 'not a pass'"):
        chip = plugins.select_backend("hook_passes")
    assert chip.contributions.passes == ()


def test_the_executor_refuses_a_non_callable_kernel_when_it_compiles():
    """The last line of defence (a backend overriding kernel_table or compile): once per graph."""
    from dinfer_rt.executor import Executable

    model = dinfer_rt.load_model(backend="cpu")
    graph = model.executable(cached=False).graph
    table = {op: k for op, (k, _) in plugins.select_backend("cpu").kernel_table().items()}
    table[graph.nodes[0].op] = 42
    with pytest.raises(BackendError, match=f"kernel for IR op '{graph.nodes[0].op}' .* int 42, which is not callable"):
        Executable(graph, table, model.weights, backend="cpu")


@pytest.mark.parametrize("mode", ["generated", "interpreted"])
def test_a_kernel_that_raises_is_named_by_its_op_and_node(mode):
    """The generated program has no source file: a porter's kernel with a wrong signature was a
    bare TypeError traceback ending in ``<dinfer-rt cpu llada>, line 3``, naming no op."""
    from dinfer_rt.executor import Executable

    model = dinfer_rt.load_model(backend="cpu")
    graph = model.executable(cached=False).graph
    table = {op: k for op, (k, _) in plugins.select_backend("cpu").kernel_table().items()}
    at = next(i for i, n in enumerate(graph.nodes) if n.op == "rms_norm")

    def rms_norm_typo(x, weight, epsilon=1e-6):  # the IR passes eps=
        return x

    table["rms_norm"] = rms_norm_typo
    exe = Executable(graph, table, model.weights, backend="cpu", sources={"rms_norm": "plugin:mychip"}, mode=mode)
    t = 5
    inputs = {
        "input_ids": torch.zeros(1, t, dtype=torch.long), "positions": torch.arange(t)[None],
        "token_index": torch.arange(t), "key_valid": torch.ones(1, t, dtype=torch.bool),
    }  # fmt: skip
    with pytest.raises(BackendError) as e:
        exe(inputs)
    message = str(e.value)
    assert message.startswith(
        "cpu: the kernel for IR op 'rms_norm' (plugin:mychip: "
        "test_a_kernel_that_raises_is_named_by_its_op_and_node.<locals>.rms_norm_typo) raised TypeError: "
    ), message
    assert "unexpected keyword argument 'eps'" in message and f"node {at} of {len(graph.nodes)}" in message
    assert isinstance(e.value.__cause__, TypeError)

    def rms_norm_lost(x, weight, eps):  # torch's RuntimeErrors (OOM, a lost peer) keep their type, noted
        raise RuntimeError("Connection closed by peer")

    table["rms_norm"] = rms_norm_lost
    exe = Executable(graph, table, model.weights, backend="cpu", sources={"rms_norm": "plugin:mychip"}, mode=mode)
    with pytest.raises(RuntimeError, match="Connection closed by peer") as e:
        exe(inputs)
    assert e.value.__notes__ == [
        f"cpu: the kernel for IR op 'rms_norm' (plugin:mychip: {rms_norm_lost.__qualname__}) raised RuntimeError: "
        f"Connection closed by peer (graph {graph.name}, node {at} of {len(graph.nodes)}, 2 inputs, "
        f"attrs {dict(graph.nodes[at].attrs)})"
    ]


# ---------------------------------------------------------------- 3. op names the IR does not have


def test_a_misspelt_op_in_kernels_is_an_error_naming_the_closest_ops(monkeypatch):
    _with(monkeypatch, "tests.fake_plugins.bad_tables")
    chip = plugins.select_backend("typochip")
    with pytest.raises(BackendError, match=r"kernels\(\) names unknown IR op 'rms_nrom' \(closest IR ops: rms_norm"):
        chip.kernel_table()
    from dinfer_rt.validation.conformance import run_conformance

    results = run_conformance(chip, [torch.float32], quick=True)  # validate passed it before
    assert results and all(r["status"] == "error" and "rms_nrom" in r["detail"] for r in results)


def test_a_misspelt_op_from_the_kernels_hook_is_the_plugins_fault(monkeypatch):
    _with(monkeypatch, "tests.fake_plugins.bad_tables")
    with pytest.warns(RuntimeWarning, match="unknown IR op 'sillu' \\(closest IR ops: silu"):
        chip = plugins.select_backend("hook_typo")
    assert chip.contributions.kernels == ()
    assert "names unknown IR op 'sillu'" in _failures("bad_tables")["dinfer_rt_register_kernels"]


# ---------------------------------------------------------------- 4. a backend name already taken


@pytest.mark.parametrize("first", [False, True], ids=["plugin-after", "plugin-listed-first"])
def test_a_backend_name_already_taken_is_a_failure_naming_both_registrants(monkeypatch, capsys, first):
    from dinfer_rt.backends.cpu.backend import CpuBackend
    from dinfer_rt.cli import main

    _with(monkeypatch, "tests.fake_plugins.name_clash", first=first)
    reg = plugins.registry()
    assert reg.backends["cpu"] is CpuBackend and reg.plugin_of["cpu"] == "cpu"  # the built-in stays
    assert "ownchip" in reg.backends  # the plugin's other backend is registered
    why = _failures("name_clash")["dinfer_rt_register_backends"]
    assert "backend name 'cpu' (tests.fake_plugins.name_clash.ClashCpu) is already registered by plugin 'cpu'" in why
    assert "(dinfer_rt.backends.cpu.backend.CpuBackend)" in why
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "plugin failed in dinfer_rt_register_backends: backend name 'cpu'" in out


def test_two_plugins_of_one_entry_point_name_do_not_take_discovery_down(monkeypatch):
    real = plugins.entry_points
    twice = [EntryPoint("dup", "tests.fake_plugins.good", "g"), EntryPoint("dup", "tests.fake_plugins.late", "g")]
    monkeypatch.setattr(plugins, "entry_points", lambda group: list(real(group=group)) + twice)
    plugins.registry.cache_clear()
    assert "fastfake" in plugins.registry().backends  # was pluggy's ValueError out of registry()
    assert "already registered" in _failures("dup")[None]


# ---------------------------------------------------------------- 5. a misspelt hook name


def test_a_misspelt_hook_name_is_a_failure_naming_the_closest_hook(monkeypatch, capsys):
    from dinfer_rt.cli import main

    _with(monkeypatch, "tests.fake_plugins.misspelt_hook")
    why = _failures("misspelt_hook")["dinfer_rt_register_kernel"]
    assert "'dinfer_rt_register_kernel', which is not a dinfer_rt hook" in why
    assert "did you mean 'dinfer_rt_register_kernels'?" in why
    assert plugins.env_info()["misspelt plugin"] == "loaded"  # its real hooks still work
    assert main(["backends"]) == 0
    assert "did you mean 'dinfer_rt_register_kernels'?" in capsys.readouterr().out


def test_the_in_tree_plugins_implement_only_real_hooks():
    assert not [f for f in plugins.registry().failures if "not a dinfer_rt hook" in f.reason]


# ---------------------------------------------------------------- 7. validate's oracle


def test_validate_names_its_oracle_when_dinfer_plugins_excludes_it(monkeypatch):
    from dinfer_rt.validation.runner import require_oracles, validate

    monkeypatch.setenv("DINFER_PLUGINS", "cpu")
    plugins.registry.cache_clear()
    with pytest.raises(BackendError) as e:
        validate("cpu", quick=True, dtypes="float32")
    msg = str(e.value)
    assert "validate needs its oracle backend(s) 'reference'" in msg and "DINFER_PLUGINS='cpu' excludes" in msg
    assert "DINFER_PLUGINS='cpu,reference'" in msg and "unknown backend" not in msg
    with pytest.raises(BackendError, match="pytest --pyargs dinfer_rt.validation needs its oracle"):
        require_oracles("pytest --pyargs dinfer_rt.validation")
    monkeypatch.setenv("DINFER_PLUGINS", "cpu,reference")
    plugins.registry.cache_clear()
    require_oracles()  # named: nothing to say
