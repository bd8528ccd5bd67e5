"""Model families: read config.json into a :class:`ModelSpec` and list the tensors it implies.

Families (``models.md``): ``llada`` (LLaDA-8B layout), ``dream`` (Qwen2 names, shifted
logits), ``llada_moe`` (LLaDA-MoE-7B-A1B), ``llada2`` (LLaDA2.0 / BailingMoeV2: fused
``query_key_value``, partial RoPE, group-limited sigmoid router, first dense layers,
block-causal attention). The family is decided from ``architectures`` / ``model_type``
and MoE fields, never from ``model_type`` alone (dense LLaDA and LLaDA-MoE share it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dinfer_rt.errors import ConfigError

FAMILIES = ("llada", "dream", "llada_moe", "llada2")


@dataclass(frozen=True)
class MoESpec:
    n_experts: int
    top_k: int
    expert_intermediate: int
    router: str  # "softmax" | "sigmoid_grouped"
    renormalize: bool
    routed_scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    n_shared: int = 0
    first_k_dense: int = 0
    dense_intermediate: int = 0


@dataclass(frozen=True)
class ModelSpec:
    family: str
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int  # rows of the embedding / LM head
    intermediate: int
    eps: float
    rope_theta: float
    rotary_dim: int
    qkv_bias: bool = False
    qk_norm: bool = False
    fused_qkv: bool = False
    tie_embeddings: bool = False
    shift_logits: bool = False
    block_causal: bool = False
    default_block_size: int | None = None
    positions_from_padding: bool = False
    max_length: int = 4096
    mask_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None
    bos_id: int | None = None
    moe: MoESpec | None = None
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i >= self.moe.first_k_dense


class _Fields:
    """Typed access to config.json fields, with errors that name the file and field."""

    def __init__(self, cfg: dict[str, Any], path: Path, family: str) -> None:
        self.cfg, self.path, self.family = cfg, path, family

    def need(self, *names: str, kind: type = int) -> Any:
        for name in names:
            if name in self.cfg and self.cfg[name] is not None:
                return self._typed(name, kind)
        raise ConfigError(f"{self.path}: missing field {' / '.join(repr(n) for n in names)} (needed for {self.family})")

    def get(self, name: str, default: Any, kind: type | None = None) -> Any:
        if self.cfg.get(name) is None:
            return default
        return self._typed(name, kind or type(default))

    def _typed(self, name: str, kind: type) -> Any:
        value = self.cfg[name]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise ConfigError(f"{self.path}: field {name!r} should be {kind.__name__}, found {value!r}")
        return value


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ConfigError(f"model folder {model_dir} does not exist")
    if not path.is_file():
        raise ConfigError(f"{path}: not found (a model folder needs config.json, *.safetensors and tokenizer.json)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


def detect_family(cfg: dict[str, Any], path: Path) -> str:
    archs = cfg.get("architectures") or []
    arch = " ".join(archs) if isinstance(archs, list) else str(archs)
    auto = json.dumps(cfg.get("auto_map", {}))
    mtype = str(cfg.get("model_type", ""))
    if mtype.startswith("llada2") or "LLaDA2" in arch or "Bailing" in arch:
        return "llada2"
    if mtype.lower() == "dream" or "Dream" in arch:
        return "dream"
    if mtype == "llada" or "LLaDA" in arch or "llada" in auto.lower():
        moe = "num_experts" in cfg or "MoE" in arch or "moe" in auto.lower()
        return "llada_moe" if moe else "llada"
    raise ConfigError(
        f"{path}: unsupported model_type {mtype!r} (architectures {archs}); "
        f"supported: llada, llada (MoE), Dream, llada2_moe"
    )


def _eos_ids(f: _Fields) -> tuple[int, ...]:
    eos = f.cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) for i in ids):
        raise ConfigError(f"{f.path}: field 'eos_token_id' should be an int or a list of ints, found {eos!r}")
    return tuple(ids)


def _rotary_dim(f: _Fields, head_dim: int) -> int:
    factor = f.get("partial_rotary_factor", 1.0, float)
    rd = int(head_dim * factor)
    if not 0 < rd <= head_dim or rd % 2:
        raise ConfigError(f"{f.path}: partial_rotary_factor {factor} gives rotary dim {rd}, not an even 1..{head_dim}")
    return rd


def parse_spec(model_dir: Path, cfg: dict[str, Any] | None = None) -> ModelSpec:
    """config.json -> ModelSpec, with a one-line error for any missing or bad field."""
    path = model_dir / "config.json"
    cfg = read_config(model_dir) if cfg is None else cfg
    family = detect_family(cfg, path)
    f = _Fields(cfg, path, family)
    common: dict[str, Any] = {
        "family": family,
        "config": cfg,
        "eos_ids": _eos_ids(f),
        "pad_id": f.get("pad_token_id", None, int),
        "bos_id": f.get("bos_token_id", None, int),
        "mask_id": f.get("mask_token_id", None, int),
    }
    if family == "llada":
        hidden, heads = f.need("d_model"), f.need("n_heads")
        for flag in ("include_bias", "include_qkv_bias", "attention_layer_norm", "scale_logits", "input_emb_norm"):
            if f.get(flag, False, bool):
                raise ConfigError(f"{path}: field {flag!r} = true is not supported for llada (LLaDA-8B has false)")
        if f.get("block_type", "llama", str) != "llama":
            raise ConfigError(f"{path}: field 'block_type' {cfg['block_type']!r} unsupported; expected 'llama'")
        spec = ModelSpec(
            hidden=hidden,
            n_layers=f.need("n_layers"),
            n_heads=heads,
            n_kv_heads=f.get("n_kv_heads", heads, int),
            head_dim=hidden // heads,
            vocab=f.get("embedding_size", None, int) or f.need("vocab_size"),
            intermediate=f.need("mlp_hidden_size"),
            eps=f.get("rms_norm_eps", 1e-5, float),
            rope_theta=f.get("rope_theta", 10000.0, float),
            rotary_dim=hidden // heads,
            tie_embeddings=f.get("weight_tying", False, bool),
            max_length=f.get("max_sequence_length", 4096, int),
            **common,
        )
    else:
        hidden, heads = f.need("hidden_size"), f.need("num_attention_heads")
        head_dim = f.get("head_dim", hidden // heads, int)
        base = dict(
            hidden=hidden,
            n_layers=f.need("num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=f.get("num_key_value_heads", heads, int),
            head_dim=head_dim,
            vocab=f.need("vocab_size"),
            eps=f.get("rms_norm_eps", 1e-6, float),
            rope_theta=f.get("rope_theta", 10000.0, float),
            rotary_dim=_rotary_dim(f, head_dim),
            tie_embeddings=f.get("tie_word_embeddings", False, bool),
            max_length=f.get("max_position_embeddings", 4096, int),
            **common,
        )
        if family == "dream":
            spec = ModelSpec(
                intermediate=f.need("intermediate_size"),
                qkv_bias=True,
                shift_logits=True,
                positions_from_padding=True,
                **base,
            )
        elif family == "llada_moe":
            moe = MoESpec(
                n_experts=f.need("num_experts"),
                top_k=f.need("num_experts_per_tok"),
                expert_intermediate=f.need("expert_intermediate_size", "moe_intermediate_size"),
                router="softmax",
                renormalize=f.get("norm_topk_prob", False, bool),
            )
            spec = ModelSpec(
                intermediate=moe.expert_intermediate, qk_norm=f.get("qk_layernorm", True, bool), moe=moe, **base
            )
        else:  # llada2
            if f.get("use_qkv_bias", False, bool):
                raise ConfigError(f"{path}: field 'use_qkv_bias' = true is not supported for llada2")
            router = f.get("score_function", "sigmoid", str)
            if router != "sigmoid":
                raise ConfigError(f"{path}: field 'score_function' {router!r} unsupported; expected 'sigmoid'")
            inter = f.need("intermediate_size")
            moe = MoESpec(
                n_experts=f.need("num_experts"),
                top_k=f.need("num_experts_per_tok"),
                expert_intermediate=f.need("moe_intermediate_size"),
                router="sigmoid_grouped",
                renormalize=f.get("norm_topk_prob", True, bool),
                routed_scale=f.get("routed_scaling_factor", 1.0, float),
                n_group=f.get("n_group", 1, int),
                topk_group=f.get("topk_group", 1, int),
                n_shared=f.get("num_shared_experts", 0, int),
                first_k_dense=f.get("first_k_dense_replace", 0, int),
                dense_intermediate=inter,
            )
            spec = ModelSpec(
                intermediate=inter,
                qk_norm=f.get("use_qk_norm", True, bool),
                fused_qkv=True,
                block_causal=True,
                default_block_size=f.get("block_size", 32, int),
                moe=moe,
                **base,
            )
    _check_spec(spec, path)
    return spec


def _check_spec(s: ModelSpec, path: Path) -> None:
    if s.n_heads % s.n_kv_heads:
        raise ConfigError(f"{path}: {s.n_heads} attention heads is not a multiple of {s.n_kv_heads} KV heads")
    if s.family == "llada" and s.hidden % s.n_heads:
        raise ConfigError(f"{path}: d_model {s.hidden} is not divisible by n_heads {s.n_heads}")
    for name, v in (("layers", s.n_layers), ("hidden size", s.hidden), ("vocab", s.vocab)):
        if v <= 0:
            raise ConfigError(f"{path}: {name} must be positive, found {v}")
    if s.moe is not None and s.moe.top_k > s.moe.n_experts:
        raise ConfigError(f"{path}: num_experts_per_tok {s.moe.top_k} exceeds num_experts {s.moe.n_experts}")


# ------------------------------------------------------------------------------ tensor plan


@dataclass(frozen=True)
class ParamPlan:
    """One IR parameter and how it is assembled from checkpoint tensors."""

    name: str  # IR parameter name
    shape: tuple[int, ...]
    sources: tuple[str, ...]  # checkpoint tensor names, in order
    source_shapes: tuple[tuple[int, ...], ...]
    transform: str = "copy"  # "copy" | "stack" (sources stacked on a new dim 0) | "stack_pairs" (gate/up per expert)
    keep_fp32: bool = False


def _p(name, shape, source, keep_fp32=False) -> ParamPlan:
    return ParamPlan(name, tuple(shape), (source,), (tuple(shape),), keep_fp32=keep_fp32)


def param_plan(s: ModelSpec) -> list[ParamPlan]:
    """Every IR parameter of the model with its checkpoint source names and shapes."""
    h, d, hd = s.hidden, s.n_heads * s.head_dim, s.head_dim
    kvd = s.n_kv_heads * hd
    plan: list[ParamPlan] = []
    if s.family == "llada":
        pre = "model.transformer."
        plan.append(_p("embed", (s.vocab, h), pre + "wte.weight"))
        for i in range(s.n_layers):
            b, L = f"{pre}blocks.{i}.", f"layers.{i}."
            plan += [
                _p(L + "attn_norm", (h,), b + "attn_norm.weight"),
                _p(L + "q", (d, h), b + "q_proj.weight"),
                _p(L + "k", (kvd, h), b + "k_proj.weight"),
                _p(L + "v", (kvd, h), b + "v_proj.weight"),
                _p(L + "o", (h, d), b + "attn_out.weight"),
                _p(L + "mlp_norm", (h,), b + "ff_norm.weight"),
                _p(L + "gate", (s.intermediate, h), b + "ff_proj.weight"),
                _p(L + "up", (s.intermediate, h), b + "up_proj.weight"),
                _p(L + "down", (h, s.intermediate), b + "ff_out.weight"),
            ]
        plan.append(_p("final_norm", (h,), pre + "ln_f.weight"))
        if not s.tie_embeddings:
            plan.append(_p("lm_head", (s.vocab, h), pre + "ff_out.weight"))
        return plan

    llada2 = s.family == "llada2"
    plan.append(_p("embed", (s.vocab, h), "model.word_embeddings.weight" if llada2 else "model.embed_tokens.weight"))
    for i in range(s.n_layers):
        b, L = f"model.layers.{i}.", f"layers.{i}."
        plan.append(_p(L + "attn_norm", (h,), b + "input_layernorm.weight"))
        if llada2:
            plan.append(_p(L + "qkv", (d + 2 * kvd, h), b + "attention.query_key_value.weight"))
            norms = (b + "attention.query_layernorm.weight", b + "attention.key_layernorm.weight")
            plan.append(_p(L + "o", (h, d), b + "attention.dense.weight"))
        else:
            a = b + "self_attn."
            plan += [
                _p(L + "q", (d, h), a + "q_proj.weight"),
                _p(L + "k", (kvd, h), a + "k_proj.weight"),
                _p(L + "v", (kvd, h), a + "v_proj.weight"),
                _p(L + "o", (h, d), a + "o_proj.weight"),
            ]
            if s.qkv_bias:
                plan += [
                    _p(L + "q_bias", (d,), a + "q_proj.bias"),
                    _p(L + "k_bias", (kvd,), a + "k_proj.bias"),
                    _p(L + "v_bias", (kvd,), a + "v_proj.bias"),
                ]
            norms = (a + "q_norm.weight", a + "k_norm.weight")
        if s.qk_norm:
            plan += [_p(L + "q_norm", (hd,), norms[0]), _p(L + "k_norm", (hd,), norms[1])]
        plan.append(_p(L + "mlp_norm", (h,), b + "post_attention_layernorm.weight"))
        m = b + "mlp."
        if not s.is_moe_layer(i):
            inter = s.moe.dense_intermediate if s.moe else s.intermediate
            plan += [
                _p(L + "gate", (inter, h), m + "gate_proj.weight"),
                _p(L + "up", (inter, h), m + "up_proj.weight"),
                _p(L + "down", (h, inter), m + "down_proj.weight"),
            ]
            continue
        moe = s.moe
        e, ei = moe.n_experts, moe.expert_intermediate
        plan.append(_p(L + "router", (e, h), m + "gate.weight", keep_fp32=True))
        if moe.router == "sigmoid_grouped":
            plan.append(_p(L + "expert_bias", (e,), m + "gate.expert_bias", keep_fp32=True))
        gate_up = tuple(f"{m}experts.{j}.{w}_proj.weight" for j in range(e) for w in ("gate", "up"))
        plan.append(ParamPlan(L + "experts_gate_up", (e, 2 * ei, h), gate_up, ((ei, h),) * (2 * e), "stack_pairs"))
        downs = tuple(f"{m}experts.{j}.down_proj.weight" for j in range(e))
        plan.append(ParamPlan(L + "experts_down", (e, h, ei), downs, ((h, ei),) * e, "stack"))
        if moe.n_shared:
            si = ei * moe.n_shared
            sh = m + "shared_experts."
            plan += [
                _p(L + "shared_gate", (si, h), sh + "gate_proj.weight"),
                _p(L + "shared_up", (si, h), sh + "up_proj.weight"),
                _p(L + "shared_down", (h, si), sh + "down_proj.weight"),
            ]
    plan.append(_p("final_norm", (h,), "model.norm.weight"))
    if not s.tie_embeddings:
        plan.append(_p("lm_head", (s.vocab, h), "lm_head.weight"))
    return plan


IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
"""Checkpoint tensors that carry no weights (recomputed buffers); skipped silently."""
