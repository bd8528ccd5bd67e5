"""The CPU backend's native kernels: ``native.c``, compiled once per machine, called through ctypes.

Why: on a small model at batch 1 a forward is dispatch-bound. Every torch op costs a few
microseconds however small its tensor, so RMSNorm (about seven ops), SwiGLU (three) or one
layer's rotary and K/V cache write (about fifteen) cost more than the matmuls between them; each
native function does one such group in one call. Large calls (a big batch) split their rows or
(row, kv head) pairs over OpenMP threads: the library is built with ``-fopenmp`` and so shares
the ``libgomp`` torch's CPU wheels bundle (one thread pool, sized by ``torch.set_num_threads``).
They take float32 CPU tensors; everything else goes to the torch kernels (``kernels.py``), and
``tests/test_cpu_native.py`` checks both against the float64 reference.

The source is compiled with the system C compiler (``$CC``, else ``cc``; well under a second)
into ``~/.cache/dinfer_rt/cpu-native/`` (``$XDG_CACHE_HOME`` respected), under a name that hashes
the source, the flags, the compiler's version and this CPU's feature flags, so a cache copied to
another machine is never loaded there. ``DINFER_CPU_NATIVE=0`` turns them off. Without a working
compiler the CPU backend says why (``dinfer-rt backends``) and runs the torch kernels; without
OpenMP support, or beside another OpenMP runtime than torch's, the kernels run on one thread.
The BLAS the layer blocks call is checked once per build and BLAS (``blas.checked``: one small
product against ``torch.mm`` in a child process); a mismatched one (e.g. ILP64) turns the layer
blocks and their GEMMs off, the reason in ``dinfer-rt backends``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from dinfer_rt import envs
from dinfer_rt.backends.cpu import blas
from dinfer_rt.errors import ConfigError
from dinfer_rt.ir.ops import OpTypeError

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno")
# Large calls split over OpenMP threads; torch's CPU wheels bundle libgomp.so.1, which the loader
# then shares with us (one thread pool). Without OpenMP support the build is retried without it.
OPENMP_FLAGS = ("-fopenmp",)
OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")
ABI = 11
# The native attention core splits its (row, kv head) pairs over torch's OpenMP threads and
# computes each pair's scores and outputs in register tiles of 4 query rows x 32 keys (values).
# Against native rotary + torch's SDPA, one call, 2 threads (session 17): 52 keys, 6 heads of 32:
# 50 rows x 52 queries 4.3 vs 7.2 ms, 50 x 20 0.91 vs 1.81, 1 x 52 0.10 vs 0.14; 12 heads of 64
# (the 134M benchmark model): 96 keys 0.52 vs 0.74 ms, 8 x 96 4.6 vs 5.6; but 288 keys 3.7 vs 4.0
# (one row) and 29.4 vs 27.7 ms (eight), 1056 keys 49 vs 32 ms: SDPA's blocked kernel wins once the
# keys are long. So the native core takes every call whose keys are at most MAX_NATIVE_KEYS, and
# longer ones up to MAX_NATIVE_SCORES query x key scores.
MAX_NATIVE_SCORES = 1 << 16
MAX_NATIVE_KEYS = 128

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "dinfer_rms_norm_f32": [_P, _P, _P, _I, _I, _F],
    "dinfer_swiglu_f32": [_P, _P, _I, _I],
    "dinfer_add_rms_norm_f32": [_P, _P, _P, _P, _P, _I, _I, _F],
    "dinfer_rope_qkv_f32": [_P, _I, _I, _I] * 3 + [_P, _I, _I, _P, _P, _I, _P, _P, _F] + [_I] * 5 + [_P] * 4 + [_I, _I],
    "dinfer_rope_attention_f32": [_P, _I, _I, _I] * 3
    + [_P, _I, _I, _P, _P, _I, _P, _P, _F]
    + [_I] * 5
    + [_P, _P, _P, _I, _I, _P, _F, _P],
}
_SIGNATURES |= {
    "dinfer_set_blas": [_P],
    "dinfer_attention_block_f32": [_P, _P, _I, _I, _P, _I, _I, _P, _P, _P, _P, _P, _I, _I, _P, _P],
    "dinfer_mlp_block_f32": [_P, _P, _P, _I, _P, _P],
    "dinfer_commit_f32": [_P, _P, _P, _P, _P, _I, _P, _I, _I, _F, ctypes.c_int],
    "dinfer_panel_floats": [_I, _I],
    "dinfer_pack_panels": [_P, _I, _I, _P],
    "dinfer_xt_linear_f32": [_P, _I, _I, _P, _I, _P],
    "dinfer_xt_min_rows": [],
    "dinfer_xt_max_rows": [],
    "dinfer_bf16_panels": [],
    "dinfer_native_vector_floats": [],
    "dinfer_plan_linear_f32": [_P, _P, _I, _P],
    "dinfer_panel_bf16_halves": [_I, _I],
    "dinfer_pack_panels_bf16": [_P, _I, _I, _P],
    "dinfer_lm_head_confidence_f32": [_P, _I, _I, _P, _I, _I, ctypes.c_int, _P, _P],
}
_RETURNS = {
    name: ctypes.c_int for name in ("dinfer_rope_attention_f32", "dinfer_attention_block_f32", "dinfer_mlp_block_f32")
}
_RETURNS |= {"dinfer_xt_linear_f32": ctypes.c_int}
_RETURNS |= {name: _I for name in ("dinfer_panel_floats", "dinfer_xt_min_rows", "dinfer_xt_max_rows")}
_RETURNS |= {"dinfer_lm_head_confidence_f32": ctypes.c_int}
_RETURNS |= {"dinfer_native_vector_floats": ctypes.c_int}
_RETURNS |= {"dinfer_bf16_panels": ctypes.c_int, "dinfer_panel_bf16_halves": _I, "dinfer_plan_linear_f32": ctypes.c_int}


class LinearPlan(ctypes.Structure):
    """``dinfer_linear``: a projection's weight [n, k], its panel-packed copy (or NULL: the
    BLAS), bias (or NULL) and its bfloat16 panels (or NULL; used first when there)."""

    _fields_ = [("weight", _P), ("panels", _P), ("bias", _P), ("n", _I), ("k", _I), ("bf16_panels", _P)]


class AttentionPlan(ctypes.Structure):
    """``dinfer_attention_plan``: one attention_block node's weights and attributes."""

    _fields_ = [
        ("qkv", LinearPlan), ("q_norm", _P), ("k_norm", _P), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
        ("rot", _I), ("eps", _F), ("scale", _F),
    ]  # fmt: skip


