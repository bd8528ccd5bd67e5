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
    items = task.heldout(16)
    ids = torch.tensor([[1] + [task_id(c) for c in it.prompt] + [2] * 40 for it in items])
    ref = dinfer_rt.load_model().forward(ids)
    got = dinfer_rt.load_model(dtype="bfloat16").forward(ids).float()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.99, agree


def task_id(ch: str) -> int:
    from dinfer_rt.demo.train import VOCAB

    return VOCAB[ch]
