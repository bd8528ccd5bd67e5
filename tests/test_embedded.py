"""The shipped embedded model: generic loader, recorded greedy output, accuracy bar, bf16 agreement."""

from __future__ import annotations

import json

import pytest
import torch

import dinfer_rt
from dinfer_rt.demo import task
from dinfer_rt.demo.bench import evaluate
from dinfer_rt.loader import EMBEDDED_MODEL


@pytest.fixture(scope="module")
def llm():
    return dinfer_rt.LLM()


def test_shipped_checkpoint_is_a_real_llada_layout_under_20_mb():
    cfg = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    assert cfg["model_type"] == "llada" and cfg["architectures"] == ["LLaDAModelLM"]
    size = sum(f.stat().st_size for f in EMBEDDED_MODEL.iterdir())
    assert size <= 20 * 1024 * 1024
    model = dinfer_rt.load_model()  # the generic loader, default path
    assert model.spec.family == "llada" and model.path == EMBEDDED_MODEL
    assert model.mask_id == 2 and model.eos_ids[0] == 0


def test_greedy_generation_reproduces_recorded_output(llm):
    recorded = json.loads((EMBEDDED_MODEL.parent / "recorded_output.json").read_text())
    out = llm.generate(recorded["prompt"], dinfer_rt.SamplingParams())[0]
    assert out.token_ids == recorded["token_ids"]
    assert out.text == recorded["text"]
    assert task.check(recorded["prompt"], out.text)


def test_heldout_slice_meets_the_accuracy_bar(llm):
    r = evaluate(llm, dinfer_rt.SamplingParams(batch_size=50), limit=50)
    assert r.accuracy >= 0.95, r
    assert r.tpf == 1.0 and r.n == 50


def test_bfloat16_argmax_agrees_on_the_trained_model():
    """Denoising states (half the answer masked): bf16 argmax equals fp32 on >= 99% of positions
    whose fp32 top-2 probabilities differ by more than 0.02. The excluded near-ties are the
    permutation slots, where several letters are equally valid (probabilities ~1/k each)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for it in task.heldout(32):
        ans = torch.tensor([task_id(c) for c in it.answer()] + [0] * 8)
        ans = torch.where(torch.rand(40, generator=g) < 0.5, 2, ans)
        rows.append(torch.cat((torch.tensor([1] + [task_id(c) for c in it.prompt]), ans)))
    ids = torch.stack(rows)
    ref = dinfer_rt.load_model().forward(ids)
    got = dinfer_rt.load_model(dtype="bfloat16").forward(ids).float()
    top2 = ref.softmax(-1).topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > 0.02
    assert decided.float().mean() > 0.8
    agree = (got.argmax(-1) == ref.argmax(-1))[decided].float().mean().item()
    assert agree >= 0.99, agree
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 5e-2


def task_id(ch: str) -> int:
    from dinfer_rt.demo.train import VOCAB

    return VOCAB[ch]


def test_generate_and_eval_commands_on_the_embedded_model(capsys):
    from dinfer_rt.cli import main

    item = task.heldout(3)[2]
    assert main(["generate", item.letters]) == 0
    assert task.check(item.letters, capsys.readouterr().out.strip().splitlines()[0])
    assert main(["eval", "--limit", "5", "--json", "--strategy", "threshold"]) == 0
    r = json.loads(capsys.readouterr().out)
    fields = {"accuracy", "nfe", "tpf", "tokens_per_s", "wall_s", "n", "forwards_by_precision"}
    assert set(r) == fields | {"edits", "post_steps", "edits_per_forward"} and r["n"] == 5
    assert r["forwards_by_precision"] == {"full": r["nfe"]}  # no precision schedule: every forward full
    assert r["tpf"] > 1.0  # the threshold rule commits several tokens per forward


def test_training_script_writes_the_shipped_config_exactly():
    from dinfer_rt.demo.train import model_config

    assert json.dumps(model_config(), indent=2) + "\n" == (EMBEDDED_MODEL / "config.json").read_text()
