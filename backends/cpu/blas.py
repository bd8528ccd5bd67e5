"""The BLAS torch itself links, reached from the native layer blocks, and MKL's packed weights.

Why: the native layer blocks (``native.c``: a decoder layer in two calls) need a matmul, and the
fastest one on the machine is already in the process: torch's x86 CPU wheels link MKL statically
into ``libtorch_cpu.so`` and export its ``sgemm_`` and ``cblas_sgemm_pack`` / ``_compute``. No
second BLAS is loaded, so there is one thread pool and torch's ``set_num_threads`` applies.

MKL's packed format (``cblas_sgemm_pack`` of W^T, reused for any row count) skips the per-call
repacking of B: measured on the 2-thread Xeon here, 24 projections of the embedded model at 19
rows 487 vs 727 us (1.5x), at 8 rows 308 vs 446 us; at one row it is no faster. The packed copy
costs about twice the weight's bytes in resident memory, so by default only weights of at most
``SMALL_WEIGHT_BYTES`` are packed (the dispatch-bound regime where it pays most and costs
least); ``DINFER_CPU_PACKED_WEIGHTS=all`` packs every fused projection, ``off`` none. Results
equal ``F.linear``'s to float32 rounding (the conformance suite checks the blocks in float64).
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from dinfer_rt import envs
from dinfer_rt.errors import ConfigError

SMALL_WEIGHT_BYTES = 1 << 20
PACK_POLICIES = ("small", "all", "off")
_ROW_MAJOR, _B_MATRIX, _TRANS = 101, 162, 112


@dataclass(frozen=True)
class Blas:
    """Function addresses for the native library: ``sgemm`` (None: no BLAS found) and, with MKL,
    the packed-B entry points; ``reason`` says which library provided what."""

    sgemm: int | None
    compute: int | None
    reason: str
    _pack: object = None
    _pack_size: object = None

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """MKL's packed copy of ``weight``^T ([n, k] float32 contiguous), or None without MKL."""
        if self._pack is None:
            return None
        n, k = weight.shape
        weight = weight.contiguous()
        size = self._pack_size(_B_MATRIX, 16, n, k)  # bytes; the row-count hint does not change the format
        buf = torch.empty(size // 4 + 16, dtype=torch.float32)
        self._pack(_ROW_MAJOR, _B_MATRIX, _TRANS, 16, n, k, 1.0, weight.data_ptr(), k, buf.data_ptr())
        return buf


def _candidates() -> list[Path]:
    lib = Path(torch.__file__).parent / "lib"
    return [p for p in (lib / "libtorch_cpu.so", lib / "libtorch_cpu.dylib") if p.exists()]


@functools.cache
def find() -> Blas:
    """torch's own BLAS entry points; never raises (``reason`` says what is missing)."""
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
        compute, pack, size = (
            getattr(lib, n, None) for n in ("cblas_sgemm_compute", "cblas_sgemm_pack", "cblas_sgemm_pack_get_size")
        )
        sgemm_at = ctypes.cast(sgemm, ctypes.c_void_p).value
        if compute is None or pack is None or size is None:
            return Blas(sgemm_at, None, f"sgemm from {path.name} (no packed GEMM)")
        pack.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        pack.restype = None
        size.argtypes, size.restype = [ctypes.c_int] * 4, ctypes.c_size_t
        return Blas(
            sgemm_at,
            ctypes.cast(compute, ctypes.c_void_p).value,
            f"MKL sgemm + packed GEMM from {path.name}",
            pack,
            size,
        )
    return Blas(None, None, "no BLAS found in torch's libraries" + (f" ({'; '.join(tried)})" if tried else ""))


def pack_policy() -> str:
    value = (os.environ.get(envs.DINFER_CPU_PACKED_WEIGHTS) or "small").strip().lower()
    if value not in PACK_POLICIES:
        raise ConfigError(
            f"{envs.DINFER_CPU_PACKED_WEIGHTS}={value!r} is not one of {', '.join(PACK_POLICIES)} "
            "(which fused projections get MKL's packed copy)"
        )
    return value


class PackedWeights:
    """Packed copies per weight tensor and column split, shared by every executable of the
    process (a model compiles several graph variants over the same weights) and dropped with
    the tensor."""

    def __init__(self, blas: Blas) -> None:
        self.blas = blas
        self._packed: dict[tuple, tuple[torch.Tensor, ...] | None] = {}

    def get(self, weight: torch.Tensor, bounds: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...] | None:
        """MKL's packed copy of each part ``weight[bounds[i]:bounds[i + 1]]`` (the row ranges the
        native GEMM hands its threads; default: the whole weight), or None where the policy or
        the BLAS says no."""
        bounds = bounds or (0, weight.shape[0])
        key = (id(weight), bounds)
        if key in self._packed:
            return self._packed[key]
        policy = pack_policy()
        small = weight.numel() * weight.element_size() <= SMALL_WEIGHT_BYTES
        packed = None
        if self.blas.compute is not None and (policy == "all" or (policy == "small" and small)):
            packed = tuple(self.blas.pack(weight[lo:hi]) for lo, hi in zip(bounds, bounds[1:]))
        self._packed[key] = packed
        weakref.finalize(weight, self._packed.pop, key, None)
        return packed


@functools.cache
def shared_packs() -> PackedWeights:
    """The process's packed-weight registry (one, so every executable shares the copies)."""
    return PackedWeights(find())
