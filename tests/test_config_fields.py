"""config.json fields as the upstream configuration classes define them: omitted keys take the
upstream default (or are required), unimplemented variants are refused naming the field, and
the test checkpoint writers produce the upstream layouts."""

from __future__ import annotations

import json

import pytest

from dinfer_rt.errors import ConfigError
from dinfer_rt.model_spec import parse_spec
from dinfer_rt.testing import checkpoints


def _config(path, drop=(), **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key in drop:
        cfg.pop(key)
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    return {n: getattr(checkpoints, n)(root / n) for n in ("llada", "dream", "llada_moe", "llada2")}


def _copy(written, name, tmp_path):
    import shutil

    return shutil.copytree(written[name], tmp_path / name)


def test_llada2_omitted_keys_take_the_upstream_defaults(written, tmp_path):
    keys = ("partial_rotary_factor", "routed_scaling_factor", "n_group", "topk_group", "rms_norm_eps")
    path = _config(_copy(written, "llada2", tmp_path), drop=keys, num_experts=16)
    spec = parse_spec(path)
    assert spec.rotary_dim == spec.head_dim // 2  # partial_rotary_factor 0.5
    assert (spec.moe.routed_scale, spec.moe.n_group, spec.moe.topk_group) == (2.5, 8, 4)
    assert spec.eps == 1e-5


@pytest.mark.parametrize(("family", "eps"), [("llada", 1e-5), ("dream", 1e-6), ("llada_moe", 1e-5), ("llada2", 1e-5)])
def test_rms_norm_eps_default_is_per_family(written, tmp_path, family, eps):
    assert parse_spec(_config(_copy(written, family, tmp_path), drop=("rms_norm_eps",))).eps == eps


@pytest.mark.parametrize(
    ("family", "field", "value"),
    [
        ("llada", "layer_norm_type", "default"),
        ("llada", "activation_type", "gelu"),
        ("llada", "alibi", True),
        ("llada", "bias_for_layer_norm", True),
        ("llada", "clip_qkv", 8.0),
        ("llada", "include_bias", True),
        ("llada", "block_type", "sequential"),
        ("llada_moe", "clip_qkv", 8.0),
        ("llada_moe", "moe_layer_freq", [0, 1]),
        ("llada_moe", "shared_expert_intermediate_size", 32),
        ("llada_moe", "moe_router_enable_expert_bias", True),
        ("llada2", "use_bias", True),
        ("llada2", "norm_head", True),
        ("dream", "hidden_act", "gelu"),
    ],
)
def test_unimplemented_fields_are_refused_naming_the_field(written, tmp_path, family, field, value):
    path = _config(_copy(written, family, tmp_path), **{field: value})
    with pytest.raises(ConfigError, match=f"field '{field}'") as e:
        parse_spec(path)
    assert str(path / "config.json") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("family", "field"),
    [("llada", "layer_norm_type"), ("llada", "block_type"), ("llada", "rope"), ("llada2", "use_bias")],
)
def test_fields_whose_upstream_default_is_not_implemented_are_required(written, tmp_path, family, field):
    path = _config(_copy(written, family, tmp_path), drop=(field,))
    with pytest.raises(ConfigError, match=f"missing field '{field}': the upstream default"):
        parse_spec(path)


def test_llada_omitted_weight_tying_is_tied_as_upstream(written, tmp_path):
    assert parse_spec(_config(_copy(written, "llada", tmp_path), drop=("weight_tying",))).tie_embeddings


def test_autoregressive_ling_is_refused_as_not_a_diffusion_model(written, tmp_path):
    path = _config(
        _copy(written, "llada2", tmp_path), architectures=["BailingMoeV2ForCausalLM"], model_type="bailing_moe"
    )
    with pytest.raises(ConfigError, match="autoregressive Ling/BailingMoe model, not a diffusion model"):
        parse_spec(path)


def test_writers_produce_the_upstream_layouts(written):
    moe = json.loads((written["llada_moe"] / "config.json").read_text())
    assert moe["moe_layer_freq"] == [1] * moe["num_hidden_layers"] and moe["shared_expert_intermediate_size"] is None
    assert json.loads((written["llada2"] / "config.json").read_text())["use_bias"] is False


def test_end_of_turn_tokens_come_from_the_family(written):
    """`<|eot_id|>` ends a LLaDA generation; it is not a turn marker of the Ling chat format."""
    import dinfer_rt

    eot = 4  # id of <|eot_id|> in the test tokenizer
    assert eot in dinfer_rt.load_model(written["llada"], backend="cpu").eos_ids
    assert eot not in dinfer_rt.load_model(written["llada2"], backend="cpu").eos_ids


def test_disable_passes_is_a_parameter_not_an_env_channel(written, monkeypatch):
    import os

    import dinfer_rt

    monkeypatch.delenv("DINFER_DISABLE_PASSES", raising=False)
    plain = dinfer_rt.load_model(written["llada"], backend="cpu", disable_passes=["add_rms_norm", "merge_gate_up"])
    assert "add_rms_norm" not in plain.pass_counts and "merge_gate_up" not in plain.pass_counts
    assert "DINFER_DISABLE_PASSES" not in os.environ
    with pytest.raises(Exception, match=r"disable_passes names unknown pass\(es\) \['nope'\]"):
        dinfer_rt.load_model(written["llada"], backend="cpu", disable_passes=["nope"])


def test_auto_dtype_is_the_checkpoint_dtype_on_a_device_and_fp32_on_cpu(written):
    import torch

    from dinfer_rt.backends.cpu import CpuBackend
    from dinfer_rt.loader import auto_dtype
    from dinfer_rt.platform import Capabilities

    spec = parse_spec(_config_dict_copy(written["llada"], torch_dtype="bfloat16"))

    class Device(CpuBackend):
        device_type = "cuda"

        def capabilities(self):
            return Capabilities(dtypes=(torch.float32, torch.bfloat16))

    assert auto_dtype(spec, Device()) == torch.bfloat16
    assert auto_dtype(spec, CpuBackend()) == torch.float32


def _config_dict_copy(path, **changes):
    import shutil
    import tempfile
    from pathlib import Path

    dst = Path(tempfile.mkdtemp()) / "m"
    shutil.copytree(path, dst)
    return _config(dst, **changes)
