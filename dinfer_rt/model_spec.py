"""Model families: read config.json into a :class:`ModelSpec` and list the tensors it implies.

Families (``docs/models.md``): ``llada`` (LLaDA-8B layout), ``illada`` (iLLaDA-8B: the LLaDA
layout with grouped KV heads and a tied head; unknown config keys refused), ``dream`` (Qwen2
names, shifted logits), ``llada_moe`` (LLaDA-MoE-7B-A1B), ``llada2`` (LLaDA2.0 / BailingMoeV2:
fused ``query_key_value``, partial RoPE, group-limited sigmoid router, first dense layers,
block-causal attention), ``sdar`` / ``sdar_moe`` (SDAR: Qwen3 / Qwen3-MoE layers under
block-causal attention, SDAR's KV rule). The family is decided from ``architectures`` /
``model_type`` and MoE fields, never from ``model_type`` alone (dense LLaDA and LLaDA-MoE share it).

Defaults: a field a config.json omits takes the upstream configuration class's default (the
``DEFAULTS`` table per family), or, where that default is a variant dinfer-rt does not
implement (LLaDA's LayerNorm, a non-RoPE model, biased LLaDA2 linears...), the field is
required. A field that changes the math and is not implemented is rejected naming it; a
config's value is never silently replaced.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dinfer_rt.errors import ConfigError, GenerationError

FAMILIES = ("llada", "illada", "dream", "llada_moe", "llada2", "sdar", "sdar_moe")
LLADA_LAYOUT = ("llada", "illada")
"""Families read from LLaDA-8B's OLMo-derived config keys and ``model.transformer.*`` tensors."""

# Upstream configuration-class defaults of the fields dinfer-rt reads (LLaDA: the OLMo-derived
# ModelConfig of configuration_llada.py; Dream: Qwen2Config; LLaDA-MoE: LLaDAMoEConfig; LLaDA2:
# LLaDA2MoeConfig). Absent here = no usable default: the field is required.
DEFAULTS: dict[str, dict[str, Any]] = {
    "llada": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_sequence_length": 1024,
        "weight_tying": True,
        "mlp_ratio": 4,
        "activation_type": "swiglu",
    },
    "dream": {
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "llada_moe": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "partial_rotary_factor": 1.0,
        "qk_layernorm": True,
    },
    "llada2": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 16384,
        "tie_word_embeddings": False,
        "partial_rotary_factor": 0.5,
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "num_shared_experts": 0,
        "first_k_dense_replace": 0,
        "use_qk_norm": True,
    },
    # SDARConfig (JetAstra/SDAR) is Qwen3Config's field set; the MoE variant Qwen3MoeConfig's, which
    # has no head_dim (its attention falls back to hidden_size // num_attention_heads).
    "sdar": {
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "head_dim": 128,
    },
    "sdar_moe": {
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
}
DEFAULTS["illada"] = dict(DEFAULTS["llada"])  # iLLaDA reuses LLaDA's configuration code

# Family defaults that are not configuration-class defaults: what the reference inference code
# assumes when a config omits the key (SGLang's DLLM_PARAMS for SDAR; LLaDA's README for iLLaDA:
# "by setting mask_id=5, iLLaDA can directly reuse the existing LLaDA inference code").
FAMILY_MASK_IDS: dict[str, int] = {"sdar": 151669, "sdar_moe": 151669, "illada": 5}
FAMILY_BLOCK_SIZES: dict[str, int] = {"llada2": 32, "sdar": 4, "sdar_moe": 4}

# iLLaDA's config keys are not published: the keys dinfer-rt knows (LLaDA-8B's config.json: the
# OLMo-derived ModelConfig fields, and HF bookkeeping) are accepted, any other key is refused
# naming it rather than guessed at. Those that change the math are checked as for LLaDA.
ILLADA_KNOWN_FIELDS = frozenset(
    {
        "_name_or_path", "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype",
        "use_cache", "quantization_config", "activation_type", "alibi", "alibi_bias_max", "attention_dropout",
        "attention_layer_norm", "attention_layer_norm_with_affine", "bias_for_layer_norm", "block_group_size",
        "block_type", "clip_qkv", "d_model", "embedding_dropout", "embedding_size", "flash_attention",
        "include_bias", "include_qkv_bias", "init_cutoff_factor", "init_device", "init_fn", "init_std",
        "input_emb_norm", "layer_norm_type", "layer_norm_with_affine", "max_sequence_length", "mlp_hidden_size",
        "mlp_ratio", "multi_query_attention", "n_heads", "n_kv_heads", "n_layers", "precision", "residual_dropout",
        "rms_norm_eps", "rope", "rope_full_precision", "rope_theta", "scale_logits", "vocab_size", "weight_tying",
        "mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id",
    }
)  # fmt: skip

