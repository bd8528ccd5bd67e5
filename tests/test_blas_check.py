"""The load-time self-check of the BLAS the cpu backend's layer blocks call (#37 point 7): one
small product through native.c's own ``sgemm_`` call, in a child process, against ``torch.mm``.
torch's own BLAS passes and the layer blocks stay on; a planted bad BLAS (``DINFER_CPU_BLAS`` at
a library built here: a wrong product, a crash, a real ILP64 signature) turns the layer blocks and
their GEMMs off with a reason naming the library, the process survives, and a model's logits
still match the float64 reference (torch runs the matmuls). The verdict is cached beside the
compiled library and taken again when the BLAS file changes."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dinfer_rt
from dinfer_rt import envs
from dinfer_rt.backends.cpu import blas, native
from dinfer_rt.backends.cpu.backend import CpuBackend
from dinfer_rt.errors import ConfigError
from dinfer_rt.loader import EMBEDDED_MODEL

# A naive column-major sgemm_. OFFSET 1: every output one too big; CRASH: SIGSEGV on the call
# (what an ILP64 BLAS reading past 32-bit dimensions does); INT int64_t: a real ILP64 signature.
SHIM = r"""
#include <signal.h>
#include <stdint.h>
void sgemm_(const char *ta, const char *tb, const INT *m, const INT *n, const INT *k, const float *alpha,
            const float *a, const INT *lda, const float *b, const INT *ldb, const float *beta, float *c,
            const INT *ldc) {
#ifdef CRASH
    raise(SIGSEGV);
#endif
    for (INT j = 0; j < *n; j++)
        for (INT i = 0; i < *m; i++) {
            float s = 0;
            for (INT l = 0; l < *k; l++) {
                float av = (*ta == 'T' || *ta == 't') ? a[l + i * *lda] : a[i + l * *lda];
                float bv = (*tb == 'T' || *tb == 't') ? b[j + l * *ldb] : b[l + j * *ldb];
                s += av * bv;
            }
            c[i + j * *ldc] = *alpha * s + (*beta == 0 ? 0 : *beta * c[i + j * *ldc]) + OFFSET;
        }
}
"""
SHIMS = {
    "good": ["-DINT=int", "-DOFFSET=0"],
    "wrong": ["-DINT=int", "-DOFFSET=1"],
    "crash": ["-DINT=int", "-DOFFSET=0", "-DCRASH"],
    "ilp64": ["-DINT=int64_t", "-DOFFSET=0"],
}
BLOCKS = ("attention_block", "mlp_block")


@pytest.fixture(scope="module")
def shims(tmp_path_factory) -> dict[str, Path]:
    cc = shutil.which(os.environ.get("CC") or "cc")
    assert cc is not None, "the cpu backend's native kernels need a C compiler; so do these shims"
    folder = tmp_path_factory.mktemp("shims")
    (folder / "shim.c").write_text(SHIM)
    out = {}
    for name, flags in SHIMS.items():
        out[name] = folder / f"lib{name}blas.so"
        subprocess.run(
            [cc, "-O1", "-fPIC", "-shared", *flags, str(folder / "shim.c"), "-o", str(out[name])], check=True
        )
    return out


CACHED = (blas.find, blas.checked, native.load)  # the originals, also while a test replaces one


def _clear() -> None:
    for fn in CACHED:
        fn.cache_clear()


@pytest.fixture
def fresh(monkeypatch, tmp_path) -> Path:
    """A build cache of its own (``XDG_CACHE_HOME``) holding a copy of this machine's compiled
    library (no rebuild; a separate copy, so its BLAS pointer is its own), no verdict yet; the
    process-wide caches cleared before and after."""
    built = native.load()
    assert built.lib is not None, built.reason
    folder = tmp_path / "dinfer_rt" / "cpu-native"
    folder.mkdir(parents=True)
    shutil.copy2(built.lib._name, folder / Path(built.lib._name).name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(envs.DINFER_CPU_BLAS, raising=False)
    monkeypatch.delenv(envs.DINFER_CPU_NATIVE, raising=False)
    _clear()
    yield folder
    _clear()


def _verdicts(folder: Path) -> list[str]:
    return sorted(p.read_text() for p in folder.glob("blas-check-*.json"))


def _blas_call(lib) -> int:
    """native.c's BLAS path called directly (3 rows, no panels): -2 when no BLAS is set."""
    x, w, y = torch.ones(3, 5), torch.ones(7, 5), torch.zeros(3, 7)
    plan = native.LinearPlan(w.data_ptr(), None, None, 7, 5, None)
    return lib.dinfer_plan_linear_f32(ctypes.addressof(plan), x.data_ptr(), 3, y.data_ptr())


