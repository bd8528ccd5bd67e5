"""Every environment variable dinfer-rt reads, in one place (documented in README.md)."""

from __future__ import annotations

import os

from dinfer_rt.errors import DinferError

DINFER_BACKEND = "DINFER_BACKEND"
"""Backend choice, ``name[:flavour[:arch]]``; unset means auto-detect. Written back once resolved."""
DINFER_PLUGINS = "DINFER_PLUGINS"
"""Comma-separated allowlist of plugin (entry-point) names to load; unset loads all."""
DINFER_DISABLE_PLUGIN_AUTOLOAD = "DINFER_DISABLE_PLUGIN_AUTOLOAD"
"""``1`` loads only the plugins shipped with dinfer-rt itself."""
DINFER_TRACE_PLUGINS = "DINFER_TRACE_PLUGINS"
"""``1`` prints every hook call and result to stderr."""
DINFER_DUMP_IR = "DINFER_DUMP_IR"
"""A folder: the graph is written there after lowering and after every pass."""
DINFER_DISABLE_PASSES = "DINFER_DISABLE_PASSES"
"""Comma-separated pass names to skip (bisection of a miscompile)."""
DINFER_INTERPRET = "DINFER_INTERPRET"
"""``1``: the Triton backends run their kernels on CPU tensors under ``TRITON_INTERPRET=1``."""
DINFER_AUTOTUNE = "DINFER_AUTOTUNE"
"""``1``: Triton backends time candidate launch configurations once per shape bucket and cache the winner."""
DINFER_GRAPHS = "DINFER_GRAPHS"
"""``1``: ``cuda`` (CUDA graphs) and ``ascend`` (ACL graphs) capture each forward shape and replay it."""
DINFER_TUNING_CACHE = "DINFER_TUNING_CACHE"
"""Folder of the autotuning cache; unset means ``~/.cache/dinfer_rt/tuning``."""
DINFER_EXECUTOR = "DINFER_EXECUTOR"
"""``interpreted`` runs each graph step by step instead of as generated straight-line code (debugging)."""
DINFER_CPU_NATIVE = "DINFER_CPU_NATIVE"
"""``0``: the CPU backend runs only torch kernels (no native C kernels are compiled or loaded)."""
DINFER_CPU_PACKED_WEIGHTS = "DINFER_CPU_PACKED_WEIGHTS"
"""CPU layer blocks: which projections get a panel-packed copy for the native GEMM (their bytes
once more): ``small`` (default: weights up to 1 MiB), ``all``, ``off`` (every matmul via MKL)."""
DINFER_CPU_MATMUL = "DINFER_CPU_MATMUL"
"""CPU layer blocks: ``fp32`` (default) or ``bf16``: projections with bfloat16-rounded inputs
summed in float32 (AVX512-BF16 CPUs; about 2x the float32 GEMM's speed, bfloat16 accuracy)."""
DINFER_CPU_BLAS = "DINFER_CPU_BLAS"
"""CPU layer blocks: path of a shared library exporting Fortran ``sgemm_`` (LP64) to call instead
of the one torch links; self-checked against ``torch.mm`` first (a library named here that is
missing or fails the check is an error when a model loads; torch's own failing it turns the GEMMs
off)."""
DINFER_MODEL = "DINFER_MODEL"
"""Default model folder for the CLI and ``LLM()``; unset means the embedded model."""
DINFER_USE_MODELSCOPE = "DINFER_USE_MODELSCOPE"
"""``1`` / ``true``: hub ids (``ORG/NAME``) resolve through ModelScope instead of the Hugging Face
hub (read and checked by ``hub.use_modelscope`` only when a hub id is resolved)."""

