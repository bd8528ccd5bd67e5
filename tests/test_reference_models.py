"""Logits of every family against an independent reference, in float32.

LLaDA == transformers' LlamaForCausalLM with renamed weights and a non-causal mask;
Dream == Qwen2ForCausalLM (non-causal), then shifted; LLaDA-MoE and LLaDA2 against
plain implementations of the published math written here. Tolerance: <= 1e-5 relative
to the logits' scale (max |diff| / max |ref|).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import dinfer_rt
from dinfer_rt.testing import checkpoints

RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def hf_bidirectional_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Run an HF causal LM with an all-zero 4-D additive mask (everything visible)."""
    b, n = ids.shape
    mask = torch.zeros(b, 1, n, n, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


HF_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def hf_model(config_cls, model_cls, cfg: dict, fields: dict, **extra):
    """An eager HF model whose sizes come from ``cfg`` (HF field -> config.json key)."""
    sizes = {hf: cfg[ours] for hf, ours in fields.items()}
    hf_cfg = config_cls(
        **sizes, rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"], max_position_embeddings=512, **extra
    )
    hf_cfg._attn_implementation = "eager"
    return model_cls(hf_cfg).eval()


@pytest.mark.parametrize("name", ["llada", "llada_gqa_sharded"])
def test_llada_matches_transformers_llama(ckpt_dir, name):
    transformers = pytest.importorskip("transformers")
    path = ckpt_dir(name)
    cfg = json.loads((path / "config.json").read_text())
    fields = dict(zip(HF_FIELDS, ("embedding_size", "d_model", "mlp_hidden_size", "n_layers", "n_heads", "n_kv_heads")))
    ref = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, cfg, fields, tie_word_embeddings=False)
    rename = {
        "wte": "model.embed_tokens",
        "ln_f": "model.norm",
        "ff_out": "lm_head",
        "attn_norm": "input_layernorm",
        "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj",
        "v_proj": "self_attn.v_proj",
        "attn_out": "self_attn.o_proj",
        "ff_norm": "post_attention_layernorm",
        "ff_proj": "mlp.gate_proj",
        "up_proj": "mlp.up_proj",
    }
    sd = {}
    for k, v in tensors(path).items():
        parts = k.removeprefix("model.transformer.").split(".")
        if parts[0] == "blocks":
            mod = "mlp.down_proj" if parts[2] == "ff_out" else rename[parts[2]]
            sd[f"model.layers.{parts[1]}.{mod}.weight"] = v
        else:
            sd[f"{rename[parts[0]]}.weight"] = v
    ref.load_state_dict(sd, strict=True)
    ids = torch.randint(0, cfg["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(1))
    want = hf_bidirectional_logits(ref, ids)
    got = dinfer_rt.load_model(path).forward(ids)
    assert got.shape == want.shape
    assert rel_err(got, want) <= RTOL


@pytest.mark.parametrize("name", ["dream", "dream_sharded_tied"])
def test_dream_matches_transformers_qwen2_shifted(ckpt_dir, name):
    transformers = pytest.importorskip("transformers")
    path = ckpt_dir(name)
    cfg = json.loads((path / "config.json").read_text())
    fields = {name: name for name in HF_FIELDS}
    tie = {"tie_word_embeddings": cfg["tie_word_embeddings"], "use_sliding_window": False}
    ref = hf_model(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, cfg, fields, **tie)
    ref.load_state_dict(tensors(path), strict=not cfg["tie_word_embeddings"])
    if cfg["tie_word_embeddings"]:
        ref.tie_weights()
    ids = torch.randint(0, cfg["vocab_size"], (3, 11), generator=torch.Generator().manual_seed(2))
    raw = hf_bidirectional_logits(ref, ids)
    want = torch.cat((raw[:, :1], raw[:, :-1]), dim=1)  # pred[0] = logits[0], pred[i] = logits[i-1]
    got = dinfer_rt.load_model(path).forward(ids)
    assert rel_err(got, want) <= RTOL


# ----------------------------------------------------------------------------- plain references


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, rd, theta):
    """x [B, H, N, D]; half-split rotation of the first rd dims, positions 0..N-1."""
    n = x.shape[2]
    inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    cos, sin = ang.cos(), ang.sin()
    r, rest = x[..., :rd], x[..., rd:]
    a, b = r[..., : rd // 2], r[..., rd // 2 :]
    return torch.cat((a * cos - b * sin, b * cos + a * sin, rest), dim=-1)


def _attend(q, k, v, mask):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


def _expert(x, w, prefix):
    return F.linear(
        F.silu(F.linear(x, w[prefix + "gate_proj.weight"])) * F.linear(x, w[prefix + "up_proj.weight"]),
        w[prefix + "down_proj.weight"],
    )


def reference_moe_forward(path, ids, block: int | None = None) -> torch.Tensor:
    """LLaDA-MoE / LLaDA2 forward from docs/models.md (LLaDA-MoE, LLaDA2), in float64, token by token for the MoE."""
    cfg = json.loads((path / "config.json").read_text())
    w = {k: v.double() for k, v in tensors(path).items()}
    llada2 = cfg["model_type"] == "llada2_moe"
    hdim, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rd = int(hdim * cfg["partial_rotary_factor"])
    eps = cfg["rms_norm_eps"]
    b, n = ids.shape
    mask = None
    if block is not None:
        blk = torch.arange(n) // block
        mask = blk[None, :] <= blk[:, None]
    x = w["model.word_embeddings.weight" if llada2 else "model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        if llada2:
            qkv = F.linear(h, w[p + "attention.query_key_value.weight"])
            q, k, v = qkv.split([nh * hdim, nkv * hdim, nkv * hdim], -1)
            qn, kn, on = p + "attention.query_layernorm.weight", p + "attention.key_layernorm.weight", "attention.dense"
        else:
            q, k, v = (F.linear(h, w[f"{p}self_attn.{c}_proj.weight"]) for c in "qkv")
            qn, kn, on = p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight", "self_attn.o_proj"
        q = q.view(b, n, nh, hdim).transpose(1, 2)
        k = k.view(b, n, nkv, hdim).transpose(1, 2)
        v = v.view(b, n, nkv, hdim).transpose(1, 2)
        q, k = _rms(q, w[qn], eps), _rms(k, w[kn], eps)
        q, k = _rope(q, rd, cfg["rope_theta"]), _rope(k, rd, cfg["rope_theta"])
        a = _attend(q, k, v, mask).transpose(1, 2).reshape(b, n, nh * hdim)
        x = x + F.linear(a, w[f"{p}{on}.weight"])
        m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if llada2 and i < cfg["first_k_dense_replace"]:
            x = x + _expert(m, w, p + "mlp.")
            continue
        out = torch.zeros_like(m)
        for bi in range(b):
            for t in range(n):
                tok = m[bi, t]
                logits = w[p + "mlp.gate.weight"] @ tok
                if llada2:
                    s = logits.sigmoid()
                    biased = s + w[p + "mlp.gate.expert_bias"]
                    groups = biased.view(cfg["n_group"], -1)
                    gscore = groups.topk(2, dim=-1).values.sum(-1)
                    keep = set(gscore.topk(cfg["topk_group"]).indices.tolist())
                    gsize = groups.shape[1]
                    cand = [e for e in range(len(s)) if e // gsize in keep]
                    chosen = sorted(cand, key=lambda e: -biased[e].item())[: cfg["num_experts_per_tok"]]
                    wts = s[chosen]
                    if len(chosen) > 1 and cfg["norm_topk_prob"]:  # upstream: no renormalisation at top-1
                        wts = wts / wts.sum()
                    wts = wts * cfg["routed_scaling_factor"]
                else:
                    probs = logits.softmax(-1)  # upstream ignores norm_topk_prob: never renormalised
                    wts, chosen = probs.topk(cfg["num_experts_per_tok"])
                    chosen = chosen.tolist()
                for wt, e in zip(wts, chosen):
                    out[bi, t] += wt * _expert(tok, w, f"{p}mlp.experts.{e}.")
                if llada2 and cfg["num_shared_experts"]:
                    out[bi, t] += _expert(tok, w, p + "mlp.shared_experts.")
        x = x + out
    return F.linear(_rms(x, w["model.norm.weight"], eps), w["lm_head.weight"])


@pytest.mark.parametrize("name", ["llada_moe", "llada_moe_sharded"])
def test_llada_moe_matches_plain_reference(ckpt_dir, name):
    path = ckpt_dir(name)
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(3))
    got = dinfer_rt.load_model(path).forward(ids)
    assert rel_err(got, reference_moe_forward(path, ids)) <= RTOL


@pytest.mark.parametrize("name", ["llada2", "llada2_sharded"])
def test_llada2_block_causal_matches_plain_reference(ckpt_dir, name):
    path = ckpt_dir(name)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(4))
    model = dinfer_rt.load_model(path)
    got = model.forward(ids, block_size=4)
    assert rel_err(got, reference_moe_forward(path, ids, block=4)) <= RTOL
    # The block rule matters: a full bidirectional reference differs.
    assert rel_err(got, reference_moe_forward(path, ids, block=None)) > 1e-3


def _rewrite_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_llada_moe_ignores_norm_topk_prob_like_upstream(tmp_path):
    """The upstream LLaDA-MoE never renormalises its top-k weights, whatever norm_topk_prob says."""
    path = _rewrite_config(checkpoints.llada_moe(tmp_path / "m"), norm_topk_prob=True)
    ids = torch.randint(0, 61, (1, 8), generator=torch.Generator().manual_seed(5))
    got = dinfer_rt.load_model(path).forward(ids)
    assert rel_err(got, reference_moe_forward(path, ids)) <= RTOL


def test_llada2_top1_is_not_renormalised_like_upstream(tmp_path):
    """With one expert per token the upstream gate keeps the raw sigmoid score (times the scale)."""
    path = checkpoints.llada2(tmp_path / "m", top_k=1)
    ids = torch.randint(0, 61, (1, 8), generator=torch.Generator().manual_seed(6))
    model = dinfer_rt.load_model(path)
    assert model.spec.moe.renormalize is False
    assert rel_err(model.forward(ids, block_size=4), reference_moe_forward(path, ids, block=4)) <= RTOL
