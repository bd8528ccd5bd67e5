"""``DINFER_CPU_MATMUL=bf16``: the cpu backend's layer-block projections in the bfloat16 panel
GEMM (AVX512-BF16). Checked against float64 sums of the bfloat16-rounded inputs (the exact
value the instruction approximates, with a float32 summation bound), on the embedded model
against float32, and for the errors that name the variable when it cannot run."""

from __future__ import annotations

import pytest
import torch

import dinfer_rt
from dinfer_rt import envs
from dinfer_rt.backends.cpu import native
from dinfer_rt.backends.cpu.backend import CpuBackend
from dinfer_rt.demo import task
from dinfer_rt.errors import ConfigError
from dinfer_rt.llm import LLM
from dinfer_rt.loader import EMBEDDED_MODEL
from dinfer_rt.sampling import SamplingParams

LIB = native.load().lib
WHY_NOT = native.bf16_unavailable(LIB)


def _bf16_kernels() -> native.NativeKernels:
    kernels = native.NativeKernels(LIB, "bf16")
    kernels.panels = native.PanelWeights(LIB)  # this test's copies, not the shared registry's
    return kernels


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, n, k", [(1, 33, 7), (6, 64, 48), (7, 100, 193), (51, 96, 300), (300, 40, 64)])
def test_bf16_gemm_is_the_float32_sum_of_rounded_inputs(threads, rows, n, k):
    """Tiles of 6 rows (and their padding), panels of 32 columns (n past a multiple), odd k (a
    zero-padded last pair), k a multiple of 32 or not (the vector rounding and its scalar
    tail), one thread and split."""
    if WHY_NOT:
        with pytest.raises(ConfigError, match="DINFER_CPU_MATMUL=bf16"):
            native.NativeKernels(LIB, "bf16")
        return
    g = torch.Generator().manual_seed(rows * n + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _bf16_kernels().projection(x, w, b)
    finally:
        torch.set_num_threads(saved)
    xb, wb = x.bfloat16().double(), w.bfloat16().double()  # torch's rounding: to nearest even
    want = xb @ wb.T + b.double()
    bound = 2 * (k + 1) * 2.0**-24 * (xb.abs() @ wb.abs().T + b.double().abs())  # float32 sums of exact products
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), (err - bound).max().item()
    fp32 = x.double() @ w.double().T + b.double()  # not the float32 product: the inputs were rounded
    assert bool(((fp32 - want).abs() > bound).any())


def test_bf16_panels_are_packed_once_per_weight():
    if WHY_NOT:
        with pytest.raises(ConfigError, match="DINFER_CPU_MATMUL=bf16"):
            native.NativeKernels(LIB, "bf16")
        return
    kernels = _bf16_kernels()
    w = torch.randn(40, 30)
    first = kernels.panels.get_bf16(w)
    assert first is kernels.panels.get_bf16(w) and first.numel() == 64 * 30  # 2 panels x 15 pairs x 32 x 2
    w.mul_(2.0)  # modified in place: packed again
    assert kernels.panels.get_bf16(w) is not first


def test_embedded_model_in_bf16_stays_close_and_decodes(monkeypatch):
    """Whole forwards (batch 1, and batch 50 where the attention core is SDPA's and the Q/K/V
    projection runs alone) within bfloat16's error of float32, not equal to it, and greedy
    decoding still solves held-out items."""
    if WHY_NOT:
        monkeypatch.setenv(envs.DINFER_CPU_MATMUL, "bf16")
        with pytest.raises(ConfigError, match="DINFER_CPU_MATMUL=bf16 cannot run here"):
            dinfer_rt.load_model(EMBEDDED_MODEL)
        return
    fp32 = dinfer_rt.load_model(EMBEDDED_MODEL)
    monkeypatch.setenv(envs.DINFER_CPU_MATMUL, "bf16")
    bf16 = dinfer_rt.load_model(EMBEDDED_MODEL)
    monkeypatch.delenv(envs.DINFER_CPU_MATMUL)  # pinned when the backend was chosen
    g = torch.Generator().manual_seed(3)
    for shape in ((1, 44), (50, 44)):
        ids = torch.randint(3, 30, shape, generator=g)
        a, b = bf16.forward(ids), fp32.forward(ids)
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert 1e-5 < rel <= 3e-2, rel
    items = task.heldout(8)
    outs = LLM(bf16).generate([it.letters for it in items], SamplingParams(strategy="threshold", block_length=40))
    assert sum(task.check(it.letters, o.text) for it, o in zip(items, outs)) >= 7


def test_bad_matmul_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(envs.DINFER_CPU_MATMUL, "fp16")
    with pytest.raises(ConfigError, match=r"DINFER_CPU_MATMUL='fp16' is not one of fp32, bf16"):
        dinfer_rt.load_model(EMBEDDED_MODEL)


def test_unavailable_bf16_says_why(monkeypatch):
    class NoBf16:
        @staticmethod
        def dinfer_bf16_panels() -> int:
            return 0

    assert "AVX512-BF16" in native.bf16_unavailable(NoBf16())
    assert "native kernels are off" in native.bf16_unavailable(None)
    monkeypatch.setenv(envs.DINFER_CPU_MATMUL, "bf16")
    backend = CpuBackend()
    monkeypatch.setattr(native, "bf16_unavailable", lambda lib: "no AVX512-BF16 here (test)")
    with pytest.raises(ConfigError, match=r"backend cpu: DINFER_CPU_MATMUL=bf16 cannot run here: no AVX512-BF16"):
        backend.kernels()