ALL = (
    DINFER_BACKEND,
    DINFER_PLUGINS,
    DINFER_DISABLE_PLUGIN_AUTOLOAD,
    DINFER_TRACE_PLUGINS,
    DINFER_DUMP_IR,
    DINFER_DISABLE_PASSES,
    DINFER_INTERPRET,
    DINFER_AUTOTUNE,
    DINFER_GRAPHS,
    DINFER_TUNING_CACHE,
    DINFER_EXECUTOR,
    DINFER_CPU_NATIVE,
    DINFER_CPU_PACKED_WEIGHTS,
    DINFER_CPU_MATMUL,
    DINFER_CPU_BLAS,
    DINFER_MODEL,
    DINFER_USE_MODELSCOPE,
)


# Boolean variables and their value when unset. Each accepts only 0 / 1 / true / false (any case).
BOOLEANS = {
    DINFER_DISABLE_PLUGIN_AUTOLOAD: False,
    DINFER_TRACE_PLUGINS: False,
    DINFER_INTERPRET: False,
    DINFER_AUTOTUNE: False,
    DINFER_GRAPHS: False,
    DINFER_CPU_NATIVE: True,
}
_TRUE, _FALSE = ("1", "true"), ("0", "false")
SHOWN_CHARS = 80  # an error echoes at most this much of a value


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length said (errors never echo
    a very long value in full)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def _interpret_triton_early() -> None:
    """Triton reads TRITON_INTERPRET when ``triton.language`` is first imported, so DINFER_INTERPRET=1
    must be mirrored into it before anything imports triton: done when dinfer_rt is imported
    (a value other than the booleans is refused by :func:`check` / :func:`flag`, not here)."""
    if (os.environ.get(DINFER_INTERPRET) or "0").strip().lower() in _TRUE:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def get(name: str) -> str | None:
    """The variable's value (None when unset or empty). ``DINFER_MODEL``, when it is spelt as a
    path rather than a hub id (``ORG/NAME``), must name a folder: else an error naming it."""
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    if name == DINFER_MODEL:
        _check_model_path(value)
    return value


def _check_model_path(value: str) -> None:
    try:
        from dinfer_rt.hub import is_hub_id
    except ImportError:  # no hub support: every value is a path

        def is_hub_id(_text: str) -> bool:
            return False

    path = os.path.expanduser(value)
    if not os.path.exists(path) and not is_hub_id(value):
        raise DinferError(f"{DINFER_MODEL}={shown(value)}: no such model folder (unset it for the embedded model)")
    if os.path.exists(path) and not os.path.isdir(path):
        raise DinferError(f"{DINFER_MODEL}={shown(value)} is not a folder; it must name a model folder (config.json)")


def flag(name: str, default: bool | None = None) -> bool:
    """A boolean variable: ``1`` / ``true`` or ``0`` / ``false`` (any case, surrounding blanks
    ignored); unset or empty is ``default`` (else the variable's own default, else False). Any
    other value is an error naming the variable and the accepted values."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return BOOLEANS.get(name, False) if default is None else default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise DinferError(f"{name}={shown(raw)} is not a boolean; use 1, 0, true or false (any case)")


def check() -> None:
    """Refuse a malformed value of any boolean variable that is set (done once, when the plugins
    load, so a typo is an error even where the variable would only be read later or never)."""
    for name in BOOLEANS:
        flag(name)


def plugin_allowlist() -> set[str] | None:
    """The plugin names ``DINFER_PLUGINS`` allows (None: unset, load all). A value that names no
    plugin (``,,,``) is an error naming the variable."""
    raw = get(DINFER_PLUGINS)
    if raw is None:
        return None
    names = {p.strip() for p in raw.split(",") if p.strip()}
    if not names:
        raise DinferError(
            f"{DINFER_PLUGINS}={shown(raw)} names no plugin; give comma-separated plugin names (e.g. cpu) "
            "or unset it to load every installed plugin"
        )
    return names


def snapshot() -> dict[str, str]:
    """All ``DINFER_*`` variables currently set (for reports and ``dinfer-rt env``)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("DINFER_")}


_interpret_triton_early()