class MlpPlan(ctypes.Structure):
    """``dinfer_mlp_plan``: one mlp_block node's weights and attributes."""

    _fields_ = [
        ("o", LinearPlan), ("gate_up", LinearPlan), ("down", LinearPlan), ("norm", _P), ("out_norm", _P),
        ("dim", _I), ("hidden", _I), ("eps", _F),
    ]  # fmt: skip


@dataclass(frozen=True)
class Native:
    """The loaded library (``lib`` None when unavailable) and a one-line reason either way."""

    lib: ctypes.CDLL | None
    reason: str


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dinfer_rt" / "cpu-native"


def _compiler() -> tuple[str | None, str]:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        return None, f"no C compiler ({cc!r} not found on PATH; set CC)"
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"C compiler {path} does not run: {e}"
    return path, version.splitlines()[0] if version else path


def _build(cc: str, version: str, flags: tuple[str, ...]) -> tuple[Path | None, str]:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_flags().encode()]))
    target = _cache_dir() / f"native-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target, f"cached {target.name}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cc, *flags, str(SOURCE), "-o", str(out), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"compiling {SOURCE.name} failed: {e}"
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return None, f"compiling {SOURCE.name} with {cc} failed (exit {done.returncode}): {' | '.join(tail)}"
        os.replace(out, target)  # atomic: a concurrent build of the same key is harmless
    return target, f"built {target.name}"


@functools.cache
def load() -> Native:
    """The native library, built on first use; never raises (the reason says what went wrong)."""
    if (os.environ.get(envs.DINFER_CPU_NATIVE) or "1").strip().lower() in ("0", "false", "no", "off"):
        return Native(None, f"off ({envs.DINFER_CPU_NATIVE}=0)")
    return build()


def build(extra_flags: tuple[str, ...] = ()) -> Native:
    """Build (or find in the cache) and load the library, ``extra_flags`` after ``FLAGS``: the
    tests build it once more with ``-mno-avx512f`` / ``-mno-avx`` to check each vector width's
    register tiles on one machine. Never raises."""
    cc, version = _compiler()
    if cc is None:
        return Native(None, version)
    threaded = _open(cc, version, FLAGS + extra_flags + OPENMP_FLAGS)
    if threaded.lib is not None:
        return threaded
    plain = _open(cc, version, FLAGS + extra_flags)  # no OpenMP in this toolchain (or its runtime does not load)
    if plain.lib is None:
        return plain
    return Native(plain.lib, f"{plain.reason[:-1]}, one thread: the OpenMP build failed: {threaded.reason})")


