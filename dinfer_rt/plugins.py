"""Plugin discovery and backend selection (pluggy project ``dinfer_rt``).

Plugins are modules named by entry points in the group ``dinfer_rt.backends``; the
in-tree ``cpu`` backend is found the same way. Each plugin implements hooks from
:class:`BackendHookSpec`. A plugin that fails to import or register is recorded and
skipped; it becomes an error only if it is the backend explicitly chosen.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points

import pluggy

from dinfer_rt import envs
from dinfer_rt.backend import Availability, Backend
from dinfer_rt.errors import BackendError

PROJECT = "dinfer_rt"
ENTRY_POINT_GROUP = "dinfer_rt.backends"
HOOK_API_VERSION = 1
BUILTIN_DISTRIBUTION = "dinfer-rt"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class BackendHookSpec:
    """Hook specifications, version :data:`HOOK_API_VERSION`."""

    @hookspec
    def dinfer_rt_register_backends(self) -> list[type[Backend]]:
        """Return the Backend subclasses this plugin provides."""

    @hookspec
    def dinfer_rt_register_kernels(self, backend_name: str) -> dict | None:
        """Return ``{ir_op_name: kernel}`` to add to (or override on) backend ``backend_name``.
        Kernels take the op's reference signature. Called once per compile, never per op."""

    @hookspec
    def dinfer_rt_register_passes(self, backend_name: str) -> list | None:
        """Return extra :class:`dinfer_rt.passes.Pass` objects for backend ``backend_name``'s
        pipeline (run after the shared default passes)."""

    @hookspec
    def dinfer_rt_launch_config(self, backend_name: str, kernel: str, arch: str | None) -> dict | None:
        """Return launch/tuning parameters (block sizes, warps, stages, ...) for ``kernel`` on
        ``backend_name``/``arch``; later plugins override earlier keys. Read once per kernel build."""

    @hookspec
    def dinfer_rt_env_info(self) -> dict | None:
        """Return ``{name: version-or-fact}`` for ``dinfer-rt env`` and validation reports."""


@dataclass(frozen=True)
class PluginFailure:
    name: str
    reason: str


@dataclass
class Registry:
    backends: dict[str, type[Backend]]
    plugin_of: dict[str, str]  # backend name -> plugin (entry point) name
    failures: list[PluginFailure]
    manager: pluggy.PluginManager


@lru_cache(maxsize=1)
def registry() -> Registry:
    """Load plugins once per process (honouring the allowlist and autoload switches)."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(BackendHookSpec)
    allow = envs.plugin_allowlist()
    builtins_only = envs.flag(envs.DINFER_DISABLE_PLUGIN_AUTOLOAD)
    failures: list[PluginFailure] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(getattr(ep, "dist", None), "name", None)
        if builtins_only and dist != BUILTIN_DISTRIBUTION:
            continue
        if allow is not None and ep.name not in allow:
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as e:  # a broken plugin must not take the others down
            failures.append(PluginFailure(ep.name, f"failed to load entry point {ep.value!r}: {type(e).__name__}: {e}"))
    backends: dict[str, type[Backend]] = {}
    plugin_of: dict[str, str] = {}
    for impl in pm.hook.dinfer_rt_register_backends.get_hookimpls():
        try:
            classes = _call(impl)
            for cls in classes or []:
                if not (isinstance(cls, type) and issubclass(cls, Backend)):
                    raise TypeError(f"{cls!r} is not a dinfer_rt.backend.Backend subclass")
                backends[cls.name] = cls
                plugin_of[cls.name] = impl.plugin_name
        except Exception as e:
            failures.append(PluginFailure(impl.plugin_name, f"failed to register: {type(e).__name__}: {e}"))
    return Registry(backends, plugin_of, failures, pm)


def _call(impl, **kwargs):
    """Call one plugin's hook implementation, tracing it to stderr under DINFER_TRACE_PLUGINS=1.

    Implementations are called one by one (not through ``pm.hook``) so that every result is
    attributed to its plugin and one failing plugin cannot hide the others' results."""
    trace = envs.flag(envs.DINFER_TRACE_PLUGINS)
    if trace:
        print(f"[dinfer_rt plugins] {impl.plugin_name}.{impl.function.__name__}({kwargs})", file=sys.stderr)
    result = impl.function(**kwargs)
    if trace:
        print(f"[dinfer_rt plugins]   -> {result!r}", file=sys.stderr)
    return result