def test_torch_blas_passes_and_the_layer_blocks_stay_on(fresh):
    loaded = native.load()
    assert loaded.lib is not None and Path(loaded.lib._name).parent == fresh
    status = native.gemm_status()
    assert status.startswith("on (sgemm from libtorch_cpu.so, self-checked against torch.mm"), status
    assert native.NativeKernels(loaded.lib).blas is not None
    assert set(BLOCKS) <= set(CpuBackend().kernels())
    assert CpuBackend().capabilities().extra["native_gemms"] == status
    assert "self-checked against torch.mm" in CpuBackend().is_available().reason
    [verdict] = _verdicts(fresh)
    assert '"ok": true' in verdict and "libtorch_cpu" in verdict
    assert _blas_call(loaded.lib) == 0


def test_a_good_blas_named_by_the_variable_is_used(fresh, shims, monkeypatch):
    monkeypatch.setenv(envs.DINFER_CPU_BLAS, str(shims["good"]))
    assert native.gemm_status() == f"on (sgemm from {shims['good']} (DINFER_CPU_BLAS), self-checked against torch.mm)"
    assert set(BLOCKS) <= set(CpuBackend().kernels())


@pytest.mark.parametrize(
    "shim, what",
    [
        ("wrong", "gave a wrong 3 x 5 by 5 x 7 product (max error 1 against torch.mm)"),
        ("crash", "crashed the probe process (SIGSEGV) inside sgemm_"),
        ("ilp64", "crashed the probe process"),  # native.c's ints read with four bytes more: SIGSEGV here
    ],
)
def test_a_bad_blas_turns_the_layer_blocks_off_naming_it(fresh, shims, monkeypatch, shim, what):
    monkeypatch.setenv(envs.DINFER_CPU_BLAS, str(shims[shim]))
    loaded = native.load()
    assert loaded.lib is not None  # the row kernels stay: only the BLAS-dependent part is off
    status = native.gemm_status()
    assert status.startswith("off: the BLAS self-check") and what in status and str(shims[shim]) in status, status
    assert "ILP64" in status and "unset DINFER_CPU_BLAS" in status
    assert f"layer blocks and their GEMMs off: {status[5:]}" in CpuBackend().is_available().reason
    assert CpuBackend().capabilities().extra["native_gemms"] == status
    with pytest.raises(ConfigError, match=f"backend cpu: .*{what[:20]}.*; unset DINFER_CPU_BLAS to use torch's own"):
        CpuBackend().kernels()  # the user named this BLAS: a model does not load without it, silently slower
    assert native.NativeKernels(loaded.lib).blas is None
    assert _blas_call(loaded.lib) == -2  # the bad sgemm_ was never handed to native.c
    [verdict] = _verdicts(fresh)
    assert '"ok": false' in verdict


def test_the_result_stays_correct_with_a_bad_blas(fresh, shims, monkeypatch):
    """Unpacked weights and 5 rows: every layer-block matmul would go through the BLAS. With the
    wrong one planted as the BLAS found in torch's libraries (nobody named it), the layer blocks
    are off and the logits still match the float64 reference (torch ran them); named by
    ``DINFER_CPU_BLAS``, the model does not load; the same forward with the check bypassed shows
    the wrong BLAS would have been used."""
    monkeypatch.setenv(envs.DINFER_CPU_PACKED_WEIGHTS, "off")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    want = dinfer_rt.load_model(EMBEDDED_MODEL, backend="reference", dtype="float64").forward(ids)

    def error() -> float:
        model = dinfer_rt.load_model(EMBEDDED_MODEL, backend="cpu", dtype="float32")
        return ((model.forward(ids).double() - want).abs().max() / want.abs().max()).item()

    wrong = blas._override(str(shims["wrong"]))
    with monkeypatch.context() as m:
        m.setattr(blas, "find", lambda: wrong)  # as if torch's own BLAS were the wrong one
        _clear()
        assert native.gemm_status().startswith("off:")
        assert error() < 1e-4
    monkeypatch.setenv(envs.DINFER_CPU_BLAS, str(shims["wrong"]))
    _clear()
    with pytest.raises(ConfigError, match="gave a wrong 3 x 5 by 5 x 7 product"):
        error()
    _clear()
    monkeypatch.setattr(blas, "checked", lambda library: blas.find())  # no self-check: the wrong BLAS runs
    assert native.gemm_status().startswith("on (sgemm from")
    assert error() > 1e-2


