"""The BLAS reached from the native layer blocks, and its load-time self-check.

Why: the native layer blocks (``native.c``: a decoder layer in two calls) need a matmul for the
weights they do not pack into panels, and one is already in the process: torch's x86 CPU wheels
link MKL statically into ``libtorch_cpu.so`` and export its Fortran ``sgemm_``. No second BLAS
is loaded, so there is one thread pool and torch's ``set_num_threads`` applies.
``DINFER_CPU_BLAS`` names another library exporting ``sgemm_`` instead (e.g. an OpenBLAS build).

Why the self-check: native.c calls ``sgemm_`` with 32-bit integers (LP64). A BLAS built with
64-bit integers (ILP64) reads them with the next four bytes attached, so it crashes the process
or returns a wrong product; any other mismatch (a different symbol under the same name) gives a
wrong product. So before the native GEMMs use a BLAS, one small product goes through native.c's
own call into it and is compared with ``torch.mm``. The call runs in a child process
(``blas_probe.py``), since an in-process crash could not be caught; its verdict is cached next to
the compiled library, keyed by that build and the BLAS file (path, size, mtime), so a process
pays for it once per library build and BLAS, and a changed BLAS is checked again. A failed check
turns the native GEMMs off (the layer blocks and plain linears run in torch), with the reason
shown by ``dinfer-rt backends``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dinfer_rt import envs

PROBE = Path(__file__).with_name("blas_probe.py")
PROBE_TIMEOUT_S = 120.0
CALLING = "calling"  # what the probe prints just before its sgemm call (a crash after it is the BLAS's)
ILP64_HINT = "a likely cause: a BLAS built with 64-bit integers (ILP64) misreads native.c's 32-bit (LP64) ones"


@dataclass(frozen=True)
class Blas:
    """The address of ``sgemm_`` (None: no usable BLAS) and where it came from, or why not.
    ``path``: the library file it comes from (None when none was found)."""

    sgemm: int | None
    reason: str
    path: str | None = None
    symbol: str = "sgemm_"


def _candidates() -> list[Path]:
    lib = Path(torch.__file__).parent / "lib"
    return [p for p in (lib / "libtorch_cpu.so", lib / "libtorch_cpu.dylib") if p.exists()]


@functools.cache
def find() -> Blas:
    """``DINFER_CPU_BLAS``'s ``sgemm_``, else torch's own; unchecked (see :func:`checked`).
    Never raises (``reason`` says what is missing)."""
    override = envs.get(envs.DINFER_CPU_BLAS)
    if override is not None:
        return _override(override)
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
        return Blas(ctypes.cast(sgemm, ctypes.c_void_p).value, f"sgemm from {path.name}", str(path.resolve()))
    return Blas(None, "no BLAS found in torch's libraries" + (f" ({'; '.join(tried)})" if tried else ""))


def _override(value: str) -> Blas:
    """The ``sgemm_`` of the library ``DINFER_CPU_BLAS`` names (its file must exist: a bare name
    would be whatever the loader's search path finds first)."""
    where = f"{envs.DINFER_CPU_BLAS}={envs.shown(value)}"
    path = Path(value).expanduser()
    if not path.is_file():
        return Blas(None, f"{where}: no such library file")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return Blas(None, f"{where}: cannot be loaded ({e})")
    sgemm = getattr(lib, "sgemm_", None)
    if sgemm is None:
        return Blas(None, f"{where}: {path.name} exports no sgemm_ (the Fortran symbol native.c calls)")
    address = ctypes.cast(sgemm, ctypes.c_void_p).value
    return Blas(address, f"sgemm from {path} ({envs.DINFER_CPU_BLAS})", str(path.resolve()))


@functools.cache
def checked(library: str) -> Blas:
    """:func:`find`'s BLAS when native.c's call into it (the compiled ``library``) gave the
    product ``torch.mm`` gives; else ``Blas(None, why)``, the why naming the BLAS library. The
    verdict comes from the on-disk cache, else from a child process (:func:`probe`)."""
    found = find()
    if found.sgemm is None or found.path is None:
        return found
    try:
        cache: Path | None = verdict_path(Path(library), found)
    except OSError:  # the BLAS file or the probe vanished since: check, but keep no verdict
        cache = None
    verdict = None if cache is None else _read(cache)
    if verdict is None:
        verdict, final = probe(Path(library), found)
        if final and cache is not None:  # a passed or failed check, not a probe that could not run
            _write(cache, verdict)
    if verdict["ok"]:
        return Blas(found.sgemm, f"{found.reason}, self-checked against torch.mm", found.path, found.symbol)
    return Blas(None, verdict["reason"], found.path, found.symbol)


def verdict_path(library: Path, found: Blas) -> Path:
    """Where the verdict for this library build and this BLAS file lies: beside the library,
    named by a hash of the build (its file name hashes source, flags, compiler and CPU), the BLAS
    file's path, size and mtime, the symbol and the probe's own source."""
    stat = os.stat(found.path)
    parts = [library.name, found.path, str(stat.st_size), str(stat.st_mtime_ns), found.symbol, PROBE.read_text()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return library.parent / f"blas-check-{key}.json"


def _read(path: Path) -> dict | None:
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(verdict, dict) and isinstance(verdict.get("ok"), bool) and isinstance(verdict.get("reason"), str)
    return verdict if ok else None


def _write(path: Path, verdict: dict) -> None:
    """Atomically (a concurrent probe of the same key writes the same verdict); a cache that
    cannot be written only means the next process checks again."""
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(verdict, f)
        os.replace(f.name, path)
    except OSError:
        pass


def probe(library: Path, found: Blas) -> tuple[dict, bool]:
    """Run ``blas_probe.py`` on ``library`` with the BLAS ``found`` names: ({"ok", "reason"},
    final), final False when the probe could not run at all (no verdict on the BLAS)."""
    what = f"{found.symbol} from {found.path}"
    hint = f"; unset {envs.DINFER_CPU_BLAS} or point it at an LP64 build" if envs.get(envs.DINFER_CPU_BLAS) else ""
    cmd = [sys.executable, str(PROBE), str(library), str(found.path), found.symbol]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # a 3 x 5 x 7 product
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
        out, err, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        if CALLING in out.splitlines():  # stuck inside the BLAS call
            why = f"the BLAS self-check: {what} did not return within {PROBE_TIMEOUT_S:.0f} s ({ILP64_HINT}){hint}"
            return {"ok": False, "reason": why}, True
        return {"ok": False, "reason": f"the BLAS self-check of {what} timed out before its call; not checked"}, False
    except OSError as e:
        return {"ok": False, "reason": f"the BLAS self-check of {what} could not start {sys.executable}: {e}"}, False
    lines = out.splitlines()
    try:
        result = json.loads(lines[-1]) if rc == 0 and lines and lines[-1].startswith("{") else None
    except ValueError:
        result = None
    if isinstance(result, dict) and isinstance(result.get("ok"), bool):
        if result["ok"]:
            return {"ok": True, "reason": f"{what} matches torch.mm"}, True
        return {"ok": False, "reason": f"the BLAS self-check: {what} {result['detail']} ({ILP64_HINT}){hint}"}, True
    if rc < 0 and CALLING in lines:
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else f"signal {-rc}"
        why = f"the BLAS self-check crashed the probe process ({name}) inside {what} ({ILP64_HINT}){hint}"
        return {"ok": False, "reason": why}, True
    tail = " | ".join((err or out).strip().splitlines()[-2:])
    why = f"the BLAS self-check of {what} could not run (probe exit {rc}: {tail}); not checked"
    return {"ok": False, "reason": why}, False