# Cache policies (``sampling.CACHES``) whose forwards equal no-cache decoding. On a bidirectional
# model every cached position goes stale as the block fills, so only "none" is exact. On a
# block-causal model a finished block's K/V depend only on blocks before it, and the scheduler
# runs every policy as "recompute the current block (and, at a block's first step, the block just
# finished) over the cached earlier blocks": all exact (tests/test_scheduler.py). Under SDAR's KV
# rule (denoising forwards store nothing) "delayed" has no meaning: it exists to keep the current
# block's K/V from earlier denoising forwards, computed while other slots of the block were still
# masked, which block-causal attention reads. So SDAR runs every policy but that one.
CACHES_ALL = ("none", "prefix", "dual", "vicinity", "adaptive", "anchored", "delayed")
EXACT_CACHES_BIDIRECTIONAL = ("none",)
EXACT_CACHES_BLOCK_CAUSAL = CACHES_ALL
EXACT_CACHES_REENCODE = tuple(c for c in CACHES_ALL if c != "delayed")

# Turn-end / end-of-text token strings whose ids end a generation, per family (with the config's
# eos_token_id and the tokenizer's eos_token). LLaDA2 / LLaDA-MoE use the Ling chat format.
EOS_TOKENS: dict[str, tuple[str, ...]] = {
    "llada": ("<|eot_id|>", "<|endoftext|>"),
    "dream": ("<|im_end|>", "<|endoftext|>"),
    "llada_moe": ("<|role_end|>", "<|endoftext|>"),
    "llada2": ("<|role_end|>", "<|endoftext|>"),
    "illada": ("<|eot_id|>", "<|endoftext|>"),  # LLaDA's (iLLaDA's tokenizer is unpublished here)
    "sdar": ("<|im_end|>", "<|endoftext|>"),
    "sdar_moe": ("<|im_end|>", "<|endoftext|>"),
}


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
    # SDAR's KV rule: denoising forwards read the cache and store nothing; once a block has no mask
    # left, one more forward over its final tokens stores its K/V ("re-encode"); the prompt's whole
    # blocks are prefilled under the block mask. Such a model runs only exact cache policies.
    reencode_finished_blocks: bool = False
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i >= self.moe.first_k_dense

    @property
    def exact_cache_policies(self) -> tuple[str, ...]:
        """The cache policies whose decoding equals no-cache decoding token for token on this
        model: bidirectional, "none" only; block-causal, every policy (SDAR's KV rule: all but
        "delayed", which keeps K/V from denoising forwards)."""
        if not self.block_causal:
            return EXACT_CACHES_BIDIRECTIONAL
        return EXACT_CACHES_REENCODE if self.reencode_finished_blocks else EXACT_CACHES_BLOCK_CAUSAL

    def check_cache_policy(self, cache: str) -> None:
        """Refuse, in one line, a cache policy this model cannot run: a model defined with SDAR's
        KV rule (``reencode_finished_blocks``) has no approximate mode, so a policy outside
        ``exact_cache_policies`` is an error. Other families accept every policy (the
        approximate ones are their speed options)."""
        if self.reencode_finished_blocks and cache not in self.exact_cache_policies:
            raise GenerationError(
                f"cache {cache!r} is not exact for the {self.family} model (SDAR's KV rule: denoising forwards "
                f"store no K/V); use one of: {', '.join(self.exact_cache_policies)}"
            )


