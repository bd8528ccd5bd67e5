"""dinfer-rt: an inference runtime for diffusion language models on many chips."""

from dinfer_rt.errors import DinferError
from dinfer_rt.loader import load_model
from dinfer_rt.model import KVCache, Model

__version__ = "0.1.0"

__all__ = ["DinferError", "KVCache", "Model", "__version__", "load_model"]
