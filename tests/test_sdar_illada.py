"""SDAR (dense and MoE) and iLLaDA-8B: config parsing and refusals, logits against transformers'
Qwen3 / Qwen3-MoE / Llama holding the same weights (float32, within 1e-5 of the logits' scale)
and against the float64 reference (``dinfer_rt.validation``), greedy generation through
``LLM.generate``, and which cache policies an SDAR model runs."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import dinfer_rt
from dinfer_rt import strategies
from dinfer_rt.errors import ConfigError, GenerationError
from dinfer_rt.model_spec import parse_spec
from dinfer_rt.sampling import CACHES, SamplingParams
from dinfer_rt.testing import checkpoints
from dinfer_rt.validation import model_checks

RTOL = 1e-5
WRITERS = {
    "sdar": lambda p: checkpoints.sdar(p),
    # tied head, one KV head, head_dim 16 = hidden / heads, blocks of 8 from the config, two shards
    "sdar_tied_block8": lambda p: checkpoints.sdar(p, d=64, kv_heads=1, tie=True, block_size=8, shards=2, seed=12),
    "sdar_moe": lambda p: checkpoints.sdar_moe(p),
    "sdar_moe_top3_raw": lambda p: checkpoints.sdar_moe(p, top_k=3, norm_topk_prob=False, seed=13),
    "illada": lambda p: checkpoints.illada(p),
    "llada2": lambda p: checkpoints.llada2(p),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdar_illada")
    made: dict = {}

    def get(name: str):
        if name not in made:
            made[name] = WRITERS[name](root / name)
        return made[name]

    return get


def _config(path, tmp_path, drop=(), **changes):
    """A copy of the checkpoint folder with config.json edited."""
    dst = shutil.copytree(path, tmp_path / path.name)
    cfg = json.loads((dst / "config.json").read_text())
    for key in drop:
        cfg.pop(key)
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _tensors(path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def _additive_mask(n: int, block: int | None) -> torch.Tensor:
    """[1, 1, n, n] additive mask: token i sees token j iff j // block <= i // block (all if None)."""
    if block is None:
        return torch.zeros(1, 1, n, n)
    blk = torch.arange(n) // block
    return torch.zeros(1, 1, n, n).masked_fill(~(blk[None, :] <= blk[:, None]), float("-inf"))