def test_the_verdict_is_cached_and_taken_again_for_a_changed_blas(fresh, shims, monkeypatch, tmp_path):
    """Cached: a second load runs no probe. Changed (another file at the same path): checked
    again, in a new process (this one keeps the library it mapped, as any process would)."""
    lib = tmp_path / "libblas.so"
    shutil.copy(shims["wrong"], lib)
    monkeypatch.setenv(envs.DINFER_CPU_BLAS, str(lib))
    assert native.gemm_status().startswith("off:")
    first = _verdicts(fresh)
    _clear()

    def no_probe(*args, **kwargs):
        raise AssertionError(f"probe run again: {args}")

    with monkeypatch.context() as m:
        m.setattr(blas, "probe", no_probe)
        assert native.gemm_status().startswith("off:")  # from the cached verdict
    shutil.copy(shims["good"], tmp_path / "new.so")
    os.utime(tmp_path / "new.so", ns=(1, 1))  # a different mtime even on a coarse clock
    os.replace(tmp_path / "new.so", lib)  # a new file: the mapped one stays intact
    code = "from dinfer_rt.backends.cpu import native; print(native.gemm_status())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith(f"on (sgemm from {lib}"), done.stdout + done.stderr
    assert len(_verdicts(fresh)) == 2 and first[0] in _verdicts(fresh)


def test_dinfer_rt_backends_shows_the_reason(fresh, shims):
    env = {**os.environ, envs.DINFER_CPU_BLAS: str(shims["crash"])}
    done = subprocess.run([sys.executable, "-m", "dinfer_rt", "backends"], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    cpu = next(line for line in done.stdout.splitlines() if line.startswith("cpu "))
    assert "layer blocks and their GEMMs off: the BLAS self-check crashed the probe process (SIGSEGV)" in cpu, cpu
    assert str(shims["crash"]) in cpu


def test_a_probe_that_cannot_run_keeps_no_verdict(fresh, monkeypatch, tmp_path):
    """No verdict on the BLAS (the probe itself failed): the layer blocks are off for this
    process, saying so, and nothing is cached, so the next process checks again."""
    broken = tmp_path / "probe.py"
    broken.write_text("import sys\nsys.exit('probe: broken on purpose')\n")
    monkeypatch.setattr(blas, "PROBE", broken)
    status = native.gemm_status()
    assert status.startswith("off: the BLAS self-check of sgemm_ from ") and "libtorch_cpu" in status, status
    assert status.endswith("could not run (probe exit 1: probe: broken on purpose); not checked"), status
    assert _verdicts(fresh) == []


def test_a_missing_library_is_named(fresh, monkeypatch, tmp_path):
    missing = tmp_path / "libnoblas.so"
    monkeypatch.setenv(envs.DINFER_CPU_BLAS, str(missing))
    assert native.gemm_status() == f"off: DINFER_CPU_BLAS={str(missing)!r}: no such library file"
    assert _verdicts(fresh) == []


def test_generate_refuses_a_blas_the_variable_names_that_cannot_be_used(fresh, tmp_path):
    """A named BLAS that is not there: one error line naming the variable, not a silently slower run."""
    missing = tmp_path / "libnoblas.so"
    env = {**os.environ, envs.DINFER_CPU_BLAS: str(missing), "DINFER_BACKEND": "cpu"}
    done = subprocess.run([sys.executable, "-m", "dinfer_rt", "generate", "ab"], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: backend cpu: DINFER_CPU_BLAS={str(missing)!r}: no such library file; unset DINFER_CPU_BLAS to use "
        "torch's own BLAS"
    ), done.stderr
