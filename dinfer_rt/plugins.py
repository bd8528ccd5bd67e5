"""Plugin discovery and backend selection (pluggy project ``dinfer_rt``).

Plugins are modules named by entry points in the group ``dinfer_rt.backends``; the in-tree
backends are found the same way. A plugin module declares ``DINFER_RT_HOOK_API`` (the hook API
version it was built for) and implements hooks from :class:`BackendHookSpec`. Hooks are called
through pluggy's own relay (``pm.hook.NAME(...)``), so an implementation may take a subset of
the arguments and ``tryfirst`` / ``trylast`` / wrappers work as pluggy documents. Precedence:
where contributions collide, the implementation pluggy calls first has the last word (as with
pluggy's first-result semantics), so ``tryfirst`` wins.

Fault isolation: a plugin that fails to load, declares another hook API version, implements a
hook that does not exist (a misspelt name pluggy would never call), registers a backend name
already taken, or raises in any hook or returns a malformed result (a kernel table naming an
unknown IR op or a value that is not callable, launch parameters that are not a dict) is
recorded as a :class:`PluginFailure`, and its contribution to that call is dropped; every
other plugin and backend keeps working. Discovery-time faults are shown by ``dinfer-rt
backends`` and ``dinfer-rt env``; faults of the hooks called at backend selection are warned
about once by the command that selects it, and ``dinfer-rt validate`` fails that backend naming
them. An ``is_available`` that returns anything but an :class:`Availability` makes its backend
unavailable with that reason.
"""

from __future__ import annotations

import contextvars
import difflib
import functools
import inspect
import os
import re
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib.metadata import entry_points

import pluggy

from dinfer_rt import envs
from dinfer_rt.backend import Backend, Contributions, kernel_table_problem
from dinfer_rt.errors import BackendError
from dinfer_rt.platform import Availability

PROJECT = "dinfer_rt"
ENTRY_POINT_GROUP = "dinfer_rt.backends"
HOOK_API_VERSION = 2
HOOK_API_ATTRIBUTE = "DINFER_RT_HOOK_API"
BUILTIN_DISTRIBUTION = "dinfer-rt"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class BackendHookSpec:
    """Hook specifications, version :data:`HOOK_API_VERSION`. Each is called once per process
    (registration, env info, compile targets) or once per backend selection (the rest)."""

    @hookspec
    def dinfer_rt_register_backends(self) -> list[type[Backend]]:
        """Return the Backend subclasses this plugin provides."""

    @hookspec
    def dinfer_rt_register_kernels(self, backend_name: str, arch: str | None) -> dict | None:
        """Return ``{ir_op_name: kernel}`` to add to (or override on) backend ``backend_name``.
        Kernels take the op's reference signature."""

    @hookspec
    def dinfer_rt_register_passes(self, backend_name: str) -> list | None:
        """Return extra :class:`dinfer_rt.passes.Pass` objects for backend ``backend_name``'s
        pipeline (run after the shared default passes)."""

    @hookspec
    def dinfer_rt_launch_config(self, backend_name: str, arch: str | None) -> dict | None:
        """Return ``{kernel: {param: value}}`` launch/tuning overrides (block sizes, warps,
        stages, ...) for ``backend_name`` on ``arch``."""

    @hookspec
    def dinfer_rt_compile_targets(self) -> dict | None:
        """Return ``{"backend:arch": compile}`` ahead-of-time targets for ``dinfer-rt kernels
        compile``; ``compile()`` returns one resource row (a dict) per kernel variant."""

    @hookspec
    def dinfer_rt_env_info(self) -> dict | None:
        """Return ``{name: version-or-fact}`` for ``dinfer-rt env`` and validation reports."""


HOOK_NAMES = tuple(sorted(n for n in vars(BackendHookSpec) if n.startswith(f"{PROJECT}_")))


@dataclass(frozen=True)
class PluginFailure:
    name: str  # the plugin (entry point) name
    reason: str
    hook: str | None = None  # None: the plugin did not load


