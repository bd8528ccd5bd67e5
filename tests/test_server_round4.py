"""A tester's probe of ``dinfer-rt serve`` (round 4), one test per defect:

1. admission is one rule in both modes: the server holds at most its KV pool rows + ``max_queue``
   requests, running or waiting; a completions batch is admitted whole or not at all (a full
   server: 429, nothing queued, no abort counted), and a batch bigger than the server can ever
   hold is a 400 naming ``prompt`` and the limit, before anything is submitted;
2. ``/metrics`` reads its gauges when it is read: the rates of the last 5 s fall to 0 on an idle
   server, and ``dinfer_kv_blocks_used`` drops when an aborted request gives its blocks back;
3. other stacks' knob names (``block_size``, ``num_steps``, ``cache_policy``, ...) are a 400
   naming ours, never silently ignored;
4. ``max_tokens``' stated range accounts for the whole-block rounding, and a block that does not
   fit blames ``block_length`` (or the prompt, when not even the server's block fits);
5. text parts joined with a newline that the tokenizer lacks are told so;
6. HEAD on the GET routes is answered as GET without a body;
7. the OpenAPI schema has no duplicate operation id (the shutdown lines are in ``test_server.py``'s
   SIGTERM test);
8. ``/v1/models``' ``created`` is the server's start, and a ``chat_template_kwargs`` key the
   template does not read is a 400.

Most cases run against the app in this process (``build_app`` over the embedded model, driven
through ASGI, no socket); the ``--engine-process`` cases against one real server."""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import dinfer_rt
from dinfer_rt.demo import task
from dinfer_rt.engine import EngineStats
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing.serving import ServerProcess

pytest.importorskip("fastapi")

from dinfer_rt.server import Metrics, ServeConfig, build_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
P = "<|startoftext|>qwertyuiop="  # a raw completions prompt of the embedded task (12 tokens)
ABORT = 'dinfer_requests_total{finish_reason="abort"}'
REASONS = ("stop", "length")


@pytest.fixture(scope="module")
def model():
    return dinfer_rt.load_model(backend="cpu")


def _defaults(model, **kw) -> SamplingParams:
    """The server's defaults as ``serve`` resolves them (block_length: the model's, 40 here)."""
    return SamplingParams(strategy="threshold", **kw).for_model(model.spec)


async def until(cond) -> None:
    """Wait (at most 5 s) until ``cond()`` holds."""
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def _run_then_stop(scenario, loop) -> str:
    """``asyncio.run(scenario())``, the engine loop stopped after it whatever happened."""
    try:
        return asyncio.run(scenario())
    finally:
        loop.stopped.set()
        loop.wake.set()
        if loop.thread is not None:
            loop.thread.join(timeout=10)


