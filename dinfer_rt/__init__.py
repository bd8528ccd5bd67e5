"""dinfer-rt: an inference runtime for diffusion language models on many chips.

The public names load on first use (PEP 562), so ``import dinfer_rt`` and the command line's
start-up stay light until a command needs torch: a Ctrl-C while torch is still importing is
then the command's one-line ``interrupted``, not a traceback from inside an import.
"""

import importlib
import os

# `import torch` otherwise imports every installed device extension (torch_npu, ...): that fails
# without their runtimes (CANN) and initialises devices before a backend is chosen. dinfer-rt
# imports the selected backend's extension itself (see backends/ascend).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

__version__ = "0.1.0"

_EXPORTS = {
    "DinferError": "dinfer_rt.errors",
    "GenerationOutput": "dinfer_rt.llm",
    "KVCache": "dinfer_rt.model",
    "LLM": "dinfer_rt.llm",
    "Model": "dinfer_rt.model",
    "SamplingParams": "dinfer_rt.sampling",
    "load_model": "dinfer_rt.loader",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str):
    """A public name (imported from its module on first use) or a submodule (``dinfer_rt.loader``)."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