@dataclass
class Registry:
    backends: dict[str, type[Backend]]
    plugin_of: dict[str, str]  # backend name -> plugin (entry point) name
    failures: list[PluginFailure]
    manager: pluggy.PluginManager
    _unwarned: list[PluginFailure] = field(default_factory=list)
    _recording: list[PluginFailure] | None = None  # every fault met while gathering contributions
    excluded: dict[str, str] = field(
        default_factory=dict
    )  # installed plugin not loaded -> the setting that excludes it

    def call(self, hook: str, **kwargs) -> list[tuple[str, object]]:
        """``pm.hook.<hook>(**kwargs)``, each non-None result paired with its plugin's name."""
        seen: list[tuple[str, object]] = []
        token = _results.set(seen)
        try:
            results = getattr(self.manager.hook, hook)(**kwargs)
        except Exception as e:  # only a hook wrapper can get here: implementations are guarded
            self._fault(PluginFailure("(hook wrapper)", f"{type(e).__name__}: {e}", hook))
            results = []
        finally:
            _results.reset(token)
        self._warn_new()
        by_id = {id(r): plugin for plugin, r in seen}
        return [(by_id.get(id(r), "(hook wrapper)"), r) for r in results]

    def typed(self, hook: str, kind: type, **kwargs) -> list[tuple[str, object]]:
        """:meth:`call`, keeping only results of type ``kind``; any other is that plugin's fault."""
        kept = []
        for plugin, result in self.call(hook, **kwargs):
            if isinstance(result, kind):
                kept.append((plugin, result))
            else:
                why = f"returned {type(result).__name__} {result!r:.60}, expected a {kind.__name__}"
                self._fault(PluginFailure(plugin, why, hook))
        self._warn_new()
        return kept

    def _warn_new(self) -> None:
        """One warning per failure, the first time it is recorded."""
        for failure in self._unwarned:
            warnings.warn(
                f"dinfer_rt plugin {failure.name!r} failed in {failure.hook}: {failure.reason}; "
                "its contribution is dropped",
                RuntimeWarning,
                stacklevel=4,
            )
        self._unwarned.clear()

    def _fault(self, failure: PluginFailure) -> None:
        """Record a failure once (a hook called again with the same fault warns once)."""
        if self._recording is not None and failure not in self._recording:
            self._recording.append(failure)
        if failure not in self.failures:
            self.failures.append(failure)
            self._unwarned.append(failure)


_results: contextvars.ContextVar[list | None] = contextvars.ContextVar("dinfer_rt_hook_results", default=None)


def _guarded(fn: Callable, plugin: str, on_fault: Callable[[PluginFailure], None]) -> Callable:
    """``fn`` that records (plugin, result) for attribution and turns an exception into a
    recorded fault and no result. ``functools.wraps`` keeps the signature pluggy reads."""

    names = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        trace = envs.flag(envs.DINFER_TRACE_PLUGINS)
        if trace:
            print(f"[dinfer_rt plugins] {plugin}.{fn.__name__}({dict(zip(names, args)) | kwargs})", file=sys.stderr)
        try:
            result = fn(*args, **kwargs)
        except Exception as e:
            on_fault(PluginFailure(plugin, f"{type(e).__name__}: {e}", fn.__name__))
            return None
        if trace:
            print(f"[dinfer_rt plugins]   -> {result!r}", file=sys.stderr)
        seen = _results.get()
        if seen is not None and result is not None:
            seen.append((plugin, result))
        return result

    call.__signature__ = inspect.signature(fn)  # for pluggy versions that do not unwrap
    return call


def _isolated(module: object, plugin: str, on_fault: Callable[[PluginFailure], None]) -> object:
    """A stand-in namespace for a plugin module whose hook implementations are guarded
    (wrappers are kept as they are: they must see the other implementations' outcome)."""
    proxy = types.SimpleNamespace()
    for attr in dir(module):
        fn = getattr(module, attr, None)
        opts = getattr(fn, f"{PROJECT}_impl", None)
        if not callable(fn) or opts is None:
            continue
        wrapper = opts.get("wrapper") or opts.get("hookwrapper")
        setattr(proxy, attr, fn if wrapper else _guarded(fn, plugin, on_fault))
    return proxy