def plugin_kernels(backend_name: str) -> list[tuple[str, dict]]:
    """(plugin name, kernels) registered by plugins for ``backend_name``, in registration order."""
    out = []
    for impl in registry().manager.hook.dinfer_rt_register_kernels.get_hookimpls():
        kernels = _call(impl, backend_name=backend_name)
        if kernels:
            out.append((impl.plugin_name, dict(kernels)))
    return out


def plugin_passes(backend_name: str) -> list:
    passes: list = []
    for impl in registry().manager.hook.dinfer_rt_register_passes.get_hookimpls():
        passes += list(_call(impl, backend_name=backend_name) or [])
    return passes


def plugin_launch_config(backend_name: str, kernel: str, arch: str | None) -> dict:
    config: dict = {}
    for impl in registry().manager.hook.dinfer_rt_launch_config.get_hookimpls():
        config.update(_call(impl, backend_name=backend_name, kernel=kernel, arch=arch) or {})
    return config


def env_info() -> dict[str, str]:
    info: dict[str, str] = {}
    for impl in registry().manager.hook.dinfer_rt_env_info.get_hookimpls():
        try:
            info.update({str(k): str(v) for k, v in (_call(impl) or {}).items()})
        except Exception as e:
            info[f"{impl.plugin_name} (error)"] = f"{type(e).__name__}: {e}"
    return info


def availability(cls: type[Backend]) -> Availability:
    try:
        return cls().is_available()
    except Exception as e:
        return Availability(False, f"availability probe raised {type(e).__name__}: {e}")


def describe_all() -> str:
    """One line per backend and per failed plugin: what a selection error shows."""
    reg = registry()
    lines = []
    for name, cls in sorted(reg.backends.items()):
        a = availability(cls)
        lines.append(f"  {name}: {'available' if a.ok else 'unavailable'} ({a.reason})")
    lines += [f"  plugin {f.name}: not loaded ({f.reason})" for f in reg.failures]
    return "\n".join(lines) or "  (no backend plugins found: is dinfer-rt installed?)"


def select_backend(choice: str | None = None) -> Backend:
    """Resolve ``choice`` (or ``DINFER_BACKEND``, or auto-detect) to a backend instance.

    The resolved name is written back to ``DINFER_BACKEND`` for child processes.
    """
    raw = choice or envs.get(envs.DINFER_BACKEND)
    reg = registry()
    if raw is None:
        ranked = sorted(reg.backends.values(), key=lambda c: -c.priority)
        for cls in ranked:
            if availability(cls):
                return _resolved(cls())
        raise BackendError(f"no backend is available; backends:\n{describe_all()}")
    name, _, rest = raw.partition(":")
    flavour, _, arch = rest.partition(":")
    if name not in reg.backends:
        failed = [f for f in reg.failures if f.name == name]
        why = f" (its plugin failed: {failed[0].reason})" if failed else ""
        raise BackendError(f"unknown backend {name!r} from {_source(choice)}{why}; backends:\n{describe_all()}")
    backend = reg.backends[name]()
    if flavour:
        backend.flavour = flavour
    if arch:
        backend.arch = arch
    if (bad := backend.validate_choice()) is not None:
        raise BackendError(f"{bad} (from {_source(choice)})")
    a = availability(type(backend))
    if not a:
        raise BackendError(
            f"backend {name!r} chosen by {_source(choice)} is unavailable: {a.reason}; backends:\n{describe_all()}"
        )
    return _resolved(backend)


def _source(choice: str | None) -> str:
    return "the backend argument" if choice else f"{envs.DINFER_BACKEND}={os.environ.get(envs.DINFER_BACKEND)!r}"


def _resolved(backend: Backend) -> Backend:
    os.environ[envs.DINFER_BACKEND] = backend.describe()
    return backend
