"""Op conformance: run every case of the op database on a backend's kernels and compare with
the float64 reference; tolerances and known failures come from the JSON files beside this."""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dinfer_rt.backend import Backend
from dinfer_rt.ir import OPS, TensorType
from dinfer_rt.validation.opdb import OpCase, cases

HERE = Path(__file__).parent
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64"}


def load_json(name: str) -> dict:
    return json.loads((HERE / name).read_text())


def tolerance(op: str, dtype: torch.dtype, backend: str, table: dict | None = None) -> dict:
    """Default per dtype, then per-op, then per-backend overrides (each may relax the last)."""
    table = table or load_json("tolerances.json")
    name = DTYPE_NAMES[dtype]
    tol = dict(table["default"][name])
    for layer in (table.get("ops", {}).get(op, {}), table.get("backends", {}).get(backend, {})):
        if name in layer:
            tol.update({k: v for k, v in layer[name].items() if k != "reason"})
    return tol


@dataclass
class OpResult:
    op: str
    bucket: str
    dtype: str
    status: str  # pass | fail | xfail | unexpected-pass | error
    max_rel: float
    index_mismatch: float
    tolerance: dict
    kernel: str  # native | plugin:X | fallback:...
    detail: str = ""


def _seed(key: str) -> int:
    return zlib.crc32(key.encode())


def _prepare(case: OpCase, ins: list, dtype: torch.dtype, device: torch.device) -> list:
    out = []
    for i, x in enumerate(ins):
        if x is None:
            out.append(None)
            continue
        if i in case.float_inputs:
            x = x.to(dtype)
        elif i in case.keep_fp32_inputs:
            x = x.to(torch.float64 if dtype == torch.float64 else torch.float32)
        out.append(x.clone().to(device))
    return out


def _shape(t) -> str:
    return "(" + ",".join(str(d) for d in t.shape) + ")"


def expected_dtypes(case: OpCase, ins: list) -> list[torch.dtype] | None:
    """The output dtypes the op's own inference gives for the inputs as the backend got them
    (None where inference does not answer: the dtype is then not checked)."""
    types = [None if x is None else TensorType(tuple(x.shape), x.dtype) for x in ins]
    try:
        return [t.dtype for t in OPS[case.op].infer(types, case.attrs)]
    except Exception:
        return None


def compare(got, want, tol: dict, dtypes: list[torch.dtype] | None = None) -> tuple[float, float, str]:
    """(max error relative to the reference scale, fraction of mismatching integers, note). A wrong
    number of outputs, a wrong shape or (given ``dtypes``, the inferred ones) a wrong dtype is an
    infinite error with a note naming the output."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    if len(got) != len(want):
        return float("inf"), 1.0, f"{len(got)} output(s) != reference {len(want)}"
    worst, mism, note = 0.0, 0.0, ""
    for i, (a, b) in enumerate(zip(got, want)):
        if not isinstance(a, torch.Tensor):
            return float("inf"), 1.0, f"output {i} is {type(a).__name__}, not a tensor"
        a = a.detach().cpu()
        if tuple(a.shape) != tuple(b.shape):
            return float("inf"), 1.0, f"output {i} shape {_shape(a)} != reference {_shape(b)}"
        if dtypes is not None and i < len(dtypes) and a.dtype != dtypes[i]:
            return float("inf"), 1.0, f"output {i} dtype {a.dtype} != {dtypes[i]} (the op's inferred type)"
        if b.dtype.is_floating_point:
            err = (a.double() - b).abs()
            rel = (err.max() / b.abs().max().clamp_min(1e-30)).item() if err.numel() else 0.0
            if rel > worst:
                worst = rel
                flat = int(err.argmax())
                at = [int(j) for j in torch.unravel_index(torch.tensor(flat), b.shape)]
                got_v, ref_v = a.flatten()[flat].item(), b.flatten()[flat].item()
                note = f"output {i}: worst element {at} = {got_v:.6g}, reference {ref_v:.6g}"
        else:  # integer outputs (expert indices): compare as sets per row
            same = (a.sort(-1).values == b.sort(-1).values).all(-1) if a.dim() else a == b
            mism = max(mism, 1.0 - same.double().mean().item())
    return worst, mism, note


def run_case(case: OpCase, backend: Backend, dtype: torch.dtype, table: dict, known: dict) -> OpResult:
    tol = tolerance(case.op, dtype, backend.name, table)
    key = f"{case.key}/{DTYPE_NAMES[dtype]}"
    g = torch.Generator().manual_seed(_seed(case.key))
    ins = case.build(g)
    want = OPS[case.op].reference(*[None if x is None else x.clone() for x in ins], **case.attrs)
    source = "missing"
    try:  # a malformed kernel table, a raising kernel or a wrong output is a result, not an abort
        kernel, source = backend.kernel_table().get(case.op, (None, "missing"))
        if kernel is None:
            raise RuntimeError(f"backend {backend.name} has no kernel for {case.op}")
        prepared = _prepare(case, ins, dtype, backend.device())
        dtypes = expected_dtypes(case, prepared)
        got = kernel(*prepared, **case.attrs)
        rel, mism, note = compare(got, want, tol, dtypes)
        ok = rel <= tol["rel"] and mism <= tol.get("index_mismatch", 0.0)
        status = "pass" if ok else "fail"
    except Exception as e:
        rel, mism, note, status = float("inf"), 1.0, f"{type(e).__name__}: {e}", "error"
    reason = known.get(backend.name, {}).get(key)
    if reason is not None:
        status = "unexpected-pass" if status == "pass" else "xfail"
        note = f"known failure: {reason}" + (f" ({note})" if note else "")
    return OpResult(case.op, case.bucket, DTYPE_NAMES[dtype], status, rel, mism, tol, source, note)


def run_conformance(backend: Backend, dtypes: list[torch.dtype], quick: bool = False, progress=None) -> list[dict]:
    table, known = load_json("tolerances.json"), load_json("known_failures.json")["backends"]
    results = []
    supported = [d for d in dtypes if d in backend.capabilities().dtypes]
    for case in cases(quick):
        for dtype in supported:
            results.append(asdict(run_case(case, backend, dtype, table, known)))
            if progress:
                progress()
    return results
