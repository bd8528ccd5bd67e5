"""Weight-only quantisation: which weights, how they are quantised, and GPTQ checkpoints.

Formats (``docs/quantization.md``):
  int8   symmetric per-output-channel int8: scale = max|w_row| / 127, q = round(w / scale)
  fp8    float8 e4m3 per output channel: scale = max|w_row| / 448, q = fp8(w / scale)
  gptq4  4-bit GPTQ checkpoints as AutoGPTQ / GPTQModel write them (qweight, qzeros, scales,
         g_idx), loaded as they are and dequantised by the ``linear_gptq`` kernel
Only the decoder's projections are quantised (Q/K/V/O, gate/up/down, shared experts): the
embedding, the LM head, norms, routers and the stacked routed experts keep the model's dtype,
as GPTQ and vLLM's weight-only schemes do. Activations always stay in the compute dtype.
"""

from __future__ import annotations

import torch

from dinfer_rt.errors import CheckpointError, ConfigError

WEIGHT_FORMATS = ("int8", "fp8")  # quantised at load from a float checkpoint
CHECKPOINT_FORMATS = ("gptq4",)  # read as stored
QUANT_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {"int8": 127.0, "fp8": 448.0}
QUANTIZED_PROJECTIONS = ("q", "k", "v", "o", "qkv", "gate", "up", "down", "shared_gate", "shared_up", "shared_down")


def is_quantizable(param: str) -> bool:
    """Whether IR parameter ``param`` (``layers.3.q``) is a projection the formats quantise."""
    parts = param.split(".")
    return len(parts) == 3 and parts[0] == "layers" and parts[2] in QUANTIZED_PROJECTIONS


def check_format(name: str, where: str = "quantization") -> str:
    if name not in WEIGHT_FORMATS:
        raise ConfigError(f"{where}: unknown weight format {name!r}; choose one of: {', '.join(WEIGHT_FORMATS)}")
    return name


def quantize(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [out, in] in the format's dtype, fp32 scale [out]) for a float [out, in] weight.
    Rounding runs in fp32 (f64 weights in f64); an all-zero row gets scale 1."""
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.to(acc)
    scale = w.abs().amax(dim=1) / _QMAX[fmt]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    z = w / scale[:, None]
    q = z.round().clamp(-127, 127).to(torch.int8) if fmt == "int8" else z.to(torch.float8_e4m3fn)
    return q, scale.to(torch.float32)


def quantized_names(param: str, fmt: str) -> tuple[str, str]:
    """The IR parameter names of ``param``'s quantised copy: (qweight, scale)."""
    return f"{param}@{fmt}", f"{param}@{fmt}.scale"


def weight_bytes(weights: dict[str, torch.Tensor]) -> int:
    """Bytes held by distinct storages among ``weights`` (views of a merged tensor count once)."""
    seen: dict[int, int] = {}
    for t in weights.values():
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------- GPTQ checkpoints

GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def gptq_config(config: dict, config_path) -> dict | None:
    """The checkpoint's GPTQ settings from config.json's ``quantization_config`` (None when the
    checkpoint is not quantised); layouts this runtime cannot read are one-line errors."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    where = f"{config_path}: quantization_config"
    if not isinstance(qc, dict):
        shown = repr(qc) if len(repr(qc)) <= 60 else repr(qc)[:60] + "..."
        raise ConfigError(f"{where} must be an object (e.g. {{\"quant_method\": \"gptq\", ...}}), found "
                          f"{type(qc).__name__} {shown}")  # fmt: skip
    method = qc.get("quant_method")
    if method != "gptq":
        raise ConfigError(f"{where}: quant_method {method!r} is not supported (only 'gptq', 4-bit)")
    if qc.get("bits") != 4:
        raise ConfigError(f"{where}: bits {qc.get('bits')!r} is not supported (GPTQ 4-bit only)")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"{where}: checkpoint_format {fmt!r} is not supported ('gptq' or 'gptq_v2')")
    group = qc.get("group_size", 128)
    if isinstance(group, bool) or not isinstance(group, int) or (group <= 0 and group != -1):
        raise ConfigError(f"{where}: group_size {group!r} must be a positive int or -1 (one group)")
    desc_act = qc.get("desc_act", False)
    if desc_act is not None and not isinstance(desc_act, bool):  # "false" is truthy: a silent act-order
        raise ConfigError(f"{where}: desc_act {desc_act!r} must be true or false")
    return {"group_size": group, "zero_offset": 1 if fmt == "gptq" else 0, "desc_act": bool(desc_act)}


def gptq_shapes(out_f: int, in_f: int, group: int, where: str) -> dict[str, tuple[int, ...]]:
    """Shapes of the four GPTQ tensors of an [out, in] layer; a group size that does not divide
    the input size (or sizes that do not pack into int32 words) is a one-line error."""
    g = in_f if group == -1 else group
    if in_f % g:
        raise CheckpointError(f"{where}: GPTQ group_size {group} does not divide the input size {in_f}")
    if in_f % 8 or out_f % 8:
        raise CheckpointError(f"{where}: GPTQ 4-bit packing needs in ({in_f}) and out ({out_f}) divisible by 8")
    groups = in_f // g
    return {"qweight": (in_f // 8, out_f), "qzeros": (groups, out_f // 8), "scales": (groups, out_f), "g_idx": (in_f,)}
