"""Every bad-input case gives a one-line error naming the file, tensor or field at fault."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import dinfer_rt
from dinfer_rt.errors import CheckpointError, ConfigError, TokenizerError
from dinfer_rt.testing import checkpoints


@pytest.fixture
def llada(tmp_path):
    return checkpoints.llada(tmp_path / "m")


def _edit_tensors(path, fn):
    f = path / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_missing_tensor(llada):
    _edit_tensors(llada, lambda t: t.pop("model.transformer.blocks.1.up_proj.weight"))
    with pytest.raises(CheckpointError) as e:
        dinfer_rt.load_model(llada)
    assert "missing tensor 'model.transformer.blocks.1.up_proj.weight'" in _one_line(e)
    assert "[80, 48]" in str(e.value)


def test_unexpected_tensor(llada):
    _edit_tensors(llada, lambda t: t.update({"model.transformer.blocks.2.q_proj.weight": torch.zeros(48, 48)}))
    with pytest.raises(CheckpointError) as e:
        dinfer_rt.load_model(llada)
    msg = _one_line(e)
    assert "model.safetensors" in msg and "unexpected tensor 'model.transformer.blocks.2.q_proj.weight'" in msg


def test_wrong_shape(llada):
    _edit_tensors(llada, lambda t: t.update({"model.transformer.blocks.0.k_proj.weight": torch.zeros(24, 48)}))
    with pytest.raises(CheckpointError) as e:
        dinfer_rt.load_model(llada)
    msg = _one_line(e)
    assert "'model.transformer.blocks.0.k_proj.weight' has shape [24, 48], expected [48, 48]" in msg


def test_unsupported_model_type(llada):
    _edit_config(llada, lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], auto_map={}))
    with pytest.raises(ConfigError) as e:
        dinfer_rt.load_model(llada)
    msg = _one_line(e)
    assert "config.json" in msg and "unsupported model_type 'gpt2'" in msg


def test_missing_config_field(llada):
    _edit_config(llada, lambda c: c.pop("n_heads"))
    with pytest.raises(ConfigError) as e:
        dinfer_rt.load_model(llada)
    assert "config.json: missing field 'n_heads' (needed for llada)" in _one_line(e)


def test_wrongly_typed_config_field(llada):
    _edit_config(llada, lambda c: c.update(n_layers="2"))
    with pytest.raises(ConfigError) as e:
        dinfer_rt.load_model(llada)
    assert "field 'n_layers' should be int, found '2'" in _one_line(e)


def test_corrupt_header(llada):
    f = llada / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"not json!!!!"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        dinfer_rt.load_model(llada)
    assert "model.safetensors: corrupt safetensors header" in _one_line(e)


def test_truncated_file(llada):
    f = llada / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError) as e:
        dinfer_rt.load_model(llada)
    msg = _one_line(e)
    assert "model.safetensors: truncated" in msg and "tensor '" in msg


def test_truncated_header(llada):
    f = llada / "model.safetensors"
    f.write_bytes(f.read_bytes()[:50])
    with pytest.raises(CheckpointError) as e:
        dinfer_rt.load_model(llada)
    assert "corrupt or truncated safetensors header" in _one_line(e)


def test_index_points_to_missing_shard(tmp_path):
    path = checkpoints.llada(tmp_path / "m", shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        dinfer_rt.load_model(path)
    msg = _one_line(e)
    assert "model.safetensors.index.json: shard 'model-00002-of-00003.safetensors' is missing" in msg


def test_index_disagrees_with_shards(tmp_path):
    path = checkpoints.llada(tmp_path / "m", shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    other = {"model-00001-of-00002.safetensors": "model-00002-of-00002.safetensors"}
    index["weight_map"][name] = other.get(index["weight_map"][name], "model-00001-of-00002.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        dinfer_rt.load_model(path)
    assert f"lists tensor {name!r}" in _one_line(e)


def test_tokenizer_vocab_larger_than_model(tmp_path):
    path = checkpoints.llada(tmp_path / "m", vocab=40)
    checkpoints.write_tokenizer(path, 61)
    with pytest.raises(TokenizerError) as e:
        dinfer_rt.load_model(path)
    msg = _one_line(e)
    assert "tokenizer.json: tokenizer has 61 tokens but the model's embedding has 40 rows" in msg


def test_missing_tokenizer(llada):
    (llada / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError) as e:
        dinfer_rt.load_model(llada)
    assert "tokenizer.json: not found" in _one_line(e)


def test_unknown_dtype(llada):
    with pytest.raises(ConfigError) as e:
        dinfer_rt.load_model(llada, dtype="float8")
    assert "unknown dtype 'float8'; choose one of: float32, bfloat16, float16, float64" in _one_line(e)


def test_missing_folder(tmp_path):
    with pytest.raises(ConfigError) as e:
        dinfer_rt.load_model(tmp_path / "nope")
    assert "nope does not exist" in _one_line(e)


def test_moe_qk_norm_shape_is_asserted(tmp_path):
    """OLMoE-style full-width q_norm [hidden] instead of per-head [head_dim] is rejected by shape."""
    path = checkpoints.llada_moe(tmp_path / "m")
    f = path / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(48)
    save_file(t, str(f))
    with pytest.raises(CheckpointError) as e:
        dinfer_rt.load_model(path)
    assert "'model.layers.0.self_attn.q_norm.weight' has shape [48], expected [16]" in _one_line(e)


def test_sharded_copy_still_loads(tmp_path):
    """Control: the editing helpers themselves do not break a good checkpoint."""
    src = checkpoints.llada(tmp_path / "a")
    dst = tmp_path / "b"
    shutil.copytree(src, dst)
    _edit_tensors(dst, lambda t: None)
    assert dinfer_rt.load_model(dst).forward(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 61)


def test_prompt_with_unknown_text(llada):
    from dinfer_rt.errors import TokenizerError as TE

    llm = dinfer_rt.LLM(llada)
    with pytest.raises(TE, match=r"prompt 'ab!c' has text the tokenizer does not know: \['!'\]"):
        llm.generate("ab!c", dinfer_rt.SamplingParams(chat=False, gen_length=4, block_length=4))


def test_chat_template_is_applied(llada):
    model = dinfer_rt.load_model(llada)
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": " abc "}])
    assert text == "<|startoftext|>abc<|eot_id|>"
    assert model.tokenizer.encode(text) == [2, 6, 7, 8, 4]


def test_ids_past_the_tokenizer_are_kept(tmp_path):
    """An embedding with more rows than the tokenizer has ids is legitimate; decode keeps them."""
    path = checkpoints.llada(tmp_path / "m", vocab=70)
    checkpoints.write_tokenizer(path, 61)
    tok = dinfer_rt.load_model(path).tokenizer
    assert tok.decode([6, 7, 65, 8]) == "ab<|id:65|>c"


def test_check_weights_can_be_skipped_for_trusted_checkpoints(llada):
    _edit_tensors(llada, lambda t: t["model.transformer.ln_f.weight"].fill_(float("nan")))
    with pytest.raises(CheckpointError, match="NaN/infinite"):
        dinfer_rt.load_model(llada)
    model = dinfer_rt.load_model(llada, check_weights=False)
    assert torch.isnan(model.forward(torch.zeros(1, 3, dtype=torch.long))).all()


@pytest.mark.parametrize(
    "compute, message",
    [
        ([5, 3, 4], "increasing order"),
        ([2, 2, 3], "increasing order"),
        ([4, 9], r"outside \[0, 8\)"),
    ],
)
def test_forward_rejects_compute_positions_it_would_mis_index(compute, message):
    """Unsorted, repeated or out-of-range ``compute`` positions: a named error, not a silently
    wrong selection (the logits are indexed by a sorted lookup)."""
    from dinfer_rt.errors import GenerationError
    from dinfer_rt.loader import EMBEDDED_MODEL

    model = dinfer_rt.load_model(EMBEDDED_MODEL)
    ids = torch.full((1, 8), model.mask_id)
    with pytest.raises(GenerationError, match=message):
        model.forward(ids, cache=model.new_cache(1, 8), compute=torch.tensor(compute))