def _open(cc: str, version: str, flags: tuple[str, ...]) -> Native:
    """Build (or find in the cache) and load the library with these flags."""
    try:
        path, how = _build(cc, version, flags)
    except OSError as e:
        return Native(None, f"cannot write the build cache {_cache_dir()}: {e}")
    if path is None:
        return Native(None, how)
    try:
        lib = ctypes.CDLL(str(path))
        if lib.dinfer_native_abi() != ABI:
            return Native(None, f"{path} has ABI {lib.dinfer_native_abi()}, expected {ABI}")
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, _RETURNS.get(name)
    except (OSError, AttributeError) as e:
        return Native(None, f"loading {path} failed: {e}")
    found = blas.checked(str(path))  # one small product against torch.mm, in a child process once per build/BLAS
    lib.dinfer_set_blas(found.sgemm)  # None after a failed check: the layer blocks refuse to run (-2)
    if lib.dinfer_native_openmp():
        runtimes = _openmp_runtimes()
        if len(runtimes) > 1:  # ours is not torch's: two thread pools would fight for the cores
            lib.dinfer_native_single_thread()
            how += f", one thread: a second OpenMP runtime ({', '.join(sorted(runtimes))})"
        else:
            how += ", OpenMP threads shared with torch"
    low, high = int(lib.dinfer_xt_min_rows()), int(lib.dinfer_xt_max_rows())
    xt = f"else a transposed-input GEMM at {low}-{high} rows, for other row counts" if low <= high else "else"
    blocks = (
        f"layer blocks: {lib.dinfer_native_vector_floats() * 32}-bit vectors; panel GEMM for packed weights "
        f"({envs.DINFER_CPU_PACKED_WEIGHTS}), {xt} {found.reason}; "
        f"{envs.DINFER_CPU_MATMUL}=bf16 {'available' if lib.dinfer_bf16_panels() else 'unavailable (no AVX512-BF16)'}"
        if found.sgemm is not None
        else f"layer blocks and their GEMMs off: {found.reason}"
    )
    return Native(lib, f"on ({version}, {how}; {blocks})")


def gemm_status() -> str:
    """``on (<the BLAS>)``, or ``off: why`` (no native library, no BLAS, or a BLAS that failed its
    self-check): whether the layer blocks and their GEMMs run, for the backend's capabilities."""
    lib = load().lib
    if lib is None:
        return f"off: the native kernels are off ({load().reason})"
    found = blas.checked(lib._name)
    return f"on ({found.reason})" if found.sgemm is not None else f"off: {found.reason}"