def _api_mismatch(module: object) -> str | None:
    version = getattr(module, HOOK_API_ATTRIBUTE, None)
    if version is None:
        return f"declares no {HOOK_API_ATTRIBUTE} (this dinfer-rt speaks hook API {HOOK_API_VERSION})"
    if not isinstance(version, int) or isinstance(version, bool):  # "2" would read as a mismatch with 2
        return (
            f"declares {HOOK_API_ATTRIBUTE} = {version!r:.40}, which is not an int "
            f"(this dinfer-rt speaks hook API {HOOK_API_VERSION}: {HOOK_API_ATTRIBUTE} = {HOOK_API_VERSION})"
        )
    if version != HOOK_API_VERSION:
        return f"was built for dinfer-rt hook API {version}; this dinfer-rt speaks hook API {HOOK_API_VERSION}"
    return None


@lru_cache(maxsize=1)
def registry() -> Registry:
    """Load plugins once per process (honouring the allowlist and autoload switches)."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(BackendHookSpec)
    reg = Registry({}, {}, [], pm)
    envs.check()  # every boolean DINFER_* variable holds 0 / 1 / true / false
    allow = envs.plugin_allowlist()
    builtins_only = envs.flag(envs.DINFER_DISABLE_PLUGIN_AUTOLOAD)
    # built-ins first (a stable sort keeps the entry point order within each part): where two
    # plugins register one backend name, the first registration stays
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: _distribution(ep) != BUILTIN_DISTRIBUTION)
    if allow is not None and (missing := allow - {ep.name for ep in found}):
        raise BackendError(
            f"{envs.DINFER_PLUGINS} names plugin(s) not installed: {_listed(sorted(missing))}; "
            f"installed: {', '.join(sorted(ep.name for ep in found)) or 'none'}"
        )
    builtin: set[str] = set()
    for ep in found:
        dist = _distribution(ep)
        if builtins_only and dist != BUILTIN_DISTRIBUTION:
            reg.excluded[ep.name] = f"{envs.DINFER_DISABLE_PLUGIN_AUTOLOAD}=1"
            continue
        if allow is not None and ep.name not in allow:
            reg.excluded[ep.name] = f"{envs.DINFER_PLUGINS}={envs.shown(os.environ[envs.DINFER_PLUGINS])}"
            continue
        try:
            module = ep.load()
        except Exception as e:  # a broken plugin must not take the others down
            reg.failures.append(
                PluginFailure(ep.name, f"failed to load entry point {ep.value!r}: {type(e).__name__}: {e}")
            )
            continue
        if (bad := _api_mismatch(module)) is not None:
            reg.failures.append(PluginFailure(ep.name, f"plugin {ep.name!r} ({ep.value}) {bad}"))
            continue
        try:
            pm.register(_isolated(module, ep.name, reg._fault), name=ep.name)
        except pluggy.PluginValidationError as e:  # a hook whose arguments the spec does not have
            reg.failures.append(
                PluginFailure(ep.name, f"plugin {ep.name!r} ({ep.value}) does not match the hooks: {e}")
            )
            continue
        except ValueError as e:  # pluggy: a plugin of that name is registered already
            reg.failures.append(PluginFailure(ep.name, f"plugin {ep.name!r} ({ep.value}) not registered: {e}"))
            continue
        if dist == BUILTIN_DISTRIBUTION:
            builtin.add(ep.name)
    reg.failures += _unknown_hooks(pm)
    # pluggy calls the last-registered first: take the results in registration order, built-ins first
    results = sorted(reversed(reg.typed("dinfer_rt_register_backends", list)), key=lambda r: r[0] not in builtin)
    for plugin, classes in results:
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, Backend))]
        if bad:
            reg.failures.append(
                PluginFailure(plugin, f"failed to register: {bad[0]!r} is not a dinfer_rt.backend.Backend subclass")
            )
            continue
        for cls in classes:
            if (why := _registration_problem(cls)) is not None:
                reg.failures.append(
                    PluginFailure(plugin, f"{why}; this backend is skipped", "dinfer_rt_register_backends")
                )
                continue
            taken = reg.backends.get(cls.name)
            if taken is cls:
                continue
            if taken is not None:  # the first registration stays; the clash is this plugin's fault
                reg.failures.append(
                    PluginFailure(
                        plugin,
                        f"backend name {cls.name!r} ({_qualified(cls)}) is already registered by plugin "
                        f"{reg.plugin_of[cls.name]!r} ({_qualified(taken)}); this registration is dropped "
                        "(give the backend a name of its own)",
                        "dinfer_rt_register_backends",
                    )
                )
                continue
            reg.backends[cls.name] = cls
            reg.plugin_of[cls.name] = plugin
    return reg


_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _registration_problem(cls: type[Backend]) -> str | None:
    """Why a backend class cannot be registered (None: it can): its name must be one a choice
    ``name[:flavour[:arch]]`` can spell and sorts with the others; its priority must order."""
    name = cls.name
    if not isinstance(name, str):
        return f"backend {_qualified(cls)} has name {name!r:.40} (a {type(name).__name__}; a name is a str)"
    if not _NAME.fullmatch(name):
        why = "the Platform default: give it a name" if name == "?" else "letters, digits, '_', '.', '-' only"
        return f"backend {_qualified(cls)} has name {envs.shown(name)} ({why})"
    if not isinstance(cls.priority, (int, float)) or isinstance(cls.priority, bool):
        return f"backend {name!r} ({_qualified(cls)}) has priority {cls.priority!r:.40}, expected a number"
    return None


def _plugin_fault(backend: Backend | type[Backend], what: str, e: Exception) -> BackendError:
    """The error for a backend method of a third-party plugin that raised, naming both."""
    name = backend.name
    plugin = registry().plugin_of.get(name, "?")
    return BackendError(f"plugin {plugin!r} fault: backend {name!r} {what} raised {type(e).__name__}: {e}")


def instantiate(cls: type[Backend]) -> Backend:
    """``cls()``, a constructor that raises being its plugin's named fault."""
    try:
        return cls()
    except Exception as e:
        raise _plugin_fault(cls, "constructor", e) from e


