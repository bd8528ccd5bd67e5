"""The BLAS self-check's child process (``blas.probe`` runs this file; nothing imports it).

Usage: ``python blas_probe.py NATIVE_LIBRARY BLAS_LIBRARY SYMBOL``. Hands the BLAS's ``sgemm_``
to the compiled native.c (``dinfer_set_blas``) and computes one small product through native.c's
own BLAS call (``dinfer_plan_linear_f32`` on an unpacked weight at fewer rows than the
transposed-input GEMM takes), then compares it with ``torch.mm``. Why a process of its own: a
BLAS with 64-bit integers can crash on that call, which must not take the caller with it.
Prints ``calling`` just before the call, then one JSON line ``{"ok": bool, "detail": str}``.
Needs only ctypes and torch (no dinfer_rt import: the check must not depend on what it checks).
"""

import sys
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # this folder's modules (blas.py, kernels.py, ...) must not shadow what torch imports

import ctypes  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

M, N, K = 3, 7, 5  # rows, outputs, inputs: all different, so a swapped dimension shows
GUARD = 64  # floats past the output that must stay untouched
SENTINEL = -12345.0
_P, _I = ctypes.c_void_p, ctypes.c_int64


class LinearPlan(ctypes.Structure):
    """native.c's ``dinfer_linear`` (as ``native.LinearPlan``; repeated so this file imports
    no dinfer_rt): no panels, so the call takes the BLAS."""

    _fields_ = [("weight", _P), ("panels", _P), ("bias", _P), ("n", _I), ("k", _I), ("bf16_panels", _P)]


def main(argv: list[str]) -> int:
    library, blas_path, symbol = argv
    lib = ctypes.CDLL(library)
    sgemm = getattr(ctypes.CDLL(blas_path), symbol)
    lib.dinfer_set_blas.argtypes = [_P]
    lib.dinfer_xt_min_rows.restype = lib.dinfer_xt_max_rows.restype = _I
    run = lib.dinfer_plan_linear_f32
    run.argtypes, run.restype = [_P, _P, _I, _P], ctypes.c_int
    if lib.dinfer_xt_min_rows() <= M <= lib.dinfer_xt_max_rows():  # an empty range: builds that never take it
        raise SystemExit(f"probe: {M} rows would take the transposed-input GEMM, not the BLAS")
    lib.dinfer_set_blas(ctypes.cast(sgemm, _P).value)
    # Small integers: every correct float32 BLAS gives the exact product.
    x = (torch.arange(M * K) % 7 - 3).float().reshape(M, K)
    w = (torch.arange(N * K) % 5 - 2).float().reshape(N, K)
    out = torch.full((M * N + GUARD,), SENTINEL)
    plan = LinearPlan(w.data_ptr(), None, None, N, K, None)
    print("calling", flush=True)
    rc = run(ctypes.addressof(plan), x.data_ptr(), M, out.data_ptr())
    want, got = torch.mm(x, w.t()), out[: M * N].reshape(M, N)
    if rc != 0:
        detail = f"failed in native.c (code {rc})"
    elif not torch.equal(out[M * N :], torch.full((GUARD,), SENTINEL)):
        detail = f"wrote past the {M} x {N} output of a {M} x {K} by {K} x {N} product"
    elif not torch.equal(got, want):
        err = (got - want).abs().nan_to_num(float("inf")).max().item()
        detail = f"gave a wrong {M} x {K} by {K} x {N} product (max error {err:g} against torch.mm)"
    else:
        detail = ""
    print(json.dumps({"ok": not detail, "detail": detail}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
