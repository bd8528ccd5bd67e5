"""Tensor types with symbolic dimensions (``"B"``, ``"T"``, ``"S"``) and torch dtypes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

Dim = int | str
"""A dimension: a fixed size, or a symbol bound at run time (batch, tokens, cache length)."""

DTYPE_NAMES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.float8_e4m3fn: "f8e4m3",
    torch.bool: "bool",
}


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        dims = ",".join(str(d) for d in self.shape)
        return f"{DTYPE_NAMES.get(self.dtype, str(self.dtype))}[{dims}]"

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_shape(self, *shape: Dim) -> TensorType:
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype: torch.dtype) -> TensorType:
        return TensorType(self.shape, dtype)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    def matches(self, t: torch.Tensor, bindings: dict[str, int] | None = None) -> bool:
        """Whether a concrete tensor has this type (symbols bound consistently in ``bindings``)."""
        if t.dtype != self.dtype or t.dim() != self.rank:
            return False
        bindings = {} if bindings is None else bindings
        for want, got in zip(self.shape, t.shape):
            if isinstance(want, int):
                if want != got:
                    return False
            elif bindings.setdefault(want, got) != got:
                return False
        return True


def same_dim(a: Dim, b: Dim) -> bool:
    """Two dims are compatible when equal, or when either is symbolic and the other is not a clash."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, str) and isinstance(b, str):
        return a == b
    return True
