"""The prefix and dual caches score 0 on the embedded task at block 8 (``docs/decoding.md``, "Why
prefix and dual fail on the embedded task"): that is Fast-dLLM's algorithm on this model, not a
defect of ours. Checked here against an independent re-implementation of Fast-dLLM v1's
``generate`` / ``generate_with_prefix_cache`` / ``generate_with_dual_cache`` (NVlabs/Fast-dLLM,
``llada/generate.py``) on transformers' ``LlamaForCausalLM`` holding the same weights in float64:
its K/V cache is the full forward's ``past_key_values`` at the block start, which the block's
later steps read (prefix: positions before the block; dual: every position but the block's,
whose K/V are recomputed). dinfer-rt's engine decodes token for token what it decodes, including
the repeated letters of the failing permutations."""

import json

import pytest
import torch

from dinfer_rt.demo import task
from dinfer_rt.engine import run_batch
from dinfer_rt.loader import EMBEDDED_MODEL, load_model
from dinfer_rt.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

EOS = 0  # the embedded model's eos_token_id

HF_NAMES = {
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


def hf_llama(path):
    """transformers' LlamaForCausalLM holding the LLaDA checkpoint's weights (an all-visible mask
    is passed at every call), in float64."""
    from safetensors.torch import load_file

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
        max_position_embeddings=cfg["max_sequence_length"],
        tie_word_embeddings=False,
    )
    hf_cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            parts = k.removeprefix("model.transformer.").split(".")
            if parts[0] == "blocks":
                mod = "mlp.down_proj" if parts[2] == "ff_out" else HF_NAMES[parts[2]]
                sd[f"model.layers.{parts[1]}.{mod}.weight"] = v
            else:
                sd[f"{HF_NAMES[parts[0]]}.weight"] = v
    model.load_state_dict(sd, strict=True)
    return model.double()


def _forward(hf, ids, positions, cache=None):
    """Logits of ``ids`` at ``positions``, every query seeing every key (cached ones included)."""
    keys = ids.shape[1] + (0 if cache is None else cache.get_seq_length())
    mask = torch.zeros(1, 1, ids.shape[1], keys, dtype=torch.float64)
    out = hf(input_ids=ids, position_ids=positions[None], attention_mask=mask, past_key_values=cache, use_cache=True)
    return out.logits[0], out.past_key_values


def _layers(cache):
    """Each layer's (keys, values), [batch, heads, positions, head dim], in any transformers >= 4.45."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _commit(x, logits, lo, hi, mask_id, threshold):
    """Fast-dLLM's ``get_transfer_index`` with a threshold: the masked slots of [lo, hi) whose
    argmax probability is >= threshold, and always the most confident one. ``logits`` cover
    [lo, hi)."""
    masked = x[0, lo:hi] == mask_id
    prob = torch.softmax(logits, -1)
    conf, x0 = prob.max(-1)
    conf = torch.where(masked, conf, torch.tensor(-torch.inf, dtype=conf.dtype))
    take = masked & (conf >= threshold)
    take[conf.argmax()] = True
    x[0, lo:hi] = torch.where(take, x0, x[0, lo:hi])


def fast_dllm(hf, prompt, *, gen_length, block, threshold, cache, mask_id):
    """Fast-dLLM v1's threshold decoding, one prompt, with no cache, its prefix or its dual cache."""
    x = torch.tensor([list(prompt) + [mask_id] * gen_length])
    n = x.shape[1]
    everything = torch.arange(n)
    with torch.no_grad():
        for s in range(len(prompt), n, block):
            e = min(s + block, n)
            logits, kv = _forward(hf, x, everything)  # the block's first step: a full forward
            _commit(x, logits[s:e], s, e, mask_id, threshold)
            while (x[0, s:e] == mask_id).any():
                if cache == "none":
                    logits, _ = _forward(hf, x, everything)
                    logits = logits[s:e]
                else:
                    # the cache keeps the full forward's K/V of every position the step does not compute
                    kept = torch.arange(s) if cache == "prefix" else torch.cat([torch.arange(s), torch.arange(e, n)])
                    stale = transformers.DynamicCache()
                    for i, (k, v) in enumerate(_layers(kv)):
                        stale.update(k[:, :, kept], v[:, :, kept], i)
                    hi = n if cache == "prefix" else e
                    logits, _ = _forward(hf, x[:, s:hi], torch.arange(s, hi), stale)
                    logits = logits[: e - s]
                _commit(x, logits, s, e, mask_id, threshold)
    return x[0, len(prompt) :]


@pytest.fixture(scope="module")
def models():
    return load_model(EMBEDDED_MODEL), hf_llama(EMBEDDED_MODEL)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_prefix_and_dual_decode_what_fast_dllm_decodes_and_fail_the_task_as_it_does(models, cache):
    model, hf = models
    items = task.heldout(4)
    tok = model.tokenizer  # the prompt as ``LLM.generate`` encodes it (its chat template: BOS, letters, "=")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": it.letters}])) for it in items]
    params = SamplingParams(strategy="threshold", threshold=0.9, block_length=8, cache=cache, early_stop=False)
    ours = run_batch(model, prompts, params).tokens
    for r, (it, prompt) in enumerate(zip(items, prompts)):
        ref = fast_dllm(hf, prompt, gen_length=40, block=8, threshold=0.9, cache=cache, mask_id=model.mask_id)
        got = ours[r]
        assert got.tolist() == ref.tolist(), (cache, it.letters, model.tokenizer.decode(got.tolist()))
        ids = ref.tolist()
        text = model.tokenizer.decode(ids[: ids.index(EOS)] if EOS in ids else ids)
        # no cache solves the task; the stale prompt K/V of prefix and dual repeat letters
        assert task.check(it.letters, text) == (cache == "none"), (cache, it.letters, text)
