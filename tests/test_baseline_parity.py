"""dinfer-rt's dual cache + threshold decoding equals an independent Fast-dLLM-style
implementation (benchmarks/fastdllm_baseline.py, plain torch) token for token."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import dinfer_rt
from dinfer_rt.demo import task
from dinfer_rt.demo.train import BOS_ID, VOCAB
from dinfer_rt.engine import run_batch
from dinfer_rt.loader import EMBEDDED_MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from fastdllm_baseline import PlainLLaDA, generate  # noqa: E402


def test_dual_cache_threshold_matches_the_plain_torch_baseline():
    items = task.heldout(16)
    llm = dinfer_rt.LLM()
    params = dinfer_rt.SamplingParams(
        strategy="threshold", threshold=0.9, cache="dual", block_length=8, early_stop=False
    )
    ours = run_batch(llm.model, [llm.encode(it.letters, True) for it in items], params)
    prompt = torch.tensor([[BOS_ID] + [VOCAB[c] for c in it.prompt] for it in items])
    theirs, nfe = generate(PlainLLaDA(EMBEDDED_MODEL), prompt, 40, 8, 0.9)
    assert torch.equal(ours.tokens, theirs)
    assert ours.nfe == nfe