def _distribution(ep) -> str | None:
    return getattr(getattr(ep, "dist", None), "name", None)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _unknown_hooks(pm: pluggy.PluginManager) -> list[PluginFailure]:
    """Hook implementations with no spec (a misspelt hook name, which pluggy accepts and never
    calls): what ``PluginManager.check_pending`` detects, one failure per plugin and name."""
    found = []
    for name, caller in sorted(vars(pm.hook).items()):
        if not isinstance(caller, pluggy.HookCaller) or caller.has_spec():
            continue
        close = difflib.get_close_matches(name, HOOK_NAMES, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"the hooks are {', '.join(HOOK_NAMES)}"
        for impl in caller.get_hookimpls():
            if impl.opts.get("optionalhook"):
                continue
            why = (
                f"implements {name!r}, which is not a dinfer_rt hook (hook API {HOOK_API_VERSION}), "
                f"so it is never called; {hint}"
            )
            found.append(PluginFailure(impl.plugin_name, why, name))
    return found


def _listed(names: list[str]) -> str:
    """Names joined by commas, cut to envs.SHOWN_CHARS characters (a long value is not echoed in full)."""
    text = ", ".join(names)
    if len(text) <= envs.SHOWN_CHARS:
        return text
    return f"{text[: envs.SHOWN_CHARS]}... ({len(names)} name(s), {len(text)} characters)"


def contributions(backend: Backend) -> Contributions:
    """Gather every plugin's kernels, passes and launch overrides for ``backend`` (once, at
    selection). Results are applied in reverse call order, so the first-called plugin wins."""
    reg = registry()
    reg._recording = []
    try:
        return _gather(reg, backend)
    finally:
        reg._recording = None


def _gather(reg: Registry, backend: Backend) -> Contributions:
    from dinfer_rt.passes import Pass

    who = {"backend_name": backend.name}
    kernels = []
    for plugin, table in reg.typed("dinfer_rt_register_kernels", dict, **who, arch=backend.arch):
        if (why := kernel_table_problem(table)) is not None:
            reg._fault(PluginFailure(plugin, f"returned a kernel table that {why}", "dinfer_rt_register_kernels"))
            continue
        kernels.append((plugin, dict(table)))
    from dinfer_rt.passes import default_pipeline

    passes = []
    taken = {p.name: "the shared pipeline" for p in default_pipeline()}  # counts, dumps and disabling go by name
    for plugin, listed in reg.typed("dinfer_rt_register_passes", list, **who):
        if (bad := next((p for p in listed if not isinstance(p, Pass)), None)) is not None:
            why = f"returned {type(bad).__name__} {bad!r:.40} in its list, expected dinfer_rt.passes.Pass objects"
            reg._fault(PluginFailure(plugin, why, "dinfer_rt_register_passes"))
            continue
        for p in listed:
            if p.name in taken:
                why = (
                    f"returned pass {p.name!r}, a name {taken[p.name]} already uses (its rewrite count, "
                    "DINFER_DISABLE_PASSES and IR dumps go by name): give it its own name; this pass is skipped"
                )
                reg._fault(PluginFailure(plugin, why, "dinfer_rt_register_passes"))
                continue
            taken[p.name] = f"plugin {plugin!r}"
            passes.append(p)
    launch: dict[str, dict] = {}
    for plugin, table in reversed(reg.typed("dinfer_rt_launch_config", dict, **who, arch=backend.arch)):
        if (bad := next(((k, v) for k, v in table.items() if not isinstance(v, Mapping)), None)) is not None:
            why = (
                f"returned {type(bad[1]).__name__} {bad[1]!r:.40} as the launch parameters of kernel {bad[0]!r}, "
                "expected a dict {param: value}"
            )
            reg._fault(PluginFailure(plugin, why, "dinfer_rt_launch_config"))
            continue
        for kernel, params in table.items():
            launch[kernel] = {**launch.get(kernel, {}), **dict(params)}
    reg._warn_new()
    return Contributions(tuple(reversed(kernels)), tuple(passes), launch, tuple(reg._recording or ()))


def compile_targets() -> dict[str, Callable[[], list[dict]]]:
    """Every ahead-of-time kernel target the installed backends contribute."""
    reg = registry()
    targets: dict[str, Callable] = {}
    for plugin, contributed in reversed(reg.typed("dinfer_rt_compile_targets", dict)):
        if (bad := next(((k, v) for k, v in contributed.items() if not callable(v)), None)) is not None:
            why = f"returned {type(bad[1]).__name__} {bad[1]!r:.40} as target {bad[0]!r:.40}, expected a callable"
            reg._fault(PluginFailure(plugin, why, "dinfer_rt_compile_targets"))
            continue
        targets.update(contributed)
    reg._warn_new()
    return targets


def env_info() -> dict[str, str]:
    """Every plugin's ``{name: fact}`` as strings; a fact whose ``str()`` raises drops that plugin's table."""
    reg = registry()
    info: dict[str, str] = {}
    for plugin, contributed in reversed(reg.typed("dinfer_rt_env_info", dict)):
        try:
            info.update({str(k): str(v) for k, v in contributed.items()})
        except Exception as e:
            reg._fault(
                PluginFailure(
                    plugin, f"returned a value whose str() raised {type(e).__name__}: {e}", "dinfer_rt_env_info"
                )
            )
    reg._warn_new()
    return info


def availability(backend: type[Backend] | Backend) -> Availability:
    """The probe's answer for a backend class (default choice) or a configured instance. A probe
    that raises, or returns anything but an :class:`Availability` (a bare ``True``), leaves the
    backend unavailable with that reason, the plugin named: every caller gets an Availability."""
    try:
        instance = instantiate(backend) if isinstance(backend, type) else backend
    except BackendError as e:
        return Availability(False, str(e))
    try:
        answer = instance.is_available()
    except Exception as e:
        return Availability(False, f"availability probe raised {type(e).__name__}: {e}")
    name = backend.name
    plugin = registry().plugin_of.get(name, "?")
    if isinstance(answer, Availability) and not isinstance(answer.ok, bool):  # bool(answer) would raise
        return Availability(
            False,
            f"plugin {plugin!r} fault: {name}.is_available returned Availability(ok={answer.ok!r:.20}), "
            "ok must be a bool",
        )
    if not isinstance(answer, Availability):
        return Availability(
            False,
            f"plugin {plugin!r} fault: {name}.is_available returned {type(answer).__name__}, expected Availability "
            f"(return dinfer_rt.backend.Availability(ok, reason), not {answer!r:.20})",
        )
    return answer


def describe_all() -> str:
    """One line per backend and per plugin failure: what a selection error shows."""
    reg = registry()
    lines = []
    for name, cls in sorted(reg.backends.items()):
        a = availability(cls)
        lines.append(f"  {name}: {'available' if a.ok else 'unavailable'} ({a.reason})")
    for f in reg.failures:
        where = "not loaded" if f.hook is None else f"failed in {f.hook}"
        lines.append(f"  plugin {f.name}: {where} ({f.reason})")
    if lines:
        return "\n".join(lines)
    allow = os.environ.get(envs.DINFER_PLUGINS)
    if allow and allow.strip():
        return f"  (no backend plugin loaded: {envs.DINFER_PLUGINS}={envs.shown(allow)} allows none that registers one)"
    if envs.flag(envs.DINFER_DISABLE_PLUGIN_AUTOLOAD):
        return f"  (no backend plugin loaded: {envs.DINFER_DISABLE_PLUGIN_AUTOLOAD} is set)"
    return "  (no backend plugins found: is dinfer-rt installed?)"


def parse_choice(raw: str, source: str) -> tuple[str, str, str]:
    """``name[:flavour[:arch]]`` -> its parts (``name::arch`` keeps the default flavour); an empty
    name, an empty trailing part or extra parts are an error naming ``source``."""
    parts = [p.strip() for p in raw.split(":")]
    if len(parts) > 3 or not parts[0] or not parts[-1]:
        raise BackendError(
            f"backend choice {envs.shown(raw)} from {source} is not name[:flavour[:arch]] (empty or extra parts)"
        )
    name, flavour, arch = (parts + ["", ""])[:3]
    return name, flavour, arch


def select_backend(choice: str | None = None) -> Backend:
    """Resolve ``choice`` (or ``DINFER_BACKEND``, or auto-detect) to a configured backend: the
    same instance is validated, probed, identified and handed its plugin contributions.

    The resolved name is written back to ``DINFER_BACKEND`` for child processes.
    """
    raw = choice or envs.get(envs.DINFER_BACKEND)
    reg = registry()
    if raw is None:
        for cls in sorted(reg.backends.values(), key=lambda c: -c.priority):
            try:  # a plugin whose backend raises must not stop auto-detection of the others
                backend = instantiate(cls)
                if availability(backend):
                    return _resolved(backend)
            except BackendError as e:
                warnings.warn(f"{e}; auto-detection skips it", RuntimeWarning, stacklevel=2)
        raise BackendError(f"no backend is available; backends:\n{describe_all()}")
    source = _source(choice)
    backend = construct_backend(raw, source)
    a = availability(backend)
    if not a:
        raise BackendError(
            f"backend {envs.shown(raw)} chosen by {source} is unavailable: {a.reason}; backends:\n{describe_all()}"
        )
    return _resolved(backend)


def construct_backend(raw: str, source: str) -> Backend:
    """The backend a ``name[:flavour[:arch]]`` choice names, constructed with its flavour and arch
    and checked by the backend itself, not yet checked for availability; errors name ``source``
    (the env var or the flag the choice came from)."""
    reg = registry()
    name, flavour, arch = parse_choice(raw, source)
    if name not in reg.backends:
        raise BackendError(
            f"unknown backend {envs.shown(name)} from {source}{_unknown_why(reg, name)}; backends:\n{describe_all()}"
        )
    backend = instantiate(reg.backends[name])
    if flavour:
        backend.flavour = flavour
    if arch:
        backend.arch = arch
    try:
        bad = backend.validate_choice()
    except Exception as e:
        raise _plugin_fault(backend, "validate_choice", e) from e
    if bad is not None:
        raise BackendError(f"{bad} (from {source})")
    return backend


def _unknown_why(reg: Registry, name: str) -> str:
    """What an unknown backend name may be instead: a failed or excluded plugin, another spelling."""
    if failed := [f for f in reg.failures if f.name == name]:
        return f" (its plugin failed: {failed[0].reason})"
    if name in reg.excluded:
        return f" (its plugin {name!r} is installed but excluded by {reg.excluded[name]})"
    close = [n for n in reg.backends if n.lower() == name.lower()] or difflib.get_close_matches(name, reg.backends, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _source(choice: str | None) -> str:
    return "the backend argument" if choice else f"{envs.DINFER_BACKEND}={envs.shown(os.environ[envs.DINFER_BACKEND])}"


def _resolved(backend: Backend) -> Backend:
    try:
        backend.identify()
    except Exception as e:
        raise _plugin_fault(backend, "identify", e) from e
    backend.contributions = contributions(backend)
    os.environ[envs.DINFER_BACKEND] = backend.describe()
    return backend
