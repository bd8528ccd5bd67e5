"""Write tiny random checkpoints in the exact real layouts (config fields, tensor names, shapes).

Used by the loader, lowering and reference-equivalence tests. Sizes are chosen to
exercise GQA, odd head counts, partial rotary and sharded files while staying < 1 MB.
"""

from __future__ import annotations

import json
from pathlib import Path

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
) -> Path:
    """LLaDA-8B layout (``model.transformer.*``; ``ff_out`` both MLP down and LM head)."""
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
        auto_map={"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM"},
    )
    p = "model.transformer."
    t = {
        p + "wte.weight": _rand(g, vocab, d, scale=1.0),
        p + "ln_f.weight": _norm(g, d),
        p + "ff_out.weight": _rand(g, vocab, d),
    }
    _llada_blocks(g, t, p, layers, d, heads, kv, mlp)
    return save(path, cfg, t, shards, dtype)


def _llada_blocks(g, t: dict, p: str, layers: int, d: int, heads: int, kv: int, mlp: int) -> None:
    """LLaDA-8B's decoder blocks (``{p}blocks.{i}.*``), added to ``t``."""
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


def illada(
    path: Path,
    *,
    d: int = 64,
    layers: int = 2,
    heads: int = 8,
    kv_heads: int = 2,
    mlp: int = 96,
    vocab: int = 61,
    seed: int = 11,
    shards: int = 1,
) -> Path:
    """iLLaDA-8B's shape in miniature: the LLaDA layout with grouped KV heads (4:1 here, as 32:8),
    a tied head (no top-level ``ff_out``) and no ``mask_token_id`` (the family default 5 is the
    tokenizer's mask here). Its real config keys are unpublished: this one names the model in
    ``architectures`` / ``model_type`` and otherwise uses LLaDA-8B's keys."""
    g = torch.Generator().manual_seed(seed)
    cfg = llada_config(
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        mlp=mlp,
        vocab=vocab,
        rope_theta=500000.0,
        max_len=256,
        mask_id=MASK,
        eos_id=EOS,
        architectures=["iLLaDAModelLM"],
        model_type="illada",
        weight_tying=True,
    )
    del cfg["mask_token_id"]
    p = "model.transformer."
    t = {p + "wte.weight": _rand(g, vocab, d, scale=1.0), p + "ln_f.weight": _norm(g, d)}
    _llada_blocks(g, t, p, layers, d, heads, kv_heads, mlp)
    return save(path, cfg, t, shards)


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


def dream(
    path: Path,
    *,
    d: int = 56,
    layers: int = 2,
    heads: int = 7,
    kv_heads: int = 1,
    mlp: int = 72,
    vocab: int = 61,
    seed: int = 1,
    shards: int = 1,
    tie: bool = False,
) -> Path:
    """Dream layout: Qwen2 names, q/k/v biases, GQA, shifted logits."""
    g = torch.Generator().manual_seed(seed)
    hd = d // heads
    cfg = {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "hidden_size": d,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": mlp,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 512,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "mask_token_id": MASK,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
        "bos_token_id": 2,
    }
    t = {"model.embed_tokens.weight": _rand(g, vocab, d, scale=1.0), "model.norm.weight": _norm(g, d)}
    if not tie:
        t["lm_head.weight"] = _rand(g, vocab, d)
    for i in range(layers):
        b = f"model.layers.{i}."
        t |= {b + "input_layernorm.weight": _norm(g, d), b + "post_attention_layernorm.weight": _norm(g, d)}
        _attn_qwen(g, t, b, d, heads, kv_heads, hd, bias=True)
        _mlp(g, t, b + "mlp.", d, mlp)
    return save(path, cfg, t, shards)


def _hf_config(arch: str, model_type: str, d, layers, heads, kv_heads, head_dim, vocab, theta, **fields) -> dict:
    """The config.json keys LLaDA-MoE and LLaDA2 share (HF names), then the family's own."""
    return {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": d,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rope_theta": theta,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "mask_token_id": MASK,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
        **fields,
    }


def _moe_tensors(g, embed: str, d: int, vocab: int) -> dict:
    return {
        embed: _rand(g, vocab, d, scale=1.0),
        "model.norm.weight": _norm(g, d),
        "lm_head.weight": _rand(g, vocab, d),
    }


def _layer_norms(g, t, b, d) -> None:
    t |= {b + "input_layernorm.weight": _norm(g, d), b + "post_attention_layernorm.weight": _norm(g, d)}


def _qk_norms(g, t, b, head_dim, q_norm: str, k_norm: str) -> None:
    t |= {b + q_norm: _norm(g, head_dim), b + k_norm: _norm(g, head_dim)}


def _experts(g, t, m, d, experts, inter) -> None:
    for e in range(experts):
        _mlp(g, t, f"{m}experts.{e}.", d, inter)


