"""dinfer-rt: an inference runtime for diffusion language models on many chips."""

import os

# `import torch` otherwise imports every installed device extension (torch_npu, ...): that fails
# without their runtimes (CANN) and initialises devices before a backend is chosen. dinfer-rt
# imports the selected backend's extension itself (see backends/ascend).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

# ruff: noqa: E402

from dinfer_rt.errors import DinferError
from dinfer_rt.llm import LLM, GenerationOutput
from dinfer_rt.loader import load_model
from dinfer_rt.model import KVCache, Model
from dinfer_rt.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["DinferError", "GenerationOutput", "KVCache", "LLM", "Model", "SamplingParams", "__version__", "load_model"]
