"""``load_model``: model folder -> verified graph + weights on a backend."""

from __future__ import annotations

from pathlib import Path

import torch

from dinfer_rt import envs
from dinfer_rt.checkpoint import Checkpoint
from dinfer_rt.dtypes import resolve_dtype
from dinfer_rt.model import Model
from dinfer_rt.plugins import select_backend
from dinfer_rt.spec import parse_spec
from dinfer_rt.tokenizer import Tokenizer

EMBEDDED_MODEL = Path(__file__).parent / "demo" / "model"


def default_model_path() -> Path:
    """``DINFER_MODEL`` if set, else the embedded model shipped in the package."""
    env = envs.get(envs.DINFER_MODEL)
    return Path(env) if env else EMBEDDED_MODEL


def load_model(
    path: str | Path | None = None,
    backend: str | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    tokenizer: bool = True,
) -> Model:
    """Load a checkpoint folder (config.json + safetensors + tokenizer.json).

    ``backend`` overrides ``DINFER_BACKEND``; ``dtype`` (float32 / bfloat16 / float16 /
    float64) is the conversion applied as each tensor is read (default float32).
    """
    model_dir = Path(path) if path is not None else default_model_path()
    dt = resolve_dtype(dtype)
    spec = parse_spec(model_dir)
    be = select_backend(backend)
    if dt not in be.capabilities().dtypes:
        from dinfer_rt.errors import BackendError

        raise BackendError(f"backend {be.name} does not support dtype {dt}; it supports {be.capabilities().dtypes}")
    tok = Tokenizer(model_dir, spec.vocab) if tokenizer else None
    weights = Checkpoint(model_dir)
    from dinfer_rt.weights import load_weights

    w = {k: v.to(be.device()) for k, v in load_weights(weights, spec, dt).items()}
    model = Model(model_dir, spec, w, tok, be, dt)
    model.executable(cached=False)  # lower, verify and compile now: errors surface at load
    return model