def _openmp_runtimes() -> set[str]:
    """Files of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    files = {line.split()[-1] for line in maps if "/" in line}
    return {f for f in files if Path(f).name.startswith(OPENMP_RUNTIMES)}


def _rows(x: torch.Tensor) -> bool:
    """float32, on the CPU, contiguous: what the row kernels read."""
    return x.dtype == torch.float32 and x.is_cpu and x.is_contiguous()


HEAD_MAX_WEIGHTS = 1 << 18
"""Elements of an LM-head weight the native confidence head takes (1 MB in float32): every row
reads all of it, so it must stay in L2; bigger vocabularies keep the chunked torch head, whose
logits are one GEMM."""

HEAD_MAX_WORK = 1 << 22
"""Multiply-adds above which the torch head's one GEMM wins (2000 x 31 x 192, the embedded model
at batch 50: 445 vs 390 us; 40 rows, batch 1: 16 vs 27 us)."""

HEAD_KINDS = {"max": 0, "margin": 1, "entropy": 2}

XT_MIN_WORK = 1 << 21
"""Multiply-adds below which a plain linear stays with torch: its OpenMP fork and the input's
transpose cost more than they save (40 x 31 x 192, the embedded LM head: 18 vs 11 us; equal at
32 x 256 x 256)."""


class NativeKernels:
    """Python faces of the native functions, each returning None when its inputs are not the
    float32 layout it handles (the caller then runs the torch kernel)."""

    def __init__(self, lib: ctypes.CDLL, matmul: str = "fp32") -> None:
        matmul = parse_matmul(matmul)
        if matmul == "bf16" and (why := bf16_unavailable(lib)):
            raise ConfigError(f"{envs.DINFER_CPU_MATMUL}=bf16: {why}")
        self.matmul = matmul  # "bf16": the layer blocks' projections in the bfloat16 panel GEMM
        self._rms = lib.dinfer_rms_norm_f32
        self._swiglu = lib.dinfer_swiglu_f32
        self._add_rms = lib.dinfer_add_rms_norm_f32
        self._rope = lib.dinfer_rope_qkv_f32
        self._attend = lib.dinfer_rope_attention_f32
        self._attention_block = lib.dinfer_attention_block_f32
        self._mlp_block = lib.dinfer_mlp_block_f32
        self._plan_linear = lib.dinfer_plan_linear_f32
        self._commit = lib.dinfer_commit_f32
        self._head = lib.dinfer_lm_head_confidence_f32
        self._xt_linear = lib.dinfer_xt_linear_f32
        self.xt_rows = (int(lib.dinfer_xt_min_rows()), int(lib.dinfer_xt_max_rows()))
        found = blas.checked(lib._name)  # cached: the verdict _open reached for this library
        self.blas = found if found.sgemm is not None else None  # None: no layer blocks (no BLAS, or it failed)
        self.panels = shared_panels(lib)
        self._plans: dict[tuple, tuple] = {}  # per fused node: (struct address, struct, its tensors)
        self._keep: list = []  # the packed copies the plans point at

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        if not (_rows(x) and _rows(weight)) or weight.shape[0] != x.shape[-1]:
            return None
        out = torch.empty_like(x)
        self._rms(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // max(x.shape[-1], 1), x.shape[-1], eps)
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """x W^T (+ b) through the transposed-input GEMM (W read where it lies, no packed copy):
        float32, ``xt_rows`` rows (8..128 in AVX-512 builds, none in narrower ones) and at least
        ``XT_MIN_WORK`` multiply-adds, where it beat torch's sgemm; None otherwise (the caller
        runs ``F.linear``)."""
        if not (_rows(x) and _rows(weight)) or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
            return None
        n, k = weight.shape
        rows = x.numel() // max(k, 1)
        if not self.xt_rows[0] <= rows <= self.xt_rows[1] or rows * n * k < XT_MIN_WORK:
            return None
        if bias is not None and (not _rows(bias) or bias.shape != (n,)):
            return None
        out = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        if self._xt_linear(weight.data_ptr(), n, k, x.data_ptr(), rows, out.data_ptr()):
            raise MemoryError(f"native linear: no memory for the transposed input ({rows} x {k})")
        return out if bias is None else out.add_(bias)

    def lm_head_confidence(self, h: torch.Tensor, weight: torch.Tensor, banned: int, kind: str):
        """(score, argmax) over h's rows for a small vocabulary (``HEAD_MAX_WEIGHTS``) in one
        native call; None when not handled (the chunked torch head runs instead)."""
        if kind not in HEAD_KINDS or not (_rows(h) and _rows(weight)) or weight.dim() != 2:
            return None
        v, k = weight.shape
        rows = h.numel() // max(k, 1)
        if h.shape[-1] != k or v < 2 or v * k > HEAD_MAX_WEIGHTS or rows * v * k > HEAD_MAX_WORK or banned < 0:
            return None
        conf = torch.empty(h.shape[:-1], dtype=torch.float32)
        token = torch.empty(h.shape[:-1], dtype=torch.int64)
        if self._head(h.data_ptr(), rows, k, weight.data_ptr(), v, banned, HEAD_KINDS[kind], conf.data_ptr(),
                      token.data_ptr()):  # fmt: skip
            raise MemoryError(f"native lm_head_confidence: no memory for a row's {v} logits")
        return conf, token

    def swiglu(self, h: torch.Tensor) -> torch.Tensor | None:
        if not _rows(h) or h.shape[-1] % 2:
            return None
        half = h.shape[-1] // 2
        out = torch.empty((*h.shape[:-1], half), dtype=h.dtype)
        self._swiglu(h.data_ptr(), out.data_ptr(), h.numel() // max(2 * half, 1), half)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        if not (_rows(x) and _rows(residual) and _rows(weight)) or x.shape != residual.shape:
            return None
        if weight.shape[0] != x.shape[-1]:
            return None
        out, total = torch.empty_like(x), torch.empty_like(x)
        dim = x.shape[-1]
        self._add_rms(
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), total.data_ptr(),
            x.numel() // max(dim, 1), dim, eps,
        )  # fmt: skip
        return out, total

    def rope_qkv(self, q, k, v, positions, cos, sin, q_norm, k_norm, eps, slots, k_cache, v_cache):
        """Rotated q [B, H, T, D] and the keys / values: written into the caches at ``slots`` (then
        None, None is returned for them) or laid out [B, KV, T, D]. None when not handled."""
        f32 = torch.float32
        qs, ks, vs, ps = q.stride(), k.stride(), v.stride(), positions.stride()
        if q.dtype != f32 or k.dtype != f32 or v.dtype != f32 or qs[3] != 1 or ks[3] != 1 or vs[3] != 1:
            return None
        if positions.dtype != torch.int64 or any(t is not None and not _rows(t) for t in (q_norm, k_norm)):
            return None
        b, t, h, d = q.shape
        kv = k.shape[2]
        q_out = torch.empty((b, h, t, d), dtype=f32)
        if k_cache is None:
            k_out, v_out = torch.empty((b, kv, t, d), dtype=f32), torch.empty((b, kv, t, d), dtype=f32)
            slot_ptr, sb, s = None, 0, 0
        else:
            if not (_rows(k_cache) and _rows(v_cache)) or slots.dtype != torch.int64 or not slots.is_contiguous():
                return None
            k_out, v_out = k_cache, v_cache
            slot_ptr, sb, s = slots.data_ptr(), (t if slots.dim() == 2 else 0), k_cache.shape[1]
        self._rope(
            q.data_ptr(), qs[0], qs[1], qs[2], k.data_ptr(), ks[0], ks[1], ks[2], v.data_ptr(), vs[0], vs[1], vs[2],
            positions.data_ptr(), ps[0], ps[1], cos.data_ptr(), sin.data_ptr(), cos.shape[1],
            None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(), eps,
            b, t, h, kv, d, q_out.data_ptr(), k_out.data_ptr(), v_out.data_ptr(), slot_ptr, sb, s,
        )  # fmt: skip
        if k_cache is None:
            return q_out, k_out, v_out
        return q_out, None, None

    def rope_attention(
        self, q, k, v, positions, cos, sin, q_norm, k_norm, eps, slots, k_cache, v_cache, key_valid, scale
    ):
        """The whole attention op (no block-causal rule) as one native call: out [B, T, H, D], the
        caches written at ``slots`` when given. None when not handled (layout, or long keys in
        a big call: SDPA's territory)."""
        f32 = torch.float32
        b, t, h, d = q.shape
        kv = k.shape[2]
        qs, ks, vs = q.stride(), k.stride(), v.stride()
        if q.dtype != f32 or k.dtype != f32 or v.dtype != f32 or qs[3] != 1 or ks[3] != 1 or vs[3] != 1:
            return None
        target = _attention_target(b, t, h, kv, d, positions, q_norm, k_norm, slots, k_cache, v_cache, key_valid)
        if target is None:
            return None
        keys, values, slot_ptr, sb, n = target
        ps = positions.stride()
        out = torch.empty((b, t, h, d), dtype=f32)
        failed = self._attend(
            q.data_ptr(), qs[0], qs[1], qs[2], k.data_ptr(), ks[0], ks[1], ks[2], v.data_ptr(), vs[0], vs[1], vs[2],
            positions.data_ptr(), ps[0], ps[1], cos.data_ptr(), sin.data_ptr(), cos.shape[1],
            _ptr(q_norm), _ptr(k_norm), eps, b, t, h, kv, d, keys.data_ptr(), values.data_ptr(), slot_ptr, sb, n,
            key_valid.data_ptr(), scale, out.data_ptr(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"native attention: no memory for its {d} x {n} key scratch")
        return out

    # ------------------------------------------------------------ layer blocks
    def attention_block(self, x, w, bias, key_valid, slots, positions, q_norm, k_norm, k_cache, v_cache, cos, sin, *,
                        heads, kv_heads, scale, rotary_dim, eps):  # fmt: skip
        """``attention_block`` (no block-causal rule) as one native call: out [B, T, heads * D].
        None when not handled (the caller composes the op from the other kernels)."""
        d = w.shape[0] // (heads + 2 * kv_heads)
        weights = (w, bias, q_norm, k_norm)
        key = (*_identity(weights), heads, kv_heads, d, rotary_dim, eps, scale)
        plan = self._plans.get(key)
        if plan is None:  # first call with these weights (or they changed in place)
            plan = self._plans[key] = self._attention_plan(w, bias, q_norm, k_norm, heads, kv_heads, d, rotary_dim,
                                                           eps, scale)  # fmt: skip
        if not plan or not _rows(x) or x.dim() != 3 or x.shape[0] * x.shape[1] >= 1 << 31:
            return None
        b, t = x.shape[:2]
        target = _attention_target(b, t, heads, kv_heads, d, positions, None, None, slots, k_cache, v_cache, key_valid,
                                   scratch=False)  # fmt: skip
        if target is None:
            return None
        keys, values, slot_ptr, sb, n = target
        ps = positions.stride()
        out = torch.empty((b, t, heads * d), dtype=torch.float32)
        failed = self._attention_block(
            plan[0], x.data_ptr(), b, t, positions.data_ptr(), ps[0], ps[1], cos.data_ptr(), sin.data_ptr(),
            _ptr(keys), _ptr(values), slot_ptr, sb, n, key_valid.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"native attention_block: no memory for its scratch ({b} x {t} rows, {n} keys)")
        return out

    def projection(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x W^T (+ b) through the GEMM a layer block would use for W (bfloat16 or float32
        panels where packed, else the transposed-input GEMM or the BLAS): the Q/K/V projection
        of an attention_block whose attention core is left to torch. None when not handled."""
        key = (*_identity((w, bias)), "projection")
        plan = self._plans.get(key)
        if plan is None:
            ok = self.blas is not None and _rows(w) and w.dim() == 2 and (bias is None or _rows(bias))
            struct = self._linear(w, bias) if ok else None
            plan = self._plans[key] = (ctypes.addressof(struct), struct, w, bias) if ok else ()
        if not plan or not _rows(x) or x.shape[-1] != w.shape[1] or x.numel() // w.shape[1] >= 1 << 31:
            return None
        rows = x.numel() // w.shape[1]
        out = torch.empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)
        if self._plan_linear(plan[0], x.data_ptr(), rows, out.data_ptr()):
            raise MemoryError(f"native projection: no memory for its scratch ({rows} rows x {w.shape[1]})")
        return out

    def _attention_plan(self, w, bias, q_norm, k_norm, heads, kv_heads, d, rotary_dim, eps, scale) -> tuple:
        """(struct address, struct, the tensors it points at), or () when the weights are not a
        layout the native block reads (checked once per weight set, not per call)."""
        if self.blas is None or not _rows(w) or any(v is not None and not _rows(v) for v in (bias, q_norm, k_norm)):
            return ()
        struct = AttentionPlan(self._linear(w, bias), _ptr(q_norm), _ptr(k_norm), heads, kv_heads, d, rotary_dim, eps,
                               scale)  # fmt: skip
        return (ctypes.addressof(struct), struct, w, bias, q_norm, k_norm)

    def mlp_block(self, attn, w_o, b_o, residual, w_norm, w_gate_up, w_down, w_out_norm, eps):
        """``mlp_block`` as one native call: (normed, residual stream), or None when not handled."""
        weights = (w_o, b_o, w_norm, w_gate_up, w_down, w_out_norm)
        key = (*_identity(weights), eps)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._mlp_plan(*weights, eps)
        if not plan or not (_rows(attn) and _rows(residual)):
            return None
        dim, hidden = residual.shape[-1], w_down.shape[1]
        rows = residual.numel() // max(dim, 1)
        if attn.numel() != rows * w_o.shape[1] or attn.shape[:-1] != residual.shape[:-1] or rows >= 1 << 31:
            return None
        normed, total = torch.empty_like(residual), torch.empty_like(residual)
        failed = self._mlp_block(
            plan[0], attn.data_ptr(), residual.data_ptr(), rows, normed.data_ptr(), total.data_ptr()
        )
        if failed:
            raise MemoryError(f"native mlp_block: no memory for its scratch ({rows} rows x {hidden} hidden)")
        return normed, total

    def _mlp_plan(self, w_o, b_o, w_norm, w_gate_up, w_down, w_out_norm, eps) -> tuple:
        """As ``_attention_plan``, for one mlp_block node's weights."""
        tensors = (w_o, w_norm, w_gate_up, w_down, w_out_norm)
        if self.blas is None or not all(_rows(v) for v in tensors) or (b_o is not None and not _rows(b_o)):
            return ()
        dim, hidden = w_o.shape[0], w_down.shape[1]
        if w_gate_up.shape != (2 * hidden, dim) or w_down.shape[0] != dim or w_norm.shape[0] != dim:
            return ()
        struct = MlpPlan(
            self._linear(w_o, b_o), self._linear(w_gate_up, None), self._linear(w_down, None),
            w_norm.data_ptr(), w_out_norm.data_ptr(), dim, hidden, eps,
        )  # fmt: skip
        return (ctypes.addressof(struct), struct, *tensors, b_o)

    # ------------------------------------------------------------ commit decision
    def commit(self, conf, masked, quota, x0, x_block, *, rule: str, threshold: float = 0.9) -> torch.Tensor:
        """The scheduler's device-side commit (``Backend.commit_kernel``) as one native call:
        writes the committed ``x0`` into ``x_block`` ([B, L] view of the sequence) and returns
        the [B, L] commit mask; the same decisions as ``strategies`` threshold / low_confidence."""
        if rule not in ("top_k", "threshold"):
            raise ValueError(f"commit: unknown rule {rule!r} (top_k, threshold)")
        b, n = conf.shape
        if x_block.dtype != torch.int64 or x_block.stride(-1) != 1 or tuple(x_block.shape) != (b, n):
            raise ValueError(f"commit: x_block must be an int64 [{b}, {n}] view with unit stride in L")
        masked, quota, x0 = masked.bool().contiguous(), quota.long().contiguous(), x0.long().contiguous()
        if conf.dtype != torch.float32:  # a float64 model: decide at its precision
            from dinfer_rt import strategies

            pick = strategies._top_quota if rule == "top_k" else strategies.threshold_commit
            out = pick(conf, masked, quota) if rule == "top_k" else pick(conf, masked, threshold)
            x_block.copy_(torch.where(out, x0, x_block))
            return out
        conf = conf.contiguous()
        out = torch.empty((b, n), dtype=torch.bool)
        self._commit(
            conf.data_ptr(), masked.data_ptr(), quota.data_ptr(), x0.data_ptr(), x_block.data_ptr(),
            x_block.stride(0), out.data_ptr(), b, n, threshold, rule == "top_k",
        )  # fmt: skip
        return out

    def _linear(self, w: torch.Tensor, bias: torch.Tensor | None) -> LinearPlan:
        if self.matmul == "bf16":
            half = self.panels.get_bf16(w)
            self._keep.append(half)
            return LinearPlan(w.data_ptr(), None, _ptr(bias), w.shape[0], w.shape[1], _ptr(half))
        panels = self.panels.get(w)
        self._keep.append(panels)
        return LinearPlan(w.data_ptr(), _ptr(panels), _ptr(bias), w.shape[0], w.shape[1], None)


def _identity(tensors) -> tuple:
    """Which tensors, in which state: ids and in-place versions (a plan and its packed copies
    are rebuilt when a weight is modified in place, never read stale)."""
    return tuple([(id(t), t._version) if t is not None else None for t in tensors])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _attention_target(b, t, h, kv, d, positions, q_norm, k_norm, slots, k_cache, v_cache, key_valid, scratch=True):
    """Where a native attention call writes its keys / values and which slots: (keys, values,
    slot pointer, slot row stride, key count), or None when the layout is not one it reads or
    the call is too big for the native core (long keys in a big call: SDPA's territory). Without
    a cache the keys / values are scratch tensors, or (``scratch=False``: the layer block, which
    allocates its own) None."""
    n = t if k_cache is None else k_cache.shape[1]
    if n > MAX_NATIVE_KEYS and b * t * h * n > MAX_NATIVE_SCORES:
        return None
    if key_valid.dtype != torch.bool or not key_valid.is_contiguous() or tuple(key_valid.shape) != (b, n):
        return None
    if positions.dtype != torch.int64 or any(x is not None and not _rows(x) for x in (q_norm, k_norm)):
        return None
    if k_cache is None:
        if not scratch:
            return None, None, None, 0, n
        f32 = torch.float32
        return torch.empty((b, t, kv, d), dtype=f32), torch.empty((b, t, kv, d), dtype=f32), None, 0, n
    if not (_rows(k_cache) and _rows(v_cache)) or slots.dtype != torch.int64 or not slots.is_contiguous():
        return None
    return k_cache, v_cache, slots.data_ptr(), (t if slots.dim() == 2 else 0), n


# ---------------------------------------------------------------- panel-packed weights

MATMUL_PRECISIONS = ("fp32", "bf16")


def parse_matmul(setting: str | None) -> str:
    """A ``DINFER_CPU_MATMUL`` value checked (unset or empty: ``fp32``): the precision of the
    layer blocks' projections (the cpu backend reads the variable when it is selected)."""
    value = (setting or "fp32").strip().lower()
    if value not in MATMUL_PRECISIONS:
        raise ConfigError(
            f"{envs.DINFER_CPU_MATMUL}={value!r} is not one of {', '.join(MATMUL_PRECISIONS)} "
            "(the precision of the cpu backend's layer-block matmuls)"
        )
    return value


def bf16_unavailable(lib: ctypes.CDLL | None) -> str:
    """Why the bfloat16 panel GEMM cannot run here ('' when it can)."""
    if lib is None:
        return f"the native kernels are off ({load().reason})"
    if not lib.dinfer_bf16_panels():
        flags = _cpu_flags()
        has = "avx512_bf16" in flags.split()
        return (
            "native.c was built without AVX512-BF16 "
            + ("although this CPU reports avx512_bf16 (a compiler without -mavx512bf16?)" if has else
               "(this CPU does not report avx512_bf16)")
        )  # fmt: skip
    if (found := blas.checked(lib._name)).sgemm is None:
        return f"the layer blocks are off ({found.reason})"
    return ""


SMALL_WEIGHT_BYTES = 1 << 20
PACK_POLICIES = ("small", "all", "off")


def pack_policy() -> str:
    """``DINFER_CPU_PACKED_WEIGHTS``: which layer-block projections get a panel-packed copy."""
    value = (os.environ.get(envs.DINFER_CPU_PACKED_WEIGHTS) or "small").strip().lower()
    if value not in PACK_POLICIES:
        raise ConfigError(
            f"{envs.DINFER_CPU_PACKED_WEIGHTS}={value!r} is not one of {', '.join(PACK_POLICIES)} "
            "(which layer-block projections get a panel-packed copy)"
        )
    return value


class PanelWeights:
    """The panel-packed copy (native.c's ``dinfer_pack_panels``: the layout the panel GEMM
    reads) of each weight the policy packs, one per tensor for every executable of the process
    (a model compiles several graph variants over the same weights), dropped with the tensor.

    The copy costs the weight's bytes again, so by default only weights of at most
    ``SMALL_WEIGHT_BYTES`` are packed: the small-model regime where the GEMM's speed is most of
    a step and the extra memory is a few MB. ``all`` packs every fused projection (a 134M model:
    +536 MB), ``off`` none (every matmul through the BLAS)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._size, self._pack = lib.dinfer_panel_floats, lib.dinfer_pack_panels
        self._size_bf16, self._pack_bf16 = lib.dinfer_panel_bf16_halves, lib.dinfer_pack_panels_bf16
        self._packed: dict[tuple, torch.Tensor | None] = {}

    def get_bf16(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight's bfloat16 panels (``dinfer_pack_panels_bf16``; half its float32 bytes),
        packed for every float32 weight whatever ``DINFER_CPU_PACKED_WEIGHTS`` says: the bfloat16
        GEMM has no unpacked form."""
        key = (id(weight), weight._version, "bf16")
        if key not in self._packed:
            if not (_rows(weight) and weight.dim() == 2):
                raise OpTypeError(f"bf16 panels: weight {list(weight.shape)} {weight.dtype} is not a float32 matrix")
            n, k = weight.shape
            half = torch.empty(self._size_bf16(n, k), dtype=torch.int16)
            self._pack_bf16(weight.data_ptr(), n, k, half.data_ptr())
            self._packed[key] = half
            weakref.finalize(weight, self._packed.pop, key, None)
        return self._packed[key]

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        key = (id(weight), weight._version)  # modified in place: packed again
        if key in self._packed:
            return self._packed[key]
        policy = pack_policy()
        small = weight.numel() * weight.element_size() <= SMALL_WEIGHT_BYTES
        panels = None
        if _rows(weight) and weight.dim() == 2 and (policy == "all" or (policy == "small" and small)):
            n, k = weight.shape
            panels = torch.empty(self._size(n, k), dtype=torch.float32)
            self._pack(weight.data_ptr(), n, k, panels.data_ptr())
        self._packed[key] = panels
        weakref.finalize(weight, self._packed.pop, key, None)
        return panels


_PANELS: dict[int, PanelWeights] = {}


def shared_panels(lib: ctypes.CDLL) -> PanelWeights:
    """The process's panel registry for this library (one, so every executable shares copies)."""
    key = id(lib)
    if key not in _PANELS:
        _PANELS[key] = PanelWeights(lib)
    return _PANELS[key]