def _sample(text: str, name: str) -> float:
    """One Prometheus sample's value (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dinfer", timeout=120)


# ---------------------------------------------------------------- 1. admission: rows + queue, a batch whole


def test_a_batch_is_admitted_whole_against_rows_plus_queue_and_a_refusal_queues_nothing(model):
    """``--max-num-seqs 2 --max-queue 2`` in one process: the server holds 4 requests. The engine
    is not stepped until the end, so what is queued stays queued: a batch of 3 is admitted (the
    engine's wait-queue bound refused its third prompt before), a batch of 2 next to it is a 429
    that queues nothing, one more request still fits; a batch of 5 is a 400 naming ``prompt``.
    Once stepped, every admitted prompt is answered and no abort was counted."""
    app = build_app(model, _defaults(model), ServeConfig(max_num_seqs=2, max_queue=2), engine_thread=False)
    engine, loop = app.state.engine, app.state.loop

    async def scenario():
        async with _client(app) as c:
            body = {"max_tokens": 8}
            never = await c.post("/v1/completions", json={**body, "prompt": [P] * 5})
            assert never.status_code == 400, never.text
            err = never.json()["error"]
            assert err["param"] == "prompt", err
            assert "holds 5 prompts, but this server holds at most 4 requests at once" in err["message"], err
            assert "(2 KV pool rows + max_queue 2)" in err["message"], err
            assert engine.num_waiting == 0
            three = asyncio.create_task(c.post("/v1/completions", json={**body, "prompt": [P] * 3}))
            await until(lambda: engine.num_waiting == 3)
            full = await c.post("/v1/completions", json={**body, "prompt": [P] * 2})
            assert full.status_code == 429, full.text
            message = full.json()["error"]["message"]
            assert "the server is full for a batch of 2: 3 requests in flight, at most 4" in message, message
            assert "max_queue 2" in message and engine.num_waiting == 3
            one = asyncio.create_task(c.post("/v1/completions", json={**body, "prompt": P}))
            await until(lambda: engine.num_waiting == 4)
            assert (await c.post("/v1/completions", json={**body, "prompt": P})).status_code == 429
            loop.start_thread()  # now the engine runs
            answers = [await three, await one]
            assert [len(r.json()["choices"]) for r in answers] == [3, 1], [r.text for r in answers]
            for r in answers:
                assert all(ch["text"] for ch in r.json()["choices"]), r.text
            idle = await c.post("/v1/completions", json={**body, "prompt": [P] * 4})  # 4 fit an idle server
            assert idle.status_code == 200 and len(idle.json()["choices"]) == 4, idle.text
            for _ in range(100):  # (the engine thread counts a finish just after handing its answer over)
                text = (await c.get("/metrics")).text
                if sum(_sample(text, f'dinfer_requests_total{{finish_reason="{r}"}}') for r in REASONS) == 8:
                    break
                await asyncio.sleep(0.02)
            return text

    metrics = _run_then_stop(scenario, loop)
    assert _sample(metrics, ABORT) == 0, metrics
    assert sum(_sample(metrics, f'dinfer_requests_total{{finish_reason="{r}"}}') for r in REASONS) == 8, metrics


def test_a_client_that_goes_away_hands_its_room_back_before_the_engine_steps(model):
    """A full server (1 row, no queue) whose only request's client hangs up: the front cancels it
    and a request sent at once is admitted, though the engine (not stepped) still holds the
    cancelled row until its next step; once stepped, the new request is answered and the
    cancelled one counted as an abort. (Before, the room came back only at that step: a 429.)"""
    app = build_app(model, _defaults(model), ServeConfig(max_num_seqs=1, max_queue=0), engine_thread=False)
    engine, loop = app.state.engine, app.state.loop
    body = {"prompt": P, "max_tokens": 8}

    async def leaving(gone: asyncio.Event, sent: list) -> None:  # a client that hangs up when told
        parts = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive():
            if parts:
                return parts.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        headers = [(b"host", b"dinfer"), (b"content-type", b"application/json")]
        path = "/v1/completions"
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": headers, "client": ("127.0.0.1", 1), "server": ("dinfer", 80)}  # fmt: skip
        await app(scope, receive, send)

    async def scenario():
        async with _client(app) as c:
            gone, sent = asyncio.Event(), []
            first = asyncio.create_task(leaving(gone, sent))
            await until(lambda: engine.num_waiting == 1)
            full = await c.post("/v1/completions", json=body)
            assert full.status_code == 429, full.text
            gone.set()
            await asyncio.wait_for(first, 10)
            assert sent == []  # nobody to answer
            second = asyncio.create_task(c.post("/v1/completions", json=body))
            # admitted beside the cancelled one (still queued in the engine, no longer counted), not a 429
            await until(lambda: sum(map(len, engine.waiting)) == 2 and engine.num_waiting == 1)
            assert engine.stats.steps == 0
            loop.start_thread()
            answer = await asyncio.wait_for(second, 60)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"], answer.text
            for _ in range(100):
                text = (await c.get("/metrics")).text
                if _sample(text, ABORT) == 1:
                    return text
                await asyncio.sleep(0.02)
            return text

    metrics = _run_then_stop(scenario, loop)
    assert _sample(metrics, ABORT) == 1, metrics


@pytest.fixture(scope="module")
def split_server():
    """``--engine-process`` with 2 rows and a queue of 2 (bounded: it exits by itself)."""
    s = ServerProcess(
        "--engine-process", "--max-num-seqs", "2", "--max-queue", "2", "--strategy", "low_confidence",
        cwd=ROOT, lifetime=240,
    )  # fmt: skip
    yield s
    s.stop()


def _served(s: ServerProcess) -> int:
    return sum(r["served"] for r in httpx.get(s.url + "/health").json()["replicas"])


def test_the_engine_process_admits_by_the_same_rule_and_a_batch_that_never_fits_submits_nothing(split_server):
    s = split_server
    url = s.url + "/v1/completions"
    served, aborted = _served(s), s.metric(ABORT)
    fast = {"max_tokens": 8, "strategy": "threshold", "block_length": 8}
    fits = httpx.post(url, json={"prompt": [P] * 4, **fast}, timeout=120)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4, fits.text
    assert _served(s) == served + 4
    never = httpx.post(url, json={"prompt": [P] * 5, **fast}, timeout=60)
    assert never.status_code == 400, never.text
    err = never.json()["error"]
    assert err["param"] == "prompt" and "at most 4 requests at once (2 KV pool rows + max_queue 2)" in err["message"]
    assert _served(s) == served + 4 and s.metric(ABORT) == aborted  # nothing was routed, nothing aborted
    assert httpx.post(url, json={"prompt": P, **fast}, timeout=60).status_code == 200  # and no 429 after


# ---------------------------------------------------------------- 2. /metrics is read when it is read


def _fake_engine(used: int):
    return SimpleNamespace(stats=EngineStats(), num_running=1, num_waiting=0, blocks=SimpleNamespace(used=used))


def test_rates_are_computed_when_read_and_fall_to_zero_on_an_idle_server():
    metrics, now = Metrics(), [1000.0]
    metrics.clock = lambda: now[0]
    engine = _fake_engine(13)
    for _ in range(10):  # 10 forwards of 3 tokens over 1 s
        now[0] += 0.1
        metrics.on_step(0.1, engine, 3)
    busy = metrics.text(engine).decode()
    assert _sample(busy, "dinfer_forwards_per_second") == pytest.approx(10.0)
    assert _sample(busy, "dinfer_tokens_per_second") == pytest.approx(30.0)
    assert _sample(busy, "dinfer_tokens_per_forward") == pytest.approx(3.0)
    now[0] += 2  # still in the window: the same forwards over 3 s
    assert _sample(metrics.text(engine).decode(), "dinfer_forwards_per_second") == pytest.approx(10 / 3)
    now[0] += 30  # idle: no forward in the last 5 s
    engine.blocks.used = 0  # the blocks were given back without a forward (an abort)
    idle = metrics.text(engine).decode()
    for name in ("dinfer_forwards_per_second", "dinfer_tokens_per_second", "dinfer_tokens_per_forward"):
        assert _sample(idle, name) == 0.0, name
    assert _sample(idle, "dinfer_kv_blocks_used") == 0.0
    assert _sample(idle, "dinfer_forwards_total") == 10.0  # the counters stay


def test_an_aborted_streams_blocks_leave_dinfer_kv_blocks_used_with_an_engine_process(split_server):
    """A chat stream dropped after its first chunk is aborted without a forward after it: the
    blocks its engine process reports free must show at once in /metrics (they stayed at the last
    forward's count before)."""
    s = split_server
    body = {"messages": [{"role": "user", "content": "qwertyuiop"}], "stream": True, "steps": 40}
    for _ in range(3):  # the drop must beat the request's 40 forwards (else it simply finished)
        aborted = s.metric(ABORT)
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        deadline = time.time() + 10
        while time.time() < deadline and s.metric(ABORT) == aborted:
            time.sleep(0.05)
        if s.metric(ABORT) > aborted:
            break
    else:
        pytest.fail("the stream finished before it was dropped, three times")
    deadline = time.time() + 10
    while time.time() < deadline and (s.metric("dinfer_kv_blocks_used") or s.metric("dinfer_running_requests")):
        time.sleep(0.1)
    assert s.metric("dinfer_kv_blocks_used") == 0 and s.metric("dinfer_running_requests") == 0
    assert s.metric("dinfer_kv_blocks") > 0  # a paged pool


# ---------------------------------------------------------------- 3-8: requests against one in-process app


@pytest.fixture(scope="module")
def app(model):
    from fastapi.testclient import TestClient

    built = int(time.time())
    application = build_app(model, _defaults(model), ServeConfig(max_num_seqs=4))
    with TestClient(application) as client:
        yield SimpleNamespace(client=client, built=built, app=application)


def _chat(content, **body) -> dict:
    return {"messages": [{"role": "user", "content": content}], **body}


REFUSED = [
    # 3. other stacks' names for our knobs
    ("block-size", False, {"prompt": P, "block_size": 8}, "block_size", "did you mean 'block_length'?"),
    ("num-steps", False, {"prompt": P, "num_steps": 8}, "num_steps", "did you mean 'steps'?"),
    ("diffusion-steps", True, _chat("ab", diffusion_steps=8), "diffusion_steps", "did you mean 'steps'?"),
    ("cache-policy", False, {"prompt": P, "cache_policy": "dual"}, "cache_policy", "did you mean 'cache'?"),
    ("kv-cache", True, _chat("ab", kv_cache="prefix"), "kv_cache", "did you mean 'cache'?"),
    ("max-new-tokens", False, {"prompt": P, "max_new_tokens": 8}, "max_new_tokens", "did you mean 'max_tokens'?"),
    # 4. max_tokens' range counts the whole blocks; the block or the prompt is blamed when it does not fit
    ("max-tokens-past-the-blocks", False, {"prompt": "qwertyuiop", "max_tokens": 55}, "max_tokens",
     "'max_tokens' must be in [1, 40], got 55 (the prompt's 10 tokens leave 54 of the max model length 64, "
     "and the answer is decoded in whole blocks of 40, 'block_length')"),
    ("max-tokens-rounding-past-the-model", False, {"prompt": "qwertyuiop", "max_tokens": 41}, "max_tokens",
     "'max_tokens' must be in [1, 40], got 41"),
    ("max-completion-tokens", True, _chat("qwertyuiop", max_completion_tokens=49), "max_completion_tokens",
     "'max_completion_tokens' must be in [1, 40], got 49"),
    ("block-past-the-room", False, {"prompt": "qwertyuiop", "max_tokens": 8, "block_length": 1000}, "block_length",
     "'block_length' 1000 does not fit: the answer is decoded in whole blocks, and the prompt's 10 tokens leave "
     "54 of the max model length 64; 'block_length' must be at most 54 here"),
    ("prompt-leaves-less-than-a-block", False, {"prompt": "qwertyuiop" * 3, "max_tokens": 8}, "prompt",
     "the prompt is 30 tokens; the max model length 64 leaves 34, less than one block of 40"),
    ("chat-leaves-less-than-a-block", True, _chat("qwertyuiop" * 3), "messages",
     "the prompt is 32 tokens; the max model length 64 leaves 32, less than one block of 40"),
    ("batch-prompt-leaves-less-than-a-block", False, {"prompt": ["qw", "qwertyuiop" * 3]}, "prompt[1]",
     "less than one block of 40"),
    # 5. text parts joined with a newline this tokenizer lacks
    ("parts-joined-with-a-newline", True,
     _chat([{"type": "text", "text": "qwert"}, {"type": "text", "text": "yuiop"}]), "messages[0].content",
     "its 2 text parts were joined with a newline, as vLLM joins them, and this tokenizer has no newline"),
    # 8. a template kwarg the template does not read
    ("template-kwarg-it-does-not-read", True, _chat("ab", chat_template_kwargs={"enable_thinking": False}),
     "chat_template_kwargs", "'enable_thinking' is not a variable this model's chat template reads"),
]  # fmt: skip


@pytest.mark.parametrize("chat, body, param, fragment", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_each_refused_request_is_a_400_naming_the_field(app, chat, body, param, fragment):
    r = app.client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


@pytest.mark.parametrize(
    "body, tokens",
    [
        ({"prompt": "qwertyuiop", "max_tokens": 40}, 40),  # the top of the stated range is answered
        ({"prompt": "qwertyuiop", "max_tokens": 54, "block_length": 6}, 54),  # 9 blocks of 6 fill the room
        ({"prompt": "qwertyuiop" * 3, "max_tokens": 8, "block_length": 8}, 8),  # a smaller block fits
    ],
    ids=["top-of-range", "whole-room", "smaller-block"],
)
def test_what_the_range_states_is_answered(app, body, tokens):
    r = app.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= tokens


def test_a_single_text_part_and_a_template_kwarg_it_reads_are_answered(app):
    one = app.client.post("/v1/chat/completions", json=_chat([{"type": "text", "text": "qwertyuiop"}]))
    assert one.status_code == 200 and task.check("qwertyuiop", one.json()["choices"][0]["message"]["content"])
    read = app.client.post("/v1/chat/completions", json=_chat("ab", chat_template_kwargs={"bos_token": ""}))
    assert read.status_code == 200, read.text  # the template reads bos_token: "ab=" without it
    assert (one.json()["usage"]["prompt_tokens"], read.json()["usage"]["prompt_tokens"]) == (12, 3)


@pytest.mark.parametrize("path", ["/health", "/ping", "/v1/models", "/v1/models/dinfer-rt", "/version", "/metrics"])
def test_head_on_a_get_route_is_the_get_without_its_body(app, path):
    head, get = app.client.head(path), app.client.get(path)
    assert head.status_code == get.status_code == 200, head.text
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


def test_head_on_a_generation_route_is_a_405_without_a_body(app):
    r = app.client.head("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.content == b""


def test_the_openapi_schema_has_distinct_operation_ids(app):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns "Duplicate Operation ID ..." for a shared one
        schema = app.client.get("/openapi.json").json()
    ids = [op["operationId"] for methods in schema["paths"].values() for op in methods.values()]
    assert len(ids) == len(set(ids)) and {"ping_get", "ping_post"} <= set(ids), ids


def test_models_created_is_the_servers_start(app):
    while int(time.time()) <= app.built:  # a request now is in a later second than the start
        time.sleep(0.05)
    listed = app.client.get("/v1/models").json()["data"][0]["created"]
    card = app.client.get("/v1/models/dinfer-rt").json()["created"]
    assert listed == card <= app.built
