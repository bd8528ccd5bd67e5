"""Weight-only quantisation (int8, fp8, GPTQ 4-bit) and precision schedules.

Quantised ops are checked against the float64 product of the same dequantised weights (fp32
activations: rel <= 1e-5; bf16: rel <= 2e-2), on every backend available here: cpu, cuda and
rocm_dcu kernels under the Triton interpreter, ascend with the simulated torch_npu."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dinfer_rt import plugins, quant
from dinfer_rt.engine import run_batch
from dinfer_rt.errors import BackendError, CheckpointError, ConfigError, DinferError, GenerationError
from dinfer_rt.ir import ops
from dinfer_rt.llm import LLM
from dinfer_rt.loader import load_model
from dinfer_rt.platform import Availability
from dinfer_rt.precision import PrecisionSchedule
from dinfer_rt.sampling import STRATEGIES, SamplingParams
from dinfer_rt.testing import checkpoints, simulated_torch_npu

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def dequantized(q, scale):
    return q.double() * scale.double()[:, None]


# ---------------------------------------------------------------- quantisation itself


@pytest.mark.parametrize("fmt, bound", [("int8", 0.5 / 127), ("fp8", 2.0**-4)])
def test_quantize_error_is_within_the_format_rounding(fmt, bound):
    w = torch.randn(64, 96, dtype=torch.float64) * 0.3
    q, scale = quant.quantize(w, fmt)
    assert q.dtype == quant.QUANT_DTYPE[fmt] and scale.shape == (64,)
    err = (dequantized(q, scale) - w).abs()
    if fmt == "int8":  # half a step of the row's scale
        assert (err <= bound * w.abs().amax(1, keepdim=True) * (1 + 1e-6)).all()
    else:  # 3 mantissa bits: relative rounding <= 2^-4 (normal range)
        big = w.abs() > w.abs().amax(1, keepdim=True) * 2.0**-6
        assert (err[big] <= bound * w.abs()[big] * (1 + 1e-6)).all()


# ---------------------------------------------------------------- kernels on every backend


def _backends(monkeypatch):
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    out = {name: plugins.select_backend(name) for name in ("cpu", "cuda", "rocm_dcu")}
    simulated_torch_npu.install(monkeypatch)
    from dinfer_rt.backends.ascend.plugin import AscendBackend

    monkeypatch.setattr(AscendBackend, "is_available", lambda self: Availability(True, "simulated torch_npu"))
    monkeypatch.setattr(AscendBackend, "device_type", "cpu")
    plugins.registry.cache_clear()
    out["ascend"] = plugins.select_backend("ascend")
    return out


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_linear_wq_kernels_match_the_float64_dequantised_product(monkeypatch, fmt, dtype, tol):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 40, generator=g, dtype=torch.float64)
    q, scale = quant.quantize(torch.randn(36, 40, generator=g, dtype=torch.float64) * 0.2, fmt)
    bias = torch.randn(36, generator=g, dtype=torch.float64)
    want = x @ dequantized(q, scale).T + bias
    assert rel(ops.linear_wq(x, q, scale, bias), want) < 1e-12  # the reference in float64 is exact
    for name, be in _backends(monkeypatch).items():
        kernel, source = be.kernel_table()["linear_wq"]
        got = kernel(x.to(dtype), q, scale, bias.to(dtype))
        assert got.dtype == dtype and got.shape == want.shape
        assert rel(got, want) <= tol, (name, source)
        assert source == "native"  # ascend's wrapper itself takes the counted reference outside the op's dtypes


def test_ascend_int8_goes_through_npu_weight_quant_batchmatmul(monkeypatch):
    be = _backends(monkeypatch)["ascend"]
    calls = []
    real = simulated_torch_npu.npu_weight_quant_batchmatmul
    monkeypatch.setattr(
        simulated_torch_npu, "npu_weight_quant_batchmatmul", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    q, scale = quant.quantize(torch.randn(16, 32), "int8")
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    kernel, _ = be.kernel_table()["linear_wq"]
    assert rel(kernel(x, q, scale), x.double() @ dequantized(q, scale).T) < 2e-2
    assert calls == [1]
    kernel(x.float(), q, scale)  # fp32 activations: the documented op takes fp16/bf16 only
    assert be.constraint_fallbacks["linear_wq"] == 1


def test_fp8_on_a_backend_without_it_is_a_one_line_error(monkeypatch, tmp_path):
    ckpt = checkpoints.llada(tmp_path / "m")
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    with pytest.raises(BackendError, match=r"rocm_dcu.*gfx936.* no fp8 weight kernels; it supports: int8, gptq4"):
        load_model(ckpt, backend="rocm_dcu::gfx936", quantization="fp8")
    assert "fp8" not in _backends(monkeypatch)["ascend"].capabilities().weight_formats


# ---------------------------------------------------------------- models


@pytest.mark.parametrize("family", ["llada", "dream", "llada_moe", "llada2"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_model_equals_its_dequantised_float_twin(ckpt_dir, family, fmt):
    """Loading with quantization= computes exactly the float model whose projections are the
    dequantised weights (fp32 1e-5), merges Q/K/V and gate/up on the quantised weights, and
    holds about a quarter of the projections' bytes."""
    full = load_model(ckpt_dir(family))
    q = load_model(ckpt_dir(family), quantization=fmt)
    counts = q.executable(False).graph.op_counts()
    assert counts.get("linear_wq", 0) > 0 and q.weight_format == fmt
    twin = load_model(ckpt_dir(family))
    for name in [n for n in twin.weights if quant.is_quantizable(n)]:
        qw, sc = q.weights[quant.quantized_names(name, fmt)[0]], q.weights[quant.quantized_names(name, fmt)[1]]
        twin.weights[name].copy_(dequantized(qw, sc).float())
    proj = [full.weights[n] for n in full.weights if quant.is_quantizable(n)]
    saved = quant.weight_bytes(full.weights) - quant.weight_bytes(q.weights)
    assert saved == sum(3 * w.numel() - 4 * w.shape[0] for w in proj)  # 4-byte floats -> 1 byte + a row scale
    ids = torch.randint(0, full.spec.vocab, (2, 12))
    assert rel(q.forward(ids), twin.forward(ids)) < 1e-5
    assert rel(full.forward(ids, precision=fmt), q.forward(ids)) < 1e-6  # the schedule's copy is the same


