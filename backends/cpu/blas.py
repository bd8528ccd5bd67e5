"""The BLAS torch itself links, reached from the native layer blocks.

Why: the native layer blocks (``native.c``: a decoder layer in two calls) need a matmul for the
weights they do not pack into panels, and one is already in the process: torch's x86 CPU wheels
link MKL statically into ``libtorch_cpu.so`` and export its Fortran ``sgemm_``. No second BLAS
is loaded, so there is one thread pool and torch's ``set_num_threads`` applies.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Blas:
    """The address of ``sgemm_`` (None: no BLAS found) and where it came from, or why not."""

    sgemm: int | None
    reason: str


def _candidates() -> list[Path]:
    lib = Path(torch.__file__).parent / "lib"
    return [p for p in (lib / "libtorch_cpu.so", lib / "libtorch_cpu.dylib") if p.exists()]


@functools.cache
def find() -> Blas:
    """torch's own ``sgemm_``; never raises (``reason`` says what is missing)."""
    tried = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(str(path))  # already loaded by torch: the same handle, nothing new mapped
        except OSError as e:
            tried.append(f"{path.name}: {e}")
            continue
        sgemm = getattr(lib, "sgemm_", None)
        if sgemm is None:
            tried.append(f"{path.name} exports no sgemm_")
            continue
        return Blas(ctypes.cast(sgemm, ctypes.c_void_p).value, f"sgemm from {path.name}")
    return Blas(None, "no BLAS found in torch's libraries" + (f" ({'; '.join(tried)})" if tried else ""))
