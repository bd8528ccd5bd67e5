"""The block prefix cache's counters and ``cached_tokens`` relayed from engine processes (issue #40):
``serve --engine-process`` (one engine process) and ``serve --data-parallel-size 2`` (two replicas)
on a block-causal checkpoint (LLaDA2 layout). One launch per configuration: the same chat sent
several times answers identically, a repeat reports ``usage.prompt_tokens_details.cached_tokens``
(streamed too, with ``include_usage``), and ``/metrics`` shows the lookups, hit tokens, bytes and
budget summed over the engine processes."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing import checkpoints
from dinfer_rt.testing.serving import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
SERVED = {"strategy": "low_confidence_dynamic", "cache": "dual", "block_length": 4, "gen_length": 8}
CPU_BUDGET = 1 << 30  # the prefix cache's default budget per engine on the CPU
MESSAGES = [
    {"role": "system", "content": "youareatinymodelthatanswersshortly"},
    {"role": "user", "content": "addtwelveandthirty"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return checkpoints.llada2(tmp_path_factory.mktemp("relayed_llada2"))


@pytest.fixture(scope="module")
def want(folder):
    """The chat's prompt ids and its answer from ``LLM.generate`` alone (no server, no cache)."""
    offline = LLM(folder, backend="cpu")
    tok = offline.model.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES))
    return ids, offline.generate([ids], SamplingParams(**SERVED))[0].text


def _serve(folder, *args: str) -> ServerProcess:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SERVED.items()]
    env = {"DINFER_BACKEND": "cpu", "PYTHONPATH": str(ROOT)}
    s = ServerProcess("--model", str(folder), *flags, "--max-num-seqs", "2", *args, lifetime=240, cwd=ROOT, env=env)
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return s


def _ask(s: ServerProcess, stream: bool = False) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens) of one chat request."""
    model = s.client.models.list().data[0].id
    if not stream:
        r = s.client.chat.completions.create(model=model, messages=MESSAGES)
        return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens
    chunks = list(
        s.client.chat.completions.create(
            model=model, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    return text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize(
    "flags, replicas",
    [(("--engine-process",), 1), (("--data-parallel-size", "2"), 2)],
    ids=["engine-process", "data-parallel-2"],
)
def test_prefix_cache_counters_and_cached_tokens_come_through_engine_processes(folder, want, flags, replicas):
    ids, text = want
    whole = (len(ids) // 4) * 4  # the prompt's whole blocks: what a repeat may reuse
    s = _serve(folder, *flags)
    try:
        # reported at start: the CPU default, at most each replica's paged pool (the cache's blocks are the pool's)
        budget = s.metric("dinfer_prefix_cache_budget_bytes")
        assert budget == min(replicas * CPU_BUDGET, s.metric("dinfer_kv_pool_bytes")) and budget > 0
        assert s.metric("dinfer_prefix_cache_queries_total") == 0
        # requests go round robin when the replicas are idle: each replica sees the chat once cold,
        # then once warm; with one engine process every request after the first is warm
        answers = [_ask(s) for _ in range(2 * replicas)] + [_ask(s, stream=True)]
        assert [a[:2] for a in answers] == [(text, len(ids))] * len(answers)  # a hit answers as cold
        cached = [a[2] for a in answers]
        assert cached[:replicas] == [0] * replicas
        assert all(0 < c <= whole for c in cached[replicas:]), cached
        assert s.metric("dinfer_prefix_cache_queries_total") == len(answers)
        assert s.metric("dinfer_prefix_cache_hits_total") == sum(cached)
        assert s.metric("dinfer_prefix_cache_bytes") > 0
        health = httpx.get(s.url + "/health", timeout=10).json()["replicas"]
        assert len(health) == replicas and all(r["served"] >= 2 for r in health)
    finally:
        s.stop()