def hf_qwen3(path):
    """transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM (eager attention) with the checkpoint's
    weights; Qwen3-MoE keeps each layer's experts fused ([E, 2I, H] gate|up, [E, H, I] down)."""
    transformers = pytest.importorskip("transformers")
    cfg = json.loads((path / "config.json").read_text())
    moe = "num_experts" in cfg
    keys = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
    )  # fmt: skip
    kw = {k: cfg[k] for k in keys} | {"max_position_embeddings": 512}
    if moe:
        kw |= {k: cfg[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")}
        hf_cfg, cls = transformers.Qwen3MoeConfig(**kw), transformers.Qwen3MoeForCausalLM
    else:
        hf_cfg, cls = transformers.Qwen3Config(**kw), transformers.Qwen3ForCausalLM
    hf_cfg._attn_implementation = "eager"
    model = cls(hf_cfg).eval()
    sd = _tensors(path)
    for i in range(cfg["num_hidden_layers"]) if moe else ():
        m = f"model.layers.{i}.mlp.experts."
        experts = range(cfg["num_experts"])
        gate_up = [torch.cat((sd.pop(f"{m}{e}.gate_proj.weight"), sd.pop(f"{m}{e}.up_proj.weight"))) for e in experts]
        sd[m + "gate_up_proj"] = torch.stack(gate_up)
        sd[m + "down_proj"] = torch.stack([sd.pop(f"{m}{e}.down_proj.weight") for e in experts])
    if cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd, strict=True)
    return model


def hf_logits(model, ids: torch.Tensor, block: int | None) -> torch.Tensor:
    mask = _additive_mask(ids.shape[1], block).expand(ids.shape[0], -1, -1, -1)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


# ----------------------------------------------------------------------------------- SDAR config


def test_sdar_spec_reads_the_qwen3_layout_and_the_block_rule(ckpt):
    dense, moe = parse_spec(ckpt("sdar")), parse_spec(ckpt("sdar_moe_top3_raw"))
    assert (dense.family, moe.family) == ("sdar", "sdar_moe")
    for s in (dense, moe):
        assert s.block_causal and s.qk_norm and not s.shift_logits and not s.qkv_bias and not s.fused_qkv
        assert s.reencode_finished_blocks and s.mask_id == checkpoints.MASK and s.default_block_size == 4
        assert (s.n_heads, s.n_kv_heads, s.head_dim, s.rotary_dim) == (4, 2, 16, 16)  # head_dim apart from 48 / 4
    assert dense.moe is None and not dense.tie_embeddings
    assert (moe.moe.n_experts, moe.moe.top_k, moe.moe.router, moe.moe.renormalize) == (6, 3, "softmax", False)
    assert parse_spec(ckpt("sdar_moe")).moe.renormalize is True
    assert parse_spec(ckpt("sdar_tied_block8")).default_block_size == 8  # from the config's block_size
    assert parse_spec(ckpt("sdar_tied_block8")).tie_embeddings


@pytest.mark.parametrize("name", ["sdar", "sdar_moe"])
def test_sdar_family_defaults_apply_when_the_config_omits_them(ckpt, tmp_path, name):
    """A sibling copy of the authors' config lacks block_size and mask_token_id: the family's (4 and
    151669, as SGLang keeps them). Omitted head_dim: SDARConfig's 128 for the dense model,
    hidden_size // heads for the MoE (Qwen3MoeConfig has no head_dim)."""
    path = _config(ckpt(name), tmp_path, drop=("block_size", "mask_token_id", "head_dim"), vocab_size=151936)
    spec = parse_spec(path)
    assert (spec.default_block_size, spec.mask_id) == (4, 151669)
    assert spec.head_dim == (128 if name == "sdar" else 48 // 4)


def test_a_family_default_mask_outside_the_vocabulary_is_refused_naming_the_field(ckpt, tmp_path):
    path = _config(ckpt("sdar"), tmp_path, drop=("mask_token_id",))
    with pytest.raises(ConfigError) as e:
        parse_spec(path)
    msg = str(e.value)
    assert "no field 'mask_token_id'" in msg and "151669" in msg and "vocab_size 61" in msg and "\n" not in msg


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        ("sdar", "attention_bias", True),
        ("sdar", "use_sliding_window", True),
        ("sdar", "hidden_act", "gelu"),
        ("sdar", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
        ("sdar_moe", "decoder_sparse_step", 2),
        ("sdar_moe", "mlp_only_layers", [0]),
    ],
)
def test_sdar_variants_not_implemented_are_refused_naming_the_field(ckpt, tmp_path, name, field, value):
    path = _config(ckpt(name), tmp_path, **{field: value})
    with pytest.raises(ConfigError, match=f"field '{field}'") as e:
        parse_spec(path)
    assert str(path / "config.json") in str(e.value) and "\n" not in str(e.value)


def test_sdar_moe_needs_norm_topk_prob(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="missing field 'norm_topk_prob'"):
        parse_spec(_config(ckpt("sdar_moe"), tmp_path, drop=("norm_topk_prob",)))


# ------------------------------------------------------------------------------------ SDAR logits


@pytest.mark.parametrize("name", ["sdar", "sdar_tied_block8", "sdar_moe", "sdar_moe_top3_raw"])
def test_sdar_matches_transformers_qwen3_under_a_block_causal_mask(ckpt, name):
    """The cpu backend's logits equal Qwen3ForCausalLM's / Qwen3MoeForCausalLM's with the same weights
    under the block-causal 4-D mask (blocks aligned to position 0, the last one partial), and the
    block rule matters: the bidirectional Qwen3 differs."""
    path = ckpt(name)
    ref = hf_qwen3(path)
    model = dinfer_rt.load_model(path, backend="cpu", dtype="float32")
    block = model.spec.default_block_size
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(21))
    got = model.forward(ids)
    want = hf_logits(ref, ids, block)
    assert got.shape == want.shape
    assert rel_err(got, want) <= RTOL
    assert rel_err(got, hf_logits(ref, ids, None)) > 1e-3


