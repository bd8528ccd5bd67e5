"""The dtype policy: which float type weights are converted to on load and computed in."""

from __future__ import annotations

import torch

from dinfer_rt.errors import ConfigError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """Map a user-facing name (or torch dtype, or None for ``default``) to a torch dtype."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ConfigError(f"unsupported dtype {dtype}; choose one of: float32, bfloat16, float16, float64")
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: float32, bfloat16, float16, float64") from None


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for router, RoPE and norm statistics: fp32, or f64 when validating in f64."""
    return torch.float64 if dtype == torch.float64 else torch.float32
