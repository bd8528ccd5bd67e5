"""Request priority (issue #40 point 4, vLLM's meaning): an int, lower admitted first, FIFO within
a priority, default 0; running rows are never preempted. The engine's wait queue, and the
server's ``priority`` body field (parsed, refused when not an int, handed to the engine)."""

from __future__ import annotations

import pytest

import dinfer_rt
from dinfer_rt.engine import Engine
from dinfer_rt.errors import GenerationError
from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing import checkpoints


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return dinfer_rt.load_model(checkpoints.sdar(tmp_path_factory.mktemp("sdar")), backend="cpu")


PARAMS = SamplingParams(gen_length=8, block_length=4, strategy="threshold", threshold=0.2, cache="dual")
PROMPTS = [[7 + i, 20 + i, 9, 30 + i, 11] for i in range(6)]


def test_lower_priority_value_is_admitted_first_and_fifo_within_one(model):
    engine = Engine(model, max_num_seqs=1, block_length=4)
    busy = engine.submit(PROMPTS[0], PARAMS)
    engine.step()  # the one row is taken: everything below waits
    order = [(5, 1), (5, 2), (0, 3), (-2, 4), (0, 5)]  # (priority, prompt)
    reqs = {i: engine.submit(PROMPTS[i], PARAMS, priority=p) for p, i in order}
    assert [g[0].priority for g in engine.waiting] == [-2, 0, 0, 5, 5]
    admitted = []
    while engine.has_work():
        engine.step()
        for i, r in reqs.items():
            if r.status != "waiting" and i not in admitted:
                admitted.append(i)
    assert admitted == [4, 3, 5, 1, 2]  # by priority, then arrival
    llm = LLM(model)
    for i, r in {0: busy, **reqs}.items():  # answers do not depend on the order
        assert r.error is None and r.output_ids == llm.generate([PROMPTS[i]], PARAMS)[0].token_ids[: len(r.output_ids)]


def test_priority_must_be_an_int_and_defaults_to_zero(model):
    engine = Engine(model, max_num_seqs=1, block_length=4)
    assert engine.submit(PROMPTS[0], PARAMS).priority == 0
    for bad in (1.5, "1", True, None):
        with pytest.raises(GenerationError, match="priority"):
            engine.submit(PROMPTS[0], PARAMS, priority=bad)


def test_requests_of_different_priorities_are_not_merged():
    """Waiting requests with equal settings merge into one cohort only within a priority."""
    llm = LLM()  # the embedded (bidirectional) model: the family whose waiting requests merge
    params = SamplingParams(strategy="threshold", block_length=8, gen_length=16)
    engine = Engine(llm.model, max_num_seqs=4)
    prompt = llm.encode("qwertyuiop", True)
    a, b = engine.submit(prompt, params), engine.submit(prompt, params)
    c = engine.submit(prompt, params, priority=1)
    engine.step()
    assert a.cohort is b.cohort and c.cohort is not a.cohort
    engine.run_until_idle()
    assert a.output_ids == b.output_ids == c.output_ids


def test_server_accepts_priority_and_hands_it_to_the_engine():
    from fastapi.testclient import TestClient

    from dinfer_rt.server import ServeConfig, build_app

    llm = LLM()
    app = build_app(llm.model, SamplingParams(block_length=8, strategy="threshold"), ServeConfig(max_num_seqs=2))
    engine = app.state.engine
    seen = []
    real = engine.submit

    def spy(*args, **kwargs):
        req = real(*args, **kwargs)
        seen.append(req.priority)
        return req

    engine.submit = spy
    body = {"prompt": "qwertyuiop", "max_tokens": 16}
    with TestClient(app) as client:
        plain = client.post("/v1/completions", json=body)
        ranked = client.post("/v1/completions", json={**body, "priority": -3})
        chat_body = {"messages": [{"role": "user", "content": "ab"}], "priority": 2}
        chat = client.post("/v1/chat/completions", json=chat_body)
        assert plain.status_code == ranked.status_code == chat.status_code == 200, (ranked.text, chat.text)
        assert ranked.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        for bad in ("high", 1.5, True, [1]):
            r = client.post("/v1/completions", json={**body, "priority": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert seen == [0, -3, 2]


def test_engine_process_command_carries_priority(model):
    """``--engine-process`` / replicas: the front's submit command carries the priority to the
    engine process's engine (``workers._apply``)."""
    from dinfer_rt.workers import _apply

    engine = Engine(model, max_num_seqs=1, block_length=4)
    cmds = [("submit", "a", PROMPTS[0], PARAMS, 8, False, False, 4), ("submit", "b", PROMPTS[1], PARAMS, 8, False)]
    _apply(cmds, engine)
    assert [(g[0].id, g[0].priority) for g in engine.waiting] == [("b", 0), ("a", 4)]
