"""Write tiny random checkpoints in the exact real layouts (config fields, tensor names, shapes).

Used by the loader, lowering and reference-equivalence tests. Sizes are chosen to
exercise GQA, odd head counts, partial rotary and sharded files while staying < 1 MB.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file

from dinfer_rt.config_writers import llada_config, sdar_config

MASK, EOS = 5, 1


def _rand(gen: torch.Generator, *shape: int, scale: float | None = None) -> torch.Tensor:
    scale = scale if scale is not None else shape[-1] ** -0.5
    return torch.randn(*shape, generator=gen) * scale


def _norm(gen: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(n, generator=gen)


def write_tokenizer(path: Path, vocab: int, mask_token: str = "<|mask|>", with_template: bool = True) -> None:
    """A word-level tokenizer over ``vocab`` tokens: specials, then single characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|pad|>", "<|endoftext|>", "<|startoftext|>", "<|unk|>", "<|eot_id|>", mask_token]
    chars = [chr(ord("a") + i) for i in range(26)] + [chr(ord("A") + i) for i in range(26)] + list("0123456789 =+-")
    toks = (specials + chars)[:vocab]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(toks)}, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "mask_token": mask_token,
        "unk_token": "<|unk|>",
    }
    if with_template:
        cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def save(
    path: Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    vocab: int | None = None,
) -> Path:
    """Write config.json, safetensors (optionally sharded with an index) and a tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
    else:
        names = list(tensors)
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, str(path / fname))
            weight_map.update({n: fname for n in part})
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": weight_map,
        }
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    write_tokenizer(path, vocab or config.get("embedding_size") or config["vocab_size"])
    return path


def _sizes(given: dict[str, Any], *groups: dict[str, Any]) -> SimpleNamespace:
    """A writer's sizes: its defaults (``groups``, over vocab 61 and one shard) updated by the
    caller's keywords. The writers share these names, so each states one row of defaults instead
    of a long signature; an unknown name is still a TypeError."""
    defaults: dict[str, Any] = {"vocab": 61, "shards": 1}
    for group in groups:
        defaults |= group
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)} (sizes: {', '.join(defaults)})")
    return SimpleNamespace(**(defaults | given))


_LLADA_AUTO_MAP = {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM"}


def llada(
    path: Path,
    *,
    d: int = 48,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    mlp: int = 80,
    vocab: int = 61,
    seed: int = 0,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    max_len: int = 256,
    config: dict[str, Any] | None = None,
) -> Path:
    """LLaDA-8B layout (``model.transformer.*``; ``ff_out`` both MLP down and LM head). ``config``
    replaces config.json fields (None drops one; ``weight_tying: true`` drops the top-level ``ff_out``)."""
    g = torch.Generator().manual_seed(seed)
    kv = kv_heads or heads
    cfg = llada_config(
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        mlp=mlp,
        vocab=vocab,
        rope_theta=500000.0,
        max_len=max_len,
        mask_id=MASK,
        eos_id=EOS,
        **{"auto_map": _LLADA_AUTO_MAP, **(config or {})},
    )
    cfg = {k: v for k, v in cfg.items() if v is not None}
    p = "model.transformer."
    t = {p + "wte.weight": _rand(g, vocab, d, scale=1.0), p + "ln_f.weight": _norm(g, d)}
    if not cfg["weight_tying"]:
        t[p + "ff_out.weight"] = _rand(g, vocab, d)
    hd = d // heads
    for i in range(layers):
        b = f"{p}blocks.{i}."
        t |= {
            b + "attn_norm.weight": _norm(g, d),
            b + "q_proj.weight": _rand(g, heads * hd, d),
            b + "k_proj.weight": _rand(g, kv * hd, d),
            b + "v_proj.weight": _rand(g, kv * hd, d),
            b + "attn_out.weight": _rand(g, d, heads * hd),
            b + "ff_norm.weight": _norm(g, d),
            b + "ff_proj.weight": _rand(g, mlp, d),
            b + "up_proj.weight": _rand(g, mlp, d),
            b + "ff_out.weight": _rand(g, d, mlp),
        }
    return save(path, cfg, t, shards, dtype)


def illada(path: Path, **kwargs: Any) -> Path:
    """iLLaDA-8B's shape in miniature: the LLaDA layout with grouped KV heads (4:1 here, as 32:8),
    a tied head (no top-level ``ff_out``) and no ``mask_token_id`` (the family default 5 is the
    tokenizer's mask here). Its real config keys are unpublished: this one names the model in
    ``architectures`` / ``model_type`` and otherwise uses LLaDA-8B's keys."""
    config = {
        "architectures": ["iLLaDAModelLM"],
        "model_type": "illada",
        "weight_tying": True,
        "auto_map": None,
        "mask_token_id": None,
    }
    return llada(path, **{"d": 64, "heads": 8, "kv_heads": 2, "mlp": 96, "seed": 11, "config": config, **kwargs})


def _attn_qwen(g, t, b, d, heads, kv, hd, bias):
    a = b + "self_attn."
    t |= {
        a + "q_proj.weight": _rand(g, heads * hd, d),
        a + "k_proj.weight": _rand(g, kv * hd, d),
        a + "v_proj.weight": _rand(g, kv * hd, d),
        a + "o_proj.weight": _rand(g, d, heads * hd),
    }
    if bias:
        t |= {
            a + "q_proj.bias": _rand(g, heads * hd, scale=0.1),
            a + "k_proj.bias": _rand(g, kv * hd, scale=0.1),
            a + "v_proj.bias": _rand(g, kv * hd, scale=0.1),
        }


def _mlp(g, t, m, d, inter):
    t |= {
        m + "gate_proj.weight": _rand(g, inter, d),
        m + "up_proj.weight": _rand(g, inter, d),
        m + "down_proj.weight": _rand(g, d, inter),
    }


def _hf_config(s: SimpleNamespace, arch: str, model_type: str, theta: float, **fields) -> dict:
    """The config.json keys Dream, LLaDA-MoE and LLaDA2 share (HF names), from the writer's sizes
    (no ``kv_heads``: as many as heads; no ``head_dim``: no key, hidden / heads), then the family's own."""
    return {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": s.d,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": getattr(s, "kv_heads", s.heads),
        **({"head_dim": s.head_dim} if hasattr(s, "head_dim") else {}),
        "hidden_act": "silu",
        "rope_theta": theta,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "vocab_size": s.vocab,
        "tie_word_embeddings": False,
        "mask_token_id": MASK,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
        **fields,
    }


def _hf_tensors(g, embed: str, d: int, vocab: int, tie: bool = False) -> dict:
    """Embedding, final norm and (untied) LM head under the HF names."""
    t = {embed: _rand(g, vocab, d, scale=1.0), "model.norm.weight": _norm(g, d)}
    if not tie:
        t["lm_head.weight"] = _rand(g, vocab, d)
    return t


def _layer_norms(g, t, b, d) -> None:
    t |= {b + "input_layernorm.weight": _norm(g, d), b + "post_attention_layernorm.weight": _norm(g, d)}


def _qk_norms(g, t, b, head_dim, q_norm: str, k_norm: str) -> None:
    t |= {b + q_norm: _norm(g, head_dim), b + k_norm: _norm(g, head_dim)}


def _experts(g, t, m, d, experts, inter) -> None:
    for e in range(experts):
        _mlp(g, t, f"{m}experts.{e}.", d, inter)


def dream(path: Path, **sizes: Any) -> Path:
    """Dream layout: Qwen2 names, q/k/v biases, GQA, shifted logits. Sizes and defaults below."""
    s = _sizes(sizes, dict(d=56, layers=2, heads=7, kv_heads=1, mlp=72, seed=1, tie=False))
    g = torch.Generator().manual_seed(s.seed)
    cfg = _hf_config(s, "DreamModel", "Dream", 1e6, intermediate_size=s.mlp, tie_word_embeddings=s.tie, bos_token_id=2)
    t = _hf_tensors(g, "model.embed_tokens.weight", s.d, s.vocab, s.tie)
    for i in range(s.layers):
        b = f"model.layers.{i}."
        _layer_norms(g, t, b, s.d)
        _attn_qwen(g, t, b, s.d, s.heads, s.kv_heads, s.d // s.heads, bias=True)
        _mlp(g, t, b + "mlp.", s.d, s.mlp)
    return save(path, cfg, t, s.shards)


def llada_moe(path: Path, **sizes: Any) -> Path:
    """LLaDA-MoE-7B-A1B layout: per-head QK-norm, softmax top-k router without renormalisation;
    config keys as LLaDAMoEConfig writes them. Sizes and defaults below."""
    s = _sizes(sizes, dict(d=48, layers=2, heads=3, head_dim=16, experts=6, top_k=2, inter=24, seed=2))
    g = torch.Generator().manual_seed(s.seed)
    cfg = _hf_config(
        s,
        "LLaDAMoEModelLM",
        "llada",
        50000.0,
        num_experts=s.experts,
        num_experts_per_tok=s.top_k,
        expert_intermediate_size=s.inter,
        dense_intermediate_size=64,
        shared_expert_intermediate_size=None,  # LLaDAMoEConfig's default, written as null
        moe_layer_freq=[1] * s.layers,  # a list per layer, as the config class stores it
        moe_router_score_function="softmax",
        moe_router_enable_expert_bias=False,
        routed_scaling_factor=1,
        attention_bias=False,
        clip_qkv=None,
        norm_topk_prob=False,
        qk_layernorm=True,
        partial_rotary_factor=1.0,
        router_aux_loss_coef=0.01,
    )
    t = _hf_tensors(g, "model.embed_tokens.weight", s.d, s.vocab)
    for i in range(s.layers):
        b = f"model.layers.{i}."
        _layer_norms(g, t, b, s.d)
        _qk_norms(g, t, b, s.head_dim, "self_attn.q_norm.weight", "self_attn.k_norm.weight")
        t[b + "mlp.gate.weight"] = _rand(g, s.experts, s.d)
        _attn_qwen(g, t, b, s.d, s.heads, s.heads, s.head_dim, bias=False)
        _experts(g, t, b + "mlp.", s.d, s.experts, s.inter)
    return save(path, cfg, t, s.shards)


def llada2(path: Path, **sizes: Any) -> Path:
    """LLaDA2.0 (BailingMoeV2) layout: fused query_key_value, partial RoPE, group-limited sigmoid
    router; config keys as LLaDA2MoeConfig writes them (``use_bias: false`` included). Sizes and
    defaults below: the attention's, then the experts' (``shared``: shared experts)."""
    s = _sizes(
        sizes,
        dict(d=64, layers=3, heads=4, kv_heads=2, head_dim=16, partial=0.5, seed=3),
        dict(experts=8, top_k=3, n_group=4, topk_group=2, inter=24, dense_inter=40, shared=1),
    )
    g = torch.Generator().manual_seed(s.seed)
    cfg = _hf_config(
        s,
        "LLaDA2MoeModelLM",
        "llada2_moe",
        600000.0,
        use_qkv_bias=False,
        use_qk_norm=True,
        use_bias=False,
        norm_head=False,
        partial_rotary_factor=s.partial,
        first_k_dense_replace=1,
        intermediate_size=s.dense_inter,
        num_experts=s.experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=s.inter,
        num_shared_experts=s.shared,
        score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        n_group=s.n_group,
        topk_group=s.topk_group,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    d, hd = s.d, s.head_dim
    t = _hf_tensors(g, "model.word_embeddings.weight", d, s.vocab)
    for i in range(s.layers):
        b = f"model.layers.{i}."
        _layer_norms(g, t, b, d)
        t[b + "attention.query_key_value.weight"] = _rand(g, (s.heads + 2 * s.kv_heads) * hd, d)
        _qk_norms(g, t, b, hd, "attention.query_layernorm.weight", "attention.key_layernorm.weight")
        t[b + "attention.dense.weight"] = _rand(g, d, s.heads * hd)
        if i == 0:
            _mlp(g, t, b + "mlp.", d, s.dense_inter)
            continue
        t[b + "mlp.gate.weight"] = _rand(g, s.experts, d)
        t[b + "mlp.gate.expert_bias"] = 0.1 * torch.randn(s.experts, generator=g)
        _experts(g, t, b + "mlp.", d, s.experts, s.inter)
        if s.shared:
            _mlp(g, t, b + "mlp.shared_experts.", d, s.inter * s.shared)
    return save(path, cfg, t, s.shards)


def sdar(path: Path, **sizes: Any) -> Path:
    """SDAR layout (Qwen3 tensor names: ``self_attn.{q,k,v,o}_proj``, per-head
    ``self_attn.{q,k}_norm``, ``mlp.*``); ``experts`` > 0 writes the SDARMoe variant (Qwen3-MoE
    names: ``mlp.gate``, ``mlp.experts.{e}.*``). head_dim is set apart from hidden / heads, as
    Qwen3 allows. Config keys as the authors' config.json writes them (``config_writers.sdar_config``).
    Sizes and defaults below: the dense model's, then the experts'."""
    s = _sizes(
        sizes,
        dict(d=48, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=72, seed=9, tie=False, block_size=4),
        dict(experts=0, top_k=2, inter=24, norm_topk_prob=True),
    )
    g = torch.Generator().manual_seed(s.seed)
    moe = None
    if s.experts:
        moe = {
            "num_experts": s.experts,
            "num_experts_per_tok": s.top_k,
            "moe_intermediate_size": s.inter,
            "norm_topk_prob": s.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }
    d, hd = s.d, s.head_dim
    cfg = sdar_config(
        hidden=d,
        layers=s.layers,
        heads=s.heads,
        kv_heads=s.kv_heads,
        head_dim=hd,
        intermediate=s.mlp,
        vocab=s.vocab,
        rope_theta=1000000.0,
        max_len=512,
        mask_id=MASK,
        eos_id=EOS,
        bos_id=2,  # the test tokenizer's <|startoftext|>
        block_size=s.block_size,
        tie=s.tie,
        moe=moe,
    )
    t = _hf_tensors(g, "model.embed_tokens.weight", d, s.vocab, s.tie)
    for i in range(s.layers):
        b = f"model.layers.{i}."
        _layer_norms(g, t, b, d)
        _attn_qwen(g, t, b, d, s.heads, s.kv_heads, hd, bias=False)
        _qk_norms(g, t, b, hd, "self_attn.q_norm.weight", "self_attn.k_norm.weight")
        if s.experts:
            t[b + "mlp.gate.weight"] = _rand(g, s.experts, d)
            _experts(g, t, b + "mlp.", d, s.experts, s.inter)
        else:
            _mlp(g, t, b + "mlp.", d, s.mlp)
    return save(path, cfg, t, s.shards)


def sdar_moe(path: Path, **kwargs) -> Path:
    """The SDARMoe variant of :func:`sdar` (6 experts, top-2, renormalised) unless told otherwise."""
    return sdar(path, **{"experts": 6, "seed": 10, **kwargs})
