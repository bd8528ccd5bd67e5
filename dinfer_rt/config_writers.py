"""Writers of real checkpoint config layouts, shared by the embedded model's training script
and the tiny test checkpoints (readers live in :mod:`dinfer_rt.model_spec`)."""

from __future__ import annotations

from typing import Any


def llada_config(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    mlp: int,
    vocab: int,
    rope_theta: float,
    max_len: int,
    mask_id: int,
    eos_id: int,
    bos_id: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """config.json of an LLaDA-8B-layout model (``model_type: llada``, OLMo-derived field names).

    ``extra`` adds or overrides fields (``auto_map``, ``bos_token_id``, ``precision``...).
    """
    cfg: dict[str, Any] = {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "mlp_hidden_size": mlp,
        "mlp_ratio": 4,
        "activation_type": "silu",
        "block_type": "llama",
        "layer_norm_type": "rms",
        "rms_norm_eps": 1e-5,
        "rope": True,
        "rope_theta": rope_theta,
        "rope_full_precision": True,
        "max_sequence_length": max_len,
        "vocab_size": vocab,
        "embedding_size": vocab,
        "weight_tying": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "attention_layer_norm": False,
        "scale_logits": False,
        "input_emb_norm": False,
        "mask_token_id": mask_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        **({"bos_token_id": bos_id} if bos_id is not None else {}),
        "precision": "amp_bf16",
        "use_cache": False,
    }
    cfg.update(extra)
    return cfg


LLADA_8B = llada_config(
    d_model=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=32,
    mlp=12288,
    vocab=126464,
    rope_theta=500000.0,
    max_len=4096,
    mask_id=126336,
    eos_id=126081,
)
"""GSAI-ML/LLaDA-8B-Instruct's config.json (docs/models.md): for shape-only analysis, no weights."""


def sdar_config(
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
    rope_theta: float,
    max_len: int,
    mask_id: int,
    eos_id: int,
    bos_id: int | None = None,
    block_size: int = 4,
    tie: bool = False,
    moe: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """config.json of an SDAR model (JetAstra/SDAR: Qwen3Config's keys plus ``block_size`` and
    ``mask_token_id``; ``SDARForCausalLM``, ``model_type: sdar``). ``moe`` (Qwen3MoeConfig's
    ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``...)
    makes it the ``SDARMoeForCausalLM`` variant (``model_type: sdar_moe``, as LMDeploy reads it).
    ``extra`` adds or overrides fields."""
    kind = "SDARMoe" if moe else "SDAR"
    cfg: dict[str, Any] = {
        "architectures": [f"{kind}ForCausalLM"],
        "auto_map": {
            "AutoConfig": f"configuration_{kind.lower()}.{kind}Config",
            "AutoModel": f"modeling_{kind.lower()}.{kind}Model",
            "AutoModelForCausalLM": f"modeling_{kind.lower()}.{kind}ForCausalLM",
        },
        "model_type": "sdar_moe" if moe else "sdar",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "bos_token_id": eos_id if bos_id is None else bos_id,  # Qwen3: <|endoftext|> for both
        "eos_token_id": eos_id,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "mask_token_id": mask_id,
        "max_position_embeddings": max_len,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
        **(moe or {}),
    }
    cfg.update(extra)
    return cfg