@pytest.mark.parametrize("name", ["sdar", "sdar_moe"])
def test_sdar_matches_the_float64_reference(ckpt, name):
    """Teacher-forced logits of the float32 cpu model against the float64 one (the validation
    oracle) on left-padded prompts of mixed lengths, at several mask fractions."""
    path = ckpt(name)
    test = dinfer_rt.load_model(path, backend="cpu", dtype="float32")
    ref = dinfer_rt.load_model(path, backend="cpu", dtype="float64")
    report = model_checks.teacher_forced(test, ref, [[7, 8, 9, 10, 11, 12], [13, 14, 15]], None, 8)
    assert report["passed"], report


# ---------------------------------------------------------------------------------- generation


def plain_block_decode(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """One row, no cache: SDAR's block loop written plainly (blocks aligned to position 0, the
    first one holding the prompt's tail; every step a full block-causal forward; the rule with
    the linear schedule's quota of the block's masks), cut at the first EOS."""
    mask = model.mask_id
    x = torch.tensor(prompt + [mask] * p.gen_length)[None]
    n, lb = x.shape[1], p.block_length
    rule = strategies.build(p)
    for s in range((len(prompt) // lb) * lb, n, lb):
        e = min(s + lb, n)
        plan = strategies.linear_schedule((x[:, s:e] == mask).sum(-1), p.steps_per_block())
        step = 0
        while (x[:, s:e] == mask).any():
            logits = model.forward(x, block_size=lb)[:, s:e].double()
            logits[..., mask] = float("-inf")
            quota = plan[:, min(step, p.steps_per_block() - 1)]
            x0, commit = rule(strategies.StepInput(logits, x[:, s:e] == mask, quota, 0.0, None, {}))
            x[:, s:e] = torch.where(commit, x0, x[:, s:e])
            step += 1
    out = x[0, len(prompt) :].tolist()
    eos = set(model.eos_ids)
    return out[: next((i for i, t in enumerate(out) if t in eos), len(out))]


SDAR_PARAMS = SamplingParams(
    gen_length=12, block_length=4, steps=6, strategy="low_confidence_dynamic", threshold=0.3, chat=False
)


@pytest.mark.parametrize(
    "prompts",
    [[[12, 13], [40, 41]], [[7, 8, 9, 10, 11], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34]]],
    ids=["shorter_than_a_block", "ending_inside_a_block"],
)
def test_sdar_greedy_generation_alone_batched_and_cached(ckpt, prompts):
    """Greedy ``low_confidence_dynamic`` (threshold 0.3, 2 slots per step) through ``LLM.generate``:
    each prompt alone equals the plain block loop (the first block holding the prompt's tail);
    under every cache policy SDAR runs it decodes the same tokens with as many forwards, alone and
    in a batch."""
    llm = dinfer_rt.LLM(ckpt("sdar"), backend="cpu")
    alone = [llm.generate([q], dataclasses.replace(SDAR_PARAMS))[0] for q in prompts]
    for q, out in zip(prompts, alone):
        assert out.token_ids == plain_block_decode(llm.model, q, SDAR_PARAMS), q
    assert any(len(o.token_ids) >= 4 for o in alone)  # something was generated
    for cache in llm.model.spec.exact_cache_policies:
        params = dataclasses.replace(SDAR_PARAMS, cache=cache, vicinity_warmup=1, refresh_window=2)
        cached = [llm.generate([q], params)[0] for q in prompts]
        assert [o.token_ids for o in cached] == [o.token_ids for o in alone], cache
        assert [o.stats.nfe for o in cached] == [o.stats.nfe for o in alone], cache
        together = llm.generate(prompts, params)
        assert [o.token_ids for o in together] == [o.token_ids for o in alone], cache


def test_sdar_rows_of_other_prompt_lengths_decode_as_alone(ckpt):
    """Beside prompts of other lengths (shorter than a block, ending inside one, past one) a prompt
    decodes what it decodes alone."""
    llm = dinfer_rt.LLM(ckpt("sdar"), backend="cpu")
    prompts = [[12, 13], [7, 8, 9, 10, 11], [14, 15, 16, 17, 18, 19, 20, 21, 22]]
    alone = [llm.generate([q], dataclasses.replace(SDAR_PARAMS))[0].token_ids for q in prompts]
    for cache in ("none", "dual"):
        together = llm.generate(prompts, dataclasses.replace(SDAR_PARAMS, cache=cache))
        assert [o.token_ids for o in together] == alone, cache


def test_sdar_runs_only_cache_policies_exact_under_its_kv_rule(ckpt):
    """The scheduler asks ``spec.check_cache_policy``: SDAR refuses ``delayed`` (it keeps K/V from
    denoising forwards, which SDAR's rule never stores) in one line naming it and the exact ones;
    the other families keep every policy (LLaDA2's are all exact, bidirectional models' others
    are approximate speed options)."""
    sdar, moe, llada2, illada = (parse_spec(ckpt(n)) for n in ("sdar", "sdar_moe", "llada2", "illada"))
    assert sdar.exact_cache_policies == moe.exact_cache_policies == tuple(c for c in CACHES if c != "delayed")
    for cache in sdar.exact_cache_policies:
        sdar.check_cache_policy(cache)
    with pytest.raises(GenerationError) as e:
        moe.check_cache_policy("delayed")
    msg = str(e.value)
    assert "cache 'delayed' is not exact for the sdar_moe model" in msg and "none, prefix, dual" in msg
    assert "\n" not in msg
    assert llada2.exact_cache_policies == CACHES  # block-causal without SDAR's rule
    assert illada.exact_cache_policies == ("none",)  # bidirectional: every cache is an approximation
    for cache in CACHES:
        llada2.check_cache_policy(cache)
        illada.check_cache_policy(cache)


# ----------------------------------------------------------------------------------------- iLLaDA


@pytest.mark.parametrize(
    "naming",
    [
        {"model_type": "illada"},
        {"architectures": ["iLLaDAModelLM"]},
        {"auto_map": {"AutoModel": "modeling_illada.iLLaDAModelLM"}},
        {"_name_or_path": "GSAI-ML/iLLaDA-8B-Instruct"},
    ],
)
def test_illada_is_recognised_by_any_key_naming_it(ckpt, tmp_path, naming):
    """iLLaDA's config keys are unpublished: with LLaDA's model_type / architectures, any one key
    naming iLLaDA decides, and then the mask id defaults to 5; plain LLaDA keeps no default."""
    llada = {"model_type": "llada", "architectures": ["LLaDAModelLM"]}
    spec = parse_spec(_config(ckpt("illada"), tmp_path, **{**llada, **naming}))
    assert (spec.family, spec.mask_id) == ("illada", 5)
    plain = parse_spec(_config(ckpt("illada"), tmp_path / "plain", **llada))
    assert (plain.family, plain.mask_id) == ("llada", None)


def test_illada_config_mask_id_wins_over_the_family_default(ckpt, tmp_path):
    assert parse_spec(_config(ckpt("illada"), tmp_path, mask_token_id=7)).mask_id == 7


def test_illada_fields_unknown_to_dinfer_rt_are_refused_naming_them(ckpt, tmp_path):
    path = _config(ckpt("illada"), tmp_path, sliding_window=4096, qk_norm=True, init_std=0.02)
    with pytest.raises(ConfigError) as e:
        parse_spec(path)
    msg = str(e.value)
    assert "'qk_norm', 'sliding_window'" in msg and "init_std" not in msg  # init_std: a known LLaDA key
    assert str(path / "config.json") in msg and "\n" not in msg
    # a known key that changes the math is checked as for LLaDA
    with pytest.raises(ConfigError, match="field 'include_bias'"):
        parse_spec(_config(ckpt("illada"), tmp_path / "bias", include_bias=True))


def test_illada_gqa_tied_checkpoint_matches_llama_and_the_float64_reference(ckpt):
    """GQA 4:1 and a tied head (no top-level ff_out tensor): LlamaForCausalLM with the same weights
    and a bidirectional mask (float32, 1e-5), and the float64 reference (validation)."""
    transformers = pytest.importorskip("transformers")
    path = ckpt("illada")
    model = dinfer_rt.load_model(path, backend="cpu", dtype="float32")
    assert (model.spec.family, model.spec.n_heads, model.spec.n_kv_heads, model.spec.tie_embeddings) == (
        "illada",
        8,
        2,
        True,
    )
    assert model.mask_id == 5 and "model.transformer.ff_out.weight" not in _tensors(path)
    cfg = json.loads((path / "config.json").read_text())
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg["embedding_size"],
        hidden_size=cfg["d_model"],
        intermediate_size=cfg["mlp_hidden_size"],
        num_hidden_layers=cfg["n_layers"],
        num_attention_heads=cfg["n_heads"],
        num_key_value_heads=cfg["n_kv_heads"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"],
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    hf_cfg._attn_implementation = "eager"
    ref = transformers.LlamaForCausalLM(hf_cfg).eval()
    names = {
        "attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
        "v_proj": "self_attn.v_proj", "attn_out": "self_attn.o_proj", "ff_norm": "post_attention_layernorm",
        "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj",
    }  # fmt: skip
    sd = {}
    for k, v in _tensors(path).items():
        parts = k.removeprefix("model.transformer.").split(".")
        if parts[0] == "blocks":
            sd[f"model.layers.{parts[1]}.{names[parts[2]]}.weight"] = v
        else:
            sd[{"wte": "model.embed_tokens", "ln_f": "model.norm"}[parts[0]] + ".weight"] = v
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    ref.load_state_dict(sd, strict=True)
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(22))
    got = model.forward(ids)
    assert rel_err(got, hf_logits(ref, ids, None)) <= RTOL
    f64 = dinfer_rt.load_model(path, backend="cpu", dtype="float64")
    report = model_checks.teacher_forced(model, f64, [[7, 8, 9, 10], [11, 12]], None, 8)
    assert report["passed"], report


def test_the_engine_refuses_a_cache_policy_sdar_cannot_run(ckpt):
    """``LLM.generate`` and a served request both go through the one engine, which asks the spec."""
    from dinfer_rt.engine import Engine

    llm = dinfer_rt.LLM(ckpt("sdar"), backend="cpu")
    params = SamplingParams(gen_length=8, block_length=4, cache="delayed")
    for run in (lambda: llm.generate([[7, 8, 9]], params), lambda: Engine(llm.model).submit([7, 8, 9], params)):
        with pytest.raises(GenerationError, match="cache 'delayed' is not exact for the sdar model"):
            run()


def test_finished_blocks_hold_the_k_v_of_a_fresh_prefill(ckpt):
    """SDAR's KV rule (a finished block's K/V are recomputed once from its final tokens): the
    engine's block-causal window starts at the previous block at each block's first forward, so
    that forward is the re-encode, merged into the next block's first step. After decoding, every
    block but the last (nothing reads it) holds what a fresh prefill of the final sequence writes."""
    from dinfer_rt.engine import Engine

    model = dinfer_rt.load_model(ckpt("sdar"), backend="cpu")
    params = SamplingParams(gen_length=12, block_length=4, strategy="low_confidence_dynamic", cache="dual")
    engine = Engine(model, max_num_seqs=1, kv_block_size=0)  # contiguous: the row stays readable after its end
    req = engine.submit([7, 8, 9, 10, 11], params)
    engine.run_until_idle()
    cohort = req.cohort
    n, last = cohort.n, ((cohort.n - 1) // 4) * 4  # the final block starts at 16 of 17 positions
    fresh = model.new_cache(1, n)
    model.forward(cohort.x, cache=fresh, block_size=4)
    for kept, prefill in zip((*engine.cache.k, *engine.cache.v), (*fresh.k, *fresh.v)):
        assert (kept[0, :last] - prefill[0, :last]).abs().max() < 1e-5
    assert last == 16 and (engine.cache.k[0][0, :last].abs().sum() > 0)  # really written
