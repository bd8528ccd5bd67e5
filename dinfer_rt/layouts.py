"""Writers of real checkpoint config layouts, shared by the embedded model's training script
and the tiny test checkpoints (readers live in :mod:`dinfer_rt.spec`)."""

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
