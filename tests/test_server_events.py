"""How the server hands engine events to the HTTP side and streams them (``dinfer_rt.server``):
``EventRelay`` holds a step's events and hands them over together when the step ends (one
``call_soon_threadsafe`` per loop, in order), at once
from any other thread, and never raises for a closed loop; a streamed answer's chunks that are
ready together leave as one body message (its last chunk, the usage and ``[DONE]`` included),
with the same bytes as one message each."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from dinfer_rt.server import EventRelay, _deliver


class FakeLoop:
    """Records ``call_soon_threadsafe`` calls and the threads making them, and runs them at once
    (as the loop would, later)."""

    def __init__(self, closed: bool = False) -> None:
        self.calls, self.callers, self.closed = [], [], closed

    def call_soon_threadsafe(self, fn, *args):
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls.append(args)
        self.callers.append(threading.get_ident())
        fn(*args)


class FakeQueue:
    def __init__(self) -> None:
        self.items = []

    def put_nowait(self, item) -> None:
        self.items.append(item)


def test_a_steps_events_leave_together_after_it_in_order():
    relay, loop, q1, q2 = EventRelay(), FakeLoop(), FakeQueue(), FakeQueue()
    with relay.holding():
        for k in range(3):
            relay.post(loop, q1, ("a", k))
            relay.post(loop, q2, ("b", k))
        assert loop.calls == [] and q1.items == []  # nothing leaves while the step runs
    assert len(loop.calls) == 1 and relay.batches == 1  # one wake-up of the loop for the whole step
    assert q1.items == [("a", 0), ("a", 1), ("a", 2)] and q2.items == [("b", 0), ("b", 1), ("b", 2)]
    with relay.holding():
        pass
    assert len(loop.calls) == 1  # a step without events schedules nothing


def test_events_of_other_threads_leave_at_once():
    relay, loop, q = EventRelay(), FakeLoop(), FakeQueue()
    relay.post(loop, q, ("outside", 0))  # no step: delivered at once
    assert q.items == [("outside", 0)]
    inside, release = threading.Event(), threading.Event()

    def engine():
        with relay.holding():
            relay.post(loop, q, ("step", 0))
            inside.set()
            release.wait(10)

    t = threading.Thread(target=engine)
    t.start()
    assert inside.wait(10)
    relay.post(loop, q, ("drain", 0))  # another thread while the engine thread holds its step
    assert ("drain", 0) in q.items and ("step", 0) in q.items  # its flush carries the pending ones too
    release.set()
    t.join(10)
    assert q.items.count(("step", 0)) == 1  # each event once


def test_a_closed_loop_drops_its_events_and_keeps_the_others():
    relay, gone, live, q = EventRelay(), FakeLoop(closed=True), FakeLoop(), FakeQueue()
    with relay.holding():
        relay.post(gone, FakeQueue(), ("x", 0))
        relay.post(live, q, ("y", 0))
    assert q.items == [("y", 0)]
    relay.post(gone, FakeQueue(), ("x", 1))  # never raises into the engine


def test_events_reach_a_real_asyncio_queue_in_order():
    loop = asyncio.new_event_loop()
    q: asyncio.Queue = asyncio.Queue()
    relay = EventRelay()
    runner = threading.Thread(target=loop.run_forever)
    runner.start()
    try:
        for step in range(5):
            with relay.holding():
                for k in range(4):
                    relay.post(loop, q, (step, k))

        async def drain():
            return [await asyncio.wait_for(q.get(), 10) for _ in range(20)]

        got = asyncio.run_coroutine_threadsafe(drain(), loop).result(30)
    finally:
        relay.close()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()
    assert got == [(s, k) for s in range(5) for k in range(4)]
    assert relay.batches == 5  # one wake-up a step


def test_deliver_puts_in_order():
    q = FakeQueue()
    _deliver([(q, 1), (q, 2)])
    assert q.items == [1, 2]


@pytest.fixture(scope="module")
def app_and_llm():
    pytest.importorskip("fastapi")
    from dinfer_rt.llm import LLM
    from dinfer_rt.sampling import SamplingParams
    from dinfer_rt.server import ServeConfig, build_app

    llm = LLM()
    app = build_app(llm.model, SamplingParams(block_length=8, strategy="threshold"), ServeConfig(max_num_seqs=4))
    return app, llm


def _recorded(app):
    """``app`` behind an ASGI wrapper that keeps every response body message it sends."""
    bodies: list[bytes] = []

    async def wrapper(scope, receive, send):
        async def keep(message):
            if message["type"] == "http.response.body" and message.get("body"):
                bodies.append(message["body"])
            await send(message)

        await app(scope, receive, keep)

    return wrapper, bodies


def test_a_streams_last_chunks_leave_in_one_message(app_and_llm):
    from fastapi.testclient import TestClient

    from dinfer_rt.demo import task
    from dinfer_rt.sampling import SamplingParams

    app, llm = app_and_llm
    wrapper, bodies = _recorded(app)
    item = task.heldout(1)[0]
    body = {
        "messages": [{"role": "user", "content": item.letters}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with TestClient(wrapper) as client:
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    want = llm.generate([item.letters], SamplingParams(block_length=8, strategy="threshold"))[0].text
    assert text == want  # the same stream as one message per chunk
    assert b"".join(bodies).decode() == r.text
    last = bodies[-1].decode()
    # the finishing chunk, the usage chunk and [DONE] leave together: one write, one client wake-up
    assert '"finish_reason": "stop"' in last and '"usage"' in last and last.endswith("data: [DONE]\n\n")
    assert len(bodies) < len(events)