# Range rules applied whenever a field is read, so every message names the field.
_POSITIVE = {
    "d_model", "n_heads", "n_layers", "n_kv_heads", "hidden_size", "num_attention_heads", "num_hidden_layers",
    "vocab_size", "embedding_size", "intermediate_size", "mlp_hidden_size", "mlp_ratio", "head_dim", "num_experts",
    "num_experts_per_tok", "expert_intermediate_size", "moe_intermediate_size", "max_position_embeddings",
    "max_sequence_length", "n_group", "topk_group", "block_size", "rms_norm_eps", "rope_theta",
    "routed_scaling_factor",
}  # fmt: skip
_NON_NEGATIVE = {
    "num_key_value_heads", "num_shared_experts", "first_k_dense_replace", "shared_expert_intermediate_size",
    "mask_token_id", "pad_token_id", "bos_token_id",
}  # fmt: skip


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
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(f"{self.path}: field {name!r} should be {kind.__name__}, found {value!r}")
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"{self.path}: field {name!r} must be a finite number, found {value!r}")
        if name in _POSITIVE and not value > 0:
            raise ConfigError(f"{self.path}: field {name!r} must be > 0, found {value!r}")
        if name in _NON_NEGATIVE and value < 0:
            raise ConfigError(f"{self.path}: field {name!r} must be >= 0, found {value!r}")
        return value

    def upstream(self, name: str, kind: type | None = None) -> Any:
        """The field, else the upstream config class's default (``DEFAULTS``), else an error."""
        default = DEFAULTS[self.family].get(name)
        if default is None:
            return self.need(name, kind=kind or int)
        return self.get(name, default, kind or type(default))

    def supported(self, name: str, allowed: tuple, default: Any = None, required: bool = False) -> Any:
        """A field that selects a variant of the math: absent takes the upstream ``default``
        (``required``: upstream's default is a variant not implemented); any value outside
        ``allowed`` is rejected naming the field."""
        if name not in self.cfg:
            if required:
                raise ConfigError(
                    f"{self.path}: missing field {name!r}: the upstream default {default!r} is not supported "
                    f"for {self.family} (supported: {', '.join(map(repr, allowed))})"
                )
            return default
        value = self.cfg[name]
        if not any(value == a and type(value) is type(a) for a in allowed):  # True is not 1 here
            raise ConfigError(
                f"{self.path}: field {name!r} = {value!r} is not supported for {self.family} "
                f"(supported: {', '.join(map(repr, allowed))})"
            )
        return value


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if model_dir.is_file():
        raise ConfigError(f"{model_dir} is a file; the model path must be a folder with config.json")
    if not model_dir.is_dir():
        raise ConfigError(f"model folder {model_dir} does not exist")
    if not path.is_file():
        raise ConfigError(f"{path}: not found (a model folder needs config.json, *.safetensors and tokenizer.json)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


def detect_family(cfg: dict[str, Any], path: Path) -> str:
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{path}: field 'architectures' should be a list of class names, found {archs!r}")
    mtype = cfg.get("model_type", "")
    if not isinstance(mtype, str):
        raise ConfigError(f"{path}: field 'model_type' should be a string, found {mtype!r}")
    arch = " ".join(archs)
    auto = json.dumps(cfg.get("auto_map", {}))
    if ("Bailing" in arch or mtype.startswith("bailing")) and "LLaDA2" not in arch and not mtype.startswith("llada2"):
        raise ConfigError(
            f"{path}: architectures {archs} (model_type {mtype!r}) is an autoregressive Ling/BailingMoe model, "
            "not a diffusion model; dinfer-rt runs LLaDA2 checkpoints (LLaDA2MoeModelLM, model_type llada2_moe)"
        )
    if mtype.startswith("llada2") or "LLaDA2" in arch:
        return "llada2"
    if mtype.lower().startswith("sdar") or "SDAR" in arch:
        moe = "moe" in mtype.lower() or "Moe" in arch or "num_experts" in cfg
        return "sdar_moe" if moe else "sdar"
    if mtype.lower() == "dream" or "Dream" in arch:
        return "dream"
    name = cfg.get("_name_or_path", "")
    if "illada" in " ".join((mtype, arch, auto, name if isinstance(name, str) else "")).lower():
        return "illada"  # iLLaDA's own keys are unpublished: any of these naming it decides
    if mtype == "llada" or "LLaDA" in arch or "llada" in auto.lower():
        moe = "num_experts" in cfg or "MoE" in arch or "moe" in auto.lower()
        return "llada_moe" if moe else "llada"
    raise ConfigError(
        f"{path}: unsupported model_type {mtype!r} (architectures {archs}); "
        f"supported: llada, llada (MoE), iLLaDA, Dream, llada2_moe, sdar, sdar_moe"
    )


def _eos_ids(f: _Fields) -> tuple[int, ...]:
    eos = f.cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{f.path}: field 'eos_token_id' should be an id >= 0 or a list of them, found {eos!r}")
    return tuple(ids)


def _rotary_dim(f: _Fields, head_dim: int, head_dim_from: str = "head_dim") -> int:
    factor = f.get("partial_rotary_factor", DEFAULTS[f.family].get("partial_rotary_factor", 1.0), float)
    if not 0 < factor <= 1:
        raise ConfigError(f"{f.path}: field 'partial_rotary_factor' must be in (0, 1], found {factor}")
    rd = int(head_dim * factor)
    if not 0 < rd <= head_dim or rd % 2:
        raise ConfigError(
            f"{f.path}: field 'partial_rotary_factor' ({factor}) of a head_dim {head_dim} ({head_dim_from}) gives "
            f"rotary dim {rd}, not an even number in 1..{head_dim}"
        )
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
        "mask_id": f.get("mask_token_id", FAMILY_MASK_IDS.get(family), int),
    }
    if family == "illada":
        _only_known_fields(f, ILLADA_KNOWN_FIELDS)
    if family in LLADA_LAYOUT:
        spec = _llada(f, common)
    else:
        _no_unimplemented(f)
        hidden, heads = f.need("hidden_size"), f.need("num_attention_heads")
        if cfg.get("head_dim") is None and hidden < heads:
            raise ConfigError(
                f"{path}: field 'hidden_size' ({hidden}) is smaller than 'num_attention_heads' ({heads}): "
                "no head_dim is given and hidden_size // heads would be 0"
            )
        head_dim = f.get("head_dim", DEFAULTS[family].get("head_dim", hidden // heads), int)
        kv_heads = f.get("num_key_value_heads", 0, int) if family == "llada2" else f.need("num_key_value_heads")
        if kv_heads == 0 and family != "llada2":
            raise ConfigError(f"{path}: field 'num_key_value_heads' must be > 0, found 0")
        base = dict(
            hidden=hidden,
            n_layers=f.need("num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=kv_heads or heads,  # LLaDA2: 0 (its default) means one KV head per query head
            head_dim=head_dim,
            vocab=f.need("vocab_size"),
            eps=f.upstream("rms_norm_eps", float),
            rope_theta=f.upstream("rope_theta", float),
            rotary_dim=_rotary_dim(
                f, head_dim, "head_dim" if cfg.get("head_dim") is not None else "hidden_size // num_attention_heads"
            ),
            tie_embeddings=f.upstream("tie_word_embeddings", bool),
            max_length=f.upstream("max_position_embeddings", int),
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
            spec = _llada_moe(f, base)
        elif family in ("sdar", "sdar_moe"):
            spec = _sdar(f, base)
        else:
            spec = _llada2(f, base)
    _check_spec(spec, path)
    return spec


def _llada(f: _Fields, common: dict[str, Any]) -> ModelSpec:
    """LLaDA-8B's OLMo-derived config. Variants of the math it does not implement are refused;
    where the config class's default is such a variant (LayerNorm, sequential blocks, no RoPE),
    the field must be present."""
    f.supported("layer_norm_type", ("rms",), "default", required=True)
    f.supported("block_type", ("llama",), "sequential", required=True)
    f.supported("rope", (True,), False, required=True)
    f.supported("activation_type", ("silu", "swiglu"), "swiglu")
    f.supported("alibi", (False,), False)
    f.supported("bias_for_layer_norm", (None, False), None)
    f.supported("clip_qkv", (None,), None)
    f.supported("layer_norm_with_affine", (True,), True)
    for flag in ("include_bias", "include_qkv_bias", "attention_layer_norm", "scale_logits", "input_emb_norm"):
        f.supported(flag, (False,), False)
    hidden, heads = f.need("d_model"), f.need("n_heads")
    if "embedding_size" not in f.cfg:
        raise ConfigError(
            f"{f.path}: missing field 'embedding_size' (the upstream default is 50304 rows, not vocab_size; "
            "write null to use vocab_size)"
        )
    if hidden % heads == 0 and (hidden // heads) % 2:
        raise ConfigError(
            f"{f.path}: fields 'd_model' ({hidden}) / 'n_heads' ({heads}) give head_dim {hidden // heads}; "
            "RoPE over the whole head needs an even head_dim"
        )
    mqa = f.get("multi_query_attention", False, bool)
    return ModelSpec(
        hidden=hidden,
        n_layers=f.need("n_layers"),
        n_heads=heads,
        n_kv_heads=f.get("n_kv_heads", 1 if mqa else heads, int),
        head_dim=hidden // heads if heads > 0 else 0,
        vocab=f.get("embedding_size", None, int) or f.need("vocab_size"),
        intermediate=f.get("mlp_hidden_size", None, int) or f.upstream("mlp_ratio", int) * hidden,
        eps=f.upstream("rms_norm_eps", float),
        rope_theta=f.upstream("rope_theta", float),
        rotary_dim=hidden // heads if heads > 0 else 0,
        tie_embeddings=f.upstream("weight_tying", bool),
        max_length=f.upstream("max_sequence_length", int),
        **common,
    )


def _only_known_fields(f: _Fields, known: frozenset[str]) -> None:
    """A family whose config keys are not published (iLLaDA): every key must be one dinfer-rt
    knows, so a field that might change the math is refused by name instead of ignored."""
    unknown = sorted(k for k in f.cfg if k not in known)
    if unknown:
        raise ConfigError(
            f"{f.path}: field(s) {', '.join(map(repr, unknown))} are unknown to dinfer-rt for {f.family} "
            "(its config keys are unpublished; only LLaDA-8B's keys are understood)"
        )


def _no_unimplemented(f: _Fields) -> None:
    """Fields of the HF-style families that change the math and are not implemented."""
    f.supported("hidden_act", ("silu",), "silu")
    f.supported("clip_qkv", (None,), None)
    f.supported("rope_scaling", (None,), None)


def _llada_moe(f: _Fields, base: dict[str, Any]) -> ModelSpec:
    """LLaDA-MoE: softmax top-k routing, no renormalisation (the upstream model ignores
    ``norm_topk_prob``), every layer an MoE layer, no shared experts, no expert bias."""
    layers = base["n_layers"]
    freq = f.cfg.get("moe_layer_freq")
    if isinstance(freq, list) and len(freq) != layers:
        raise ConfigError(
            f"{f.path}: field 'moe_layer_freq' has {len(freq)} entries but 'num_hidden_layers' is {layers}"
        )
    if freq is not None and freq != 1 and freq != [1] * layers:
        raise ConfigError(
            f"{f.path}: field 'moe_layer_freq' = {freq!r} has dense layers, which are not supported for "
            f"llada_moe (supported: every layer MoE, [1] * {layers})"
        )
    if f.get("shared_expert_intermediate_size", 0, int) > 0:
        raise ConfigError(f"{f.path}: field 'shared_expert_intermediate_size' > 0: shared experts are not supported")
    f.supported("moe_router_enable_expert_bias", (False,), False)
    f.supported("moe_router_score_function", ("softmax",), "softmax")
    f.supported("attention_bias", (False,), False)
    f.supported("router_num_group", (None,), None)
    f.supported("router_topk_group", (None,), None)
    if f.get("routed_scaling_factor", 1.0, float) != 1.0:
        raise ConfigError(f"{f.path}: field 'routed_scaling_factor' != 1 is not supported for llada_moe")
    moe = MoESpec(
        n_experts=f.need("num_experts"),
        top_k=f.need("num_experts_per_tok"),
        expert_intermediate=f.need("expert_intermediate_size", "moe_intermediate_size"),
        router="softmax",
        renormalize=False,
    )
    return ModelSpec(intermediate=moe.expert_intermediate, qk_norm=f.upstream("qk_layernorm", bool), moe=moe, **base)


def _llada2(f: _Fields, base: dict[str, Any]) -> ModelSpec:
    """LLaDA2.0 (BailingMoeV2 layout): sigmoid group-limited routing with expert bias. The
    upstream gate renormalises only when it keeps more than one expert."""
    f.supported("use_qkv_bias", (False,), False)
    f.supported("use_bias", (False,), True, required=True)
    f.supported("norm_head", (False,), False)
    f.supported("score_function", ("sigmoid",), "sigmoid")
    inter = f.need("intermediate_size")
    top_k = f.need("num_experts_per_tok")
    moe = MoESpec(
        n_experts=f.need("num_experts"),
        top_k=top_k,
        expert_intermediate=f.need("moe_intermediate_size"),
        router="sigmoid_grouped",
        renormalize=f.need("norm_topk_prob", kind=bool) and top_k > 1,
        routed_scale=f.upstream("routed_scaling_factor", float),
        n_group=f.upstream("n_group", int),
        topk_group=f.upstream("topk_group", int),
        n_shared=f.upstream("num_shared_experts", int),
        first_k_dense=f.upstream("first_k_dense_replace", int),
        dense_intermediate=inter,
    )
    return ModelSpec(
        intermediate=inter,
        qk_norm=f.upstream("use_qk_norm", bool),
        fused_qkv=True,
        block_causal=True,
        default_block_size=f.get("block_size", FAMILY_BLOCK_SIZES["llada2"], int),
        moe=moe,
        **base,
    )


def _sdar(f: _Fields, base: dict[str, Any]) -> ModelSpec:
    """SDAR (JetAstra/SDAR; SGLang ``models/sdar.py``): Qwen3 layers (per-head QK-norm before
    RoPE, GQA, no bias) under block-diffusion attention at absolute aligned blocks, no logit
    shift; ``sdar_moe`` has Qwen3-MoE experts (softmax router over all experts, top-k,
    renormalised when ``norm_topk_prob``, every layer sparse). Block size and mask id come from
    the config, else the family defaults (``FAMILY_BLOCK_SIZES`` / ``FAMILY_MASK_IDS``)."""
    f.supported("attention_bias", (False,), False)
    f.supported("use_sliding_window", (False,), False)
    block = dict(
        qk_norm=True,
        block_causal=True,
        default_block_size=f.get("block_size", FAMILY_BLOCK_SIZES[f.family], int),
        reencode_finished_blocks=True,
    )
    if f.family == "sdar":
        return ModelSpec(intermediate=f.need("intermediate_size"), **block, **base)
    f.supported("decoder_sparse_step", (1,), 1)  # other steps interleave dense layers
    f.supported("mlp_only_layers", (None, []), None)
    moe = MoESpec(
        n_experts=f.need("num_experts"),
        top_k=f.need("num_experts_per_tok"),
        expert_intermediate=f.need("moe_intermediate_size"),
        router="softmax",
        renormalize=f.need("norm_topk_prob", kind=bool),
    )
    return ModelSpec(intermediate=moe.expert_intermediate, moe=moe, **block, **base)


def _check_spec(s: ModelSpec, path: Path) -> None:
    """Checks across fields (each field's own range is checked as it is read)."""
    llada = s.family in LLADA_LAYOUT
    heads, kv = ("n_heads", "n_kv_heads") if llada else ("num_attention_heads", "num_key_value_heads")
    if s.n_heads % s.n_kv_heads:
        raise ConfigError(f"{path}: field {heads!r} ({s.n_heads}) is not a multiple of {kv!r} ({s.n_kv_heads})")
    if llada and s.hidden % s.n_heads:
        raise ConfigError(f"{path}: field 'd_model' ({s.hidden}) is not divisible by 'n_heads' ({s.n_heads})")
    vocab_field = "embedding_size" if llada and s.config.get("embedding_size") else "vocab_size"
    if s.config.get("mask_token_id") is None and s.mask_id is not None and not 0 <= s.mask_id < s.vocab:
        raise ConfigError(
            f"{path}: no field 'mask_token_id', and the {s.family} default mask id {s.mask_id} is outside the "
            f"vocabulary ({vocab_field} {s.vocab}); set 'mask_token_id'"
        )
    ids = [("mask_token_id", s.mask_id), ("pad_token_id", s.pad_id), ("bos_token_id", s.bos_id)]
    ids += [("eos_token_id", i) for i in s.eos_ids]
    for name, i in ids:
        if i is not None and not 0 <= i < s.vocab:
            raise ConfigError(f"{path}: field {name!r} = {i} is outside the vocabulary ({vocab_field} {s.vocab})")
    if s.moe is not None:
        m = s.moe
        if m.top_k > m.n_experts:
            raise ConfigError(f"{path}: field 'num_experts_per_tok' ({m.top_k}) exceeds 'num_experts' ({m.n_experts})")
        if m.n_experts % m.n_group or m.topk_group > m.n_group:
            raise ConfigError(
                f"{path}: fields 'n_group' ({m.n_group}) / 'topk_group' ({m.topk_group}) do not split "
                f"'num_experts' ({m.n_experts}) into equal groups with at most n_group kept"
            )
        if m.top_k > m.topk_group * (m.n_experts // m.n_group):
            raise ConfigError(
                f"{path}: field 'num_experts_per_tok' ({m.top_k}) exceeds the experts kept: 'topk_group' "
                f"({m.topk_group}) groups of num_experts / 'n_group' ({m.n_experts} / {m.n_group})"
            )


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
    if s.family in LLADA_LAYOUT:
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
