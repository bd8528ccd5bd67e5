"""The block prefix cache behind a real ``dinfer-rt serve`` process (one launch, bounded in
time): a multi-turn chat through the official ``openai`` client reuses the previous turn
(``usage.prompt_tokens_details.cached_tokens``), answers as ``LLM.generate`` alone, and
``/metrics`` counts the lookups, the hit tokens and the cache's bytes."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing import checkpoints
from dinfer_rt.testing.serving import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
SERVED = {"strategy": "low_confidence_dynamic", "cache": "dual", "block_length": 4, "gen_length": 12}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return checkpoints.llada2(tmp_path_factory.mktemp("served_llada2"))


@pytest.fixture(scope="module")
def server(folder):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SERVED.items()]
    env = {"DINFER_BACKEND": "cpu", "PYTHONPATH": str(ROOT)}
    s = ServerProcess("--model", str(folder), *flags, "--max-num-seqs", "2", lifetime=180, cwd=ROOT, env=env)
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield s
    s.stop()


def test_multi_turn_chat_reports_cached_tokens_and_metrics(server, folder):
    client = server.client
    model = client.models.list().data[0].id
    offline = LLM(folder, backend="cpu")
    tok, params = offline.model.tokenizer, SamplingParams(**SERVED)
    messages = [{"role": "system", "content": "youareatinymodel"}, {"role": "user", "content": "addtwelveandthirty"}]
    used = []
    for turn in range(2):
        answer = client.chat.completions.create(model=model, messages=messages)
        ids = tok.encode(tok.apply_chat_template(messages))
        want = offline.generate([ids], params)[0]
        assert answer.choices[0].message.content == want.text
        assert answer.usage.prompt_tokens == len(ids)
        used.append(answer.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": want.text}, {"role": "user", "content": "andseven"}]
        if turn == 0:
            first = len(ids)
    assert used[0] == 0 and used[1] > (first // 4) * 4  # the first turn's prompt and answer blocks
    assert server.metric("dinfer_prefix_cache_queries_total") == 2
    assert server.metric("dinfer_prefix_cache_hits_total") == used[1]
    assert server.metric("dinfer_prefix_cache_bytes") > 0
    # the CPU default, at most the paged pool (the cache's blocks are the pool's)
    assert server.metric("dinfer_prefix_cache_budget_bytes") == min(1 << 30, server.metric("dinfer_kv_pool_bytes"))
