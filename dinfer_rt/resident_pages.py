"""Hand the resident pages of tensors nothing reads any more back to the OS (Linux).

Checkpoint tensors are memory-mapped (safetensors), one mapping per file that lives as long as
any tensor read from it. When a fusion pass concatenates weights (QKV, gate + up) the sources'
pages have been read once and stay resident in that mapping although every graph now reads the
merged copy: the process would hold those weights twice (on the 134M benchmark model, ~230 MB).
``MADV_PAGEOUT`` reclaims such pages without changing what the memory holds (clean file pages
are dropped and re-read on a later access; anonymous pages without swap stay), so calling it on
any tensor is safe: at worst it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys

import torch

MADV_PAGEOUT = 21  # Linux >= 5.4; older kernels answer EINVAL, which is ignored


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def page_out(tensors: list[torch.Tensor]) -> int:
    """Advise the kernel to reclaim the whole pages under each CPU tensor; returns the bytes
    advised (0 where unsupported). Values are unchanged: a later read faults the pages back in."""
    madvise = _madvise()
    if madvise is None:
        return 0
    page, advised = mmap.PAGESIZE, 0
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        start = t.data_ptr()
        end = start + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
        lo, hi = -(-start // page) * page, (end // page) * page  # whole pages inside the tensor only
        if hi > lo and madvise(lo, hi - lo, MADV_PAGEOUT) == 0:
            advised += hi - lo
    return advised
