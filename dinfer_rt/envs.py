"""Every environment variable dinfer-rt reads, in one place (documented in README.md)."""

from __future__ import annotations

import os

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
DINFER_MODEL = "DINFER_MODEL"
"""Default model folder for the CLI and ``LLM()``; unset means the embedded model."""

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
    DINFER_MODEL,
)


def _interpret_triton_early() -> None:
    """Triton reads TRITON_INTERPRET when ``triton.language`` is first imported, so DINFER_INTERPRET=1
    must be mirrored into it before anything imports triton: done when dinfer_rt is imported."""
    if (os.environ.get(DINFER_INTERPRET) or "0").strip().lower() in ("1", "true", "yes", "on"):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def flag(name: str) -> bool:
    return (get(name) or "0").strip().lower() in ("1", "true", "yes", "on")


def plugin_allowlist() -> set[str] | None:
    raw = get(DINFER_PLUGINS)
    return None if raw is None else {p.strip() for p in raw.split(",") if p.strip()}


def snapshot() -> dict[str, str]:
    """All ``DINFER_*`` variables currently set (for reports and ``dinfer-rt env``)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("DINFER_")}


_interpret_triton_early()