def llada_moe(
    path: Path,
    *,
    d: int = 48,
    layers: int = 2,
    heads: int = 3,
    head_dim: int = 16,
    experts: int = 6,
    top_k: int = 2,
    inter: int = 24,
    vocab: int = 61,
    seed: int = 2,
    shards: int = 1,
) -> Path:
    """LLaDA-MoE-7B-A1B layout: per-head QK-norm, softmax top-k router without renormalisation;
    config keys as LLaDAMoEConfig writes them."""
    g = torch.Generator().manual_seed(seed)
    cfg = _hf_config(
        "LLaDAMoEModelLM",
        "llada",
        d,
        layers,
        heads,
        heads,
        head_dim,
        vocab,
        50000.0,
        num_experts=experts,
        num_experts_per_tok=top_k,
        expert_intermediate_size=inter,
        dense_intermediate_size=64,
        shared_expert_intermediate_size=None,  # LLaDAMoEConfig's default, written as null
        moe_layer_freq=[1] * layers,  # a list per layer, as the config class stores it
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
    t = _moe_tensors(g, "model.embed_tokens.weight", d, vocab)
    for i in range(layers):
        b = f"model.layers.{i}."
        _layer_norms(g, t, b, d)
        _qk_norms(g, t, b, head_dim, "self_attn.q_norm.weight", "self_attn.k_norm.weight")
        t[b + "mlp.gate.weight"] = _rand(g, experts, d)
        _attn_qwen(g, t, b, d, heads, heads, head_dim, bias=False)
        _experts(g, t, b + "mlp.", d, experts, inter)
    return save(path, cfg, t, shards)


def llada2(
    path: Path,
    *,
    d: int = 64,
    layers: int = 3,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    experts: int = 8,
    top_k: int = 3,
    n_group: int = 4,
    topk_group: int = 2,
    inter: int = 24,
    dense_inter: int = 40,
    shared: int = 1,
    vocab: int = 61,
    seed: int = 3,
    shards: int = 1,
    partial: float = 0.5,
) -> Path:
    """LLaDA2.0 (BailingMoeV2) layout: fused query_key_value, partial RoPE, group-limited sigmoid
    router; config keys as LLaDA2MoeConfig writes them (``use_bias: false`` included)."""
    g = torch.Generator().manual_seed(seed)
    cfg = _hf_config(
        "LLaDA2MoeModelLM",
        "llada2_moe",
        d,
        layers,
        heads,
        kv_heads,
        head_dim,
        vocab,
        600000.0,
        use_qkv_bias=False,
        use_qk_norm=True,
        use_bias=False,
        norm_head=False,
        partial_rotary_factor=partial,
        first_k_dense_replace=1,
        intermediate_size=dense_inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        num_shared_experts=shared,
        score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    t = _moe_tensors(g, "model.word_embeddings.weight", d, vocab)
    for i in range(layers):
        b = f"model.layers.{i}."
        _layer_norms(g, t, b, d)
        t[b + "attention.query_key_value.weight"] = _rand(g, (heads + 2 * kv_heads) * head_dim, d)
        _qk_norms(g, t, b, head_dim, "attention.query_layernorm.weight", "attention.key_layernorm.weight")
        t[b + "attention.dense.weight"] = _rand(g, d, heads * head_dim)
        if i == 0:
            _mlp(g, t, b + "mlp.", d, dense_inter)
            continue
        t[b + "mlp.gate.weight"] = _rand(g, experts, d)
        t[b + "mlp.gate.expert_bias"] = 0.1 * torch.randn(experts, generator=g)
        _experts(g, t, b + "mlp.", d, experts, inter)
        if shared:
            _mlp(g, t, b + "mlp.shared_experts.", d, inter * shared)
    return save(path, cfg, t, shards)


def sdar(
    path: Path,
    *,
    d: int = 48,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    mlp: int = 72,
    experts: int = 0,
    top_k: int = 2,
    inter: int = 24,
    norm_topk_prob: bool = True,
    vocab: int = 61,
    seed: int = 9,
    shards: int = 1,
    tie: bool = False,
    block_size: int = 4,
) -> Path:
    """SDAR layout (Qwen3 tensor names: ``self_attn.{q,k,v,o}_proj``, per-head
    ``self_attn.{q,k}_norm``, ``mlp.*``); ``experts`` > 0 writes the SDARMoe variant (Qwen3-MoE
    names: ``mlp.gate``, ``mlp.experts.{e}.*``). head_dim is set apart from hidden / heads, as
    Qwen3 allows. Config keys as the authors' config.json writes them (``config_writers.sdar_config``)."""
    g = torch.Generator().manual_seed(seed)
    moe = None
    if experts:
        moe = {
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": inter,
            "norm_topk_prob": norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }
    cfg = sdar_config(
        hidden=d,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=mlp,
        vocab=vocab,
        rope_theta=1000000.0,
        max_len=512,
        mask_id=MASK,
        eos_id=EOS,
        bos_id=2,  # the test tokenizer's <|startoftext|>
        block_size=block_size,
        tie=tie,
        moe=moe,
    )
    t = {"model.embed_tokens.weight": _rand(g, vocab, d, scale=1.0), "model.norm.weight": _norm(g, d)}
    if not tie:
        t["lm_head.weight"] = _rand(g, vocab, d)
    for i in range(layers):
        b = f"model.layers.{i}."
        _layer_norms(g, t, b, d)
        _attn_qwen(g, t, b, d, heads, kv_heads, head_dim, bias=False)
        _qk_norms(g, t, b, head_dim, "self_attn.q_norm.weight", "self_attn.k_norm.weight")
        if experts:
            t[b + "mlp.gate.weight"] = _rand(g, experts, d)
            _experts(g, t, b + "mlp.", d, experts, inter)
        else:
            _mlp(g, t, b + "mlp.", d, mlp)
    return save(path, cfg, t, shards)


def sdar_moe(path: Path, **kwargs) -> Path:
    """The SDARMoe variant of :func:`sdar` (6 experts, top-2, renormalised) unless told otherwise."""
    return sdar(path, **{"experts": 6, "seed": 10, **kwargs})