def test_quantized_forward_on_the_interpreted_triton_backend_matches_cpu(ckpt_dir, monkeypatch):
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    cpu = load_model(ckpt_dir("llada"), backend="cpu", quantization="int8")
    cuda = load_model(ckpt_dir("llada"), backend="cuda", quantization="int8")
    ids = torch.randint(0, cpu.spec.vocab, (1, 6))
    assert rel(cuda.forward(ids), cpu.forward(ids)) < 1e-5
    assert cuda.executable(False).fallbacks["linear_wq"] == 0
    assert cuda.backend.kernel_table()["linear_wq"][1] == "native"


# ---------------------------------------------------------------- GPTQ checkpoints


def _pack_rows(q: np.ndarray) -> np.ndarray:
    """[in, out] 4-bit ints -> [in/8, out] int32, value j of word i = row 8i + j at bits 4j (written
    here independently of the runtime's unpacking)."""
    k, n = q.shape
    words = np.zeros((k // 8, n), dtype=np.uint32)
    for i in range(k // 8):
        for j in range(8):
            words[i] |= (q[8 * i + j].astype(np.uint32) & 0xF) << np.uint32(4 * j)
    return words.view(np.int32)


def _pack_cols(z: np.ndarray) -> np.ndarray:
    g, n = z.shape
    words = np.zeros((g, n // 8), dtype=np.uint32)
    for c in range(n // 8):
        for j in range(8):
            words[:, c] |= (z[:, 8 * c + j].astype(np.uint32) & 0xF) << np.uint32(4 * j)
    return words.view(np.int32)


def _gptq_checkpoint(src, dst, group: int, act_order: bool, v2: bool = False):
    """Rewrite a float LLaDA checkpoint as GPTQ 4-bit (random codes, zeros, scales; a permuted
    g_idx with act_order) and a float twin holding exactly (q - z) * s."""
    rng = np.random.default_rng(0)
    tensors = load_file(str(src / "model.safetensors"))
    gptq, twin = {}, {}
    for name, w in tensors.items():
        is_proj = any(f".{p}.weight" in name for p in ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj"))
        is_proj |= name.endswith("ff_out.weight") and ".blocks." in name
        if not is_proj:
            gptq[name] = twin[name] = w
            continue
        n, k = w.shape
        size = k if group == -1 else group  # -1: one group over the whole input
        groups = k // size
        q = rng.integers(0, 16, (k, n))
        z = rng.integers(0 if v2 else 1, 16, (groups, n))  # v1 stores z - 1 in 4 bits: z = 0 does not fit
        s = rng.uniform(0.002, 0.02, (groups, n)).astype(np.float16)
        g_idx = np.arange(k) // size
        if act_order:
            g_idx = rng.permutation(g_idx)
        stem = name.removesuffix(".weight")
        gptq[stem + ".qweight"] = torch.from_numpy(_pack_rows(q))
        gptq[stem + ".qzeros"] = torch.from_numpy(_pack_cols(z if v2 else z - 1))
        gptq[stem + ".scales"] = torch.from_numpy(s)
        gptq[stem + ".g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        deq = (q - z[g_idx]) * s[g_idx].astype(np.float64)  # [in, out]
        twin[name] = torch.from_numpy(deq.T.copy()).float()
    cfg = json.loads((src / "config.json").read_text())
    for folder, t, extra in ((dst / "gptq", gptq, True), (dst / "twin", twin, False)):
        folder.mkdir(parents=True)
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (folder / f.name).write_bytes(f.read_bytes())
        c = dict(cfg)
        if extra:
            fmt = "gptq_v2" if v2 else "gptq"
            c["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order}
            c["quantization_config"]["checkpoint_format"] = fmt
        (folder / "config.json").write_text(json.dumps(c))
        save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "model.safetensors"))
    return dst / "gptq", dst / "twin"


@pytest.mark.parametrize("group, act_order, v2", [(16, False, False), (16, True, False), (-1, False, True)])
def test_gptq_checkpoint_loads_and_equals_its_float_twin(tmp_path, group, act_order, v2):
    src = checkpoints.llada(tmp_path / "src", d=48, mlp=80)
    gptq, twin = _gptq_checkpoint(src, tmp_path, group, act_order, v2)
    m, t = load_model(gptq), load_model(twin)
    assert m.weight_format == "gptq4" and m.executable(False).graph.op_counts()["linear_gptq"] == 2 * 7
    ids = torch.randint(0, m.spec.vocab, (2, 9))
    assert rel(m.forward(ids), t.forward(ids)) < 1e-5
    out = LLM(m).generate([[7, 8, 9]], SamplingParams(gen_length=8, block_length=4, strategy="threshold"))
    assert out[0].stats.nfe > 0


def test_gptq_model_on_the_interpreted_triton_kernel_matches_cpu(tmp_path, monkeypatch):
    src = checkpoints.llada(tmp_path / "src", d=48, mlp=80)
    gptq, _ = _gptq_checkpoint(src, tmp_path, 16, True)
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    cpu, cuda = load_model(gptq, backend="cpu"), load_model(gptq, backend="cuda")
    ids = torch.randint(0, cpu.spec.vocab, (1, 6))
    assert rel(cuda.forward(ids), cpu.forward(ids)) < 1e-5
    assert cuda.executable(False).fallbacks["linear_gptq"] == 0


def test_gptq_bad_layouts_are_one_line_errors(tmp_path):
    src = checkpoints.llada(tmp_path / "src", d=48, mlp=80)
    gptq, _ = _gptq_checkpoint(src, tmp_path, 16, False)
    cfg = json.loads((gptq / "config.json").read_text())
    for field, value, pattern in (
        ("group_size", 32, r"group_size 32 does not divide the input size 48"),
        ("bits", 8, r"bits 8 is not supported \(GPTQ 4-bit only\)"),
        ("checkpoint_format", "marlin", r"checkpoint_format 'marlin' is not supported"),
        ("quant_method", "awq", r"quant_method 'awq' is not supported"),
    ):
        bad = dict(cfg, quantization_config=dict(cfg["quantization_config"], **{field: value}))
        (gptq / "config.json").write_text(json.dumps(bad))
        with pytest.raises(DinferError, match=pattern) as e:
            load_model(gptq)
        assert "\n" not in str(e.value)
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="GPTQ-quantised already"):
        load_model(gptq, quantization="int8")
    t = load_file(str(gptq / "model.safetensors"))
    t["model.transformer.blocks.0.q_proj.g_idx"] = torch.full((48,), 3, dtype=torch.int32)
    save_file(t, str(gptq / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_proj.g_idx' names groups outside \[0, 3\)"):
        load_model(gptq)


# ---------------------------------------------------------------- precision schedules


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("int4@0.5,fp32", "unknown precision 'int4'"),
        ("int8@0.5", "the last stage 'int8@0.5' must name the model's precision"),
        ("fp32", "needs at least one low-precision stage"),
        ("int8@1.5,fp32", r"masked fraction must be in \[0, 1\)"),
        ("int8:x,fp32", "'x' is not a step count"),
        ("int8-0.5,fp32", "must be FORMAT@FRACTION or FORMAT:STEPS"),
        # a stage an earlier one always wins over (stages are tried in order) never picks a forward
        ("int8@0.2,fp8@0.5,fp32", r"stage 'fp8@0.5' is unreachable: 'int8@0.2' .*fractions must decrease"),
        ("int8@0.3,int8@0.3,fp32", "stage 'int8@0.3' is unreachable"),
        ("int8:3,fp8:2,fp32", r"stage 'fp8:2' is unreachable: 'int8:3' .*step counts must increase"),
    ],
)
def test_bad_schedules_are_one_line_errors(text, pattern):
    with pytest.raises(GenerationError, match=pattern):
        SamplingParams(precision_schedule=text).validate()


def test_schedule_choice():
    s = PrecisionSchedule.parse("fp8@0.75,int8@0.25,fp32")
    assert [s.choose(f, 0) for f in (1.0, 0.75, 0.5, 0.25, 0.0)] == ["fp8", "int8", "int8", None, None]
    steps = PrecisionSchedule.parse("int8:2,full")
    assert [steps.choose(1.0, i) for i in range(4)] == ["int8", "int8", None, None]


@pytest.fixture(scope="module")
def embedded():
    return load_model()


def _counting(model, monkeypatch):
    """Count calls per compiled executable's weight format (the key's last field)."""
    calls: dict = {}
    real = model.executable

    def executable(*a, **k):
        exe = real(*a, **k)
        fmt = k.get("precision") or model.weight_format or "full"

        def run(inputs, exe=exe, fmt=fmt):
            calls[fmt] = calls.get(fmt, 0) + 1
            return exe(inputs)

        return run

    monkeypatch.setattr(model, "executable", executable)
    return calls


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_schedule_alternates_executables_and_full_precision_finishes_every_block(
    embedded, monkeypatch, strategy, cache
):
    from dinfer_rt.demo import task

    tok = embedded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": it.letters}])) for it in task.heldout(3)]
    params = SamplingParams(
        strategy=strategy, gen_length=16, block_length=8, cache=cache, precision_schedule="int8@0.5,fp32"
    )
    calls = _counting(embedded, monkeypatch)
    log = []
    from dinfer_rt.decode import Cohort

    real_call = Cohort.forward

    def logged(self, window):
        log.append(window.precision)
        return real_call(self, window)

    monkeypatch.setattr(Cohort, "forward", logged)
    res = run_batch(embedded, prompts, params)
    assert calls.get("int8", 0) > 0 and calls.get("full", 0) > 0  # both executables really ran
    assert res.precision_forwards == {"int8": log.count("int8"), "fp32": log.count(None)}
    assert not (res.tokens == embedded.mask_id).any()
    for r in range(len(prompts)):  # the forward that committed each block's last slot ran in full precision
        for b0 in range(0, 16, 8):
            steps = res.commit_step[r, b0 : b0 + 8]
            if (steps >= 0).any():
                assert log[int(steps.max())] is None


def test_step_form_runs_each_blocks_first_forward_in_low_precision(embedded):
    params = SamplingParams(
        strategy="threshold", gen_length=24, block_length=8, early_stop=False, precision_schedule="int8:1,full"
    )
    res = run_batch(embedded, [[7, 8, 9, 10, 11]], params)
    assert res.precision_forwards["int8"] == 3 and res.precision_forwards["full"] == res.nfe - 3


def test_precision_refresh_recomputes_the_cache_after_low_precision(embedded):
    prompts = [[7, 8, 9, 10, 11]]
    p = dict(strategy="threshold", gen_length=16, block_length=8, cache="dual", precision_schedule="int8@0.5,fp32")
    a = run_batch(embedded, prompts, SamplingParams(**p))
    b = run_batch(embedded, prompts, SamplingParams(**p, precision_refresh=True))
    assert not (a.tokens == embedded.mask_id).any() and not (b.tokens == embedded.mask_id).any()


def test_schedule_model_mismatches_are_one_line_errors(embedded, ckpt_dir):
    with pytest.raises(GenerationError, match="last stage 'bf16' is not the model's dtype"):
        run_batch(embedded, [[7, 8]], SamplingParams(gen_length=8, block_length=8, precision_schedule="int8@0.5,bf16"))
    q = load_model(ckpt_dir("llada"), quantization="int8")
    with pytest.raises(GenerationError, match="holds int8 weights only"):
        run_batch(q, [[7, 8]], SamplingParams(gen_length=8, block_length=8, precision_schedule="fp8@0.5,full"))
    with pytest.raises(ConfigError, match="unknown weight format 'int4'"):
        load_model(ckpt_dir("llada"), quantization="int4")


def test_each_tensor_goes_to_the_device_as_it_is_read(ckpt_dir, monkeypatch):
    """The loader hands every tensor to the device right after reading it (the host holds one
    tensor in flight, never the whole model): on the "meta" device nothing stays on the host."""
    from dinfer_rt.checkpoint import Checkpoint
    from dinfer_rt.model_spec import parse_spec
    from dinfer_rt.weights import load_weights

    path = ckpt_dir("llada_moe")
    seen = []
    real = Checkpoint.read

    def read(self, names, slices=None):
        for name, t in real(self, names, slices):
            seen.append(t.device.type)
            yield name, t

    monkeypatch.setattr(Checkpoint, "read", read)
    weights = load_weights(Checkpoint(path), parse_spec(path), torch.float32, check_weights=False, device="meta")
    assert seen and set(seen) == {"cpu"}  # read on the host ...
    assert {t.device.type for t in weights.values()} == {"meta"}  # ... and none of it kept there
