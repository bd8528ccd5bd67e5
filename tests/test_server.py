"""``dinfer-rt serve`` as a real subprocess on a free localhost port, driven by the official
``openai`` client (and raw HTTP for malformed requests): completions and chat, streaming, 32
concurrent clients against offline greedy output, disconnects, queue overflow, a failing step,
bad requests, SIGTERM drain. Every server is bounded in time (``--shutdown-after-s``)."""

from __future__ import annotations

import json
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from dinfer_rt.demo import task
from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing.serving import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = ["--strategy", "threshold", "--block-length", "8"]
POISON = 3  # the embedded tokenizer's <|unk|>: never generated, so only a prompt can carry it


class Server(ServerProcess):
    def __init__(self, *args: str, launcher: list[str] | None = None) -> None:
        env = {"DINFER_TEST_POISON": str(POISON), "PYTHONPATH": str(ROOT)}
        super().__init__(*DEFAULTS, *args, launcher=launcher, cwd=ROOT, env=env)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id


@pytest.fixture(scope="module")
def server():
    s = Server("--max-num-seqs", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline():
    return LLM()


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"strategy": "threshold", "block_length": 8, **kw})


def _chat(letters: str) -> list[dict]:
    return [{"role": "user", "content": letters}]


def test_models_health_and_metrics(server):
    assert server.model == "dinfer-rt-embedded"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert "dinfer_running_requests" in httpx.get(server.url + "/metrics").text


def test_chat_and_completions_answer_like_offline(server, offline):
    item = task.heldout(1)[0]
    want = offline.generate([item.letters], _params())[0]
    chat = server.client.chat.completions.create(model=server.model, messages=_chat(item.letters))
    assert chat.choices[0].message.content == want.text and task.check(item.letters, want.text)
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.completion_tokens == len(want.token_ids) and chat.usage.prompt_tokens == 12
    prompt = offline.model.tokenizer.apply_chat_template(_chat(item.letters))  # same ids, as raw text
    done = server.client.completions.create(model=server.model, prompt=prompt, max_tokens=40)
    assert done.choices[0].text == want.text and done.usage.total_tokens == 12 + len(want.token_ids)
    cut = server.client.completions.create(model=server.model, prompt=prompt, max_tokens=5)
    short = offline.generate([item.letters], _params(gen_length=8))[0].text  # 5 rounds up to one block
    assert cut.choices[0].text == short[:5] and cut.choices[0].finish_reason == "length"
    stop = server.client.completions.create(model=server.model, prompt=prompt, stop=["|"])
    assert stop.choices[0].text == want.text.split("|")[0] and stop.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_chunks_concatenate_to_the_answer_and_are_never_revised(server, offline, chat):
    letters = task.heldout(2)[1].letters
    knobs = {"strategy": "low_confidence", "cache": "adaptive"}  # out-of-order commits, many steps
    want = offline.generate([letters], _params(**knobs))[0].text
    if chat:
        stream = server.client.chat.completions.create(
            model=server.model, messages=_chat(letters), stream=True, stream_options={"include_usage": True},
            extra_body=knobs,
        )  # fmt: skip
    else:
        prompt = offline.model.tokenizer.apply_chat_template(_chat(letters))
        stream = server.client.completions.create(
            model=server.model, prompt=prompt, stream=True, stream_options={"include_usage": True}, extra_body=knobs
        )
    text, pieces, usage = "", 0, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        if not ch.choices:
            continue
        piece = (ch.choices[0].delta.content if chat else ch.choices[0].text) or ""
        text += piece
        pieces += bool(piece)
        assert want.startswith(text)  # every prefix sent is final: nothing is ever taken back
    assert text == want and pieces > 1 and usage.completion_tokens == len(offline.model.tokenizer.encode(want)) + 0


def test_canvas_stream_marks_the_masks(server):
    with httpx.stream(
        "POST", server.url + "/v1/completions", timeout=60,
        json={"prompt": "<|startoftext|>qazwsxedcr=", "stream": True, "return_canvas": True, "max_tokens": 16},
    ) as r:  # fmt: skip
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    canvases = [json.loads(e)["choices"][0]["canvas"] for e in events[:-1] if "canvas" in e]
    assert len(canvases) >= 2 and "\u2591" in canvases[0] and len(canvases[0]) == 16


def test_32_concurrent_clients_get_their_offline_answers(server, offline):
    items = task.heldout(32)
    rules = [{}, {"strategy": "low_confidence"}, {"strategy": "entropy"}, {"cache": "adaptive"}]
    jobs = []
    for i, item in enumerate(items):
        knobs, max_tokens = rules[i % 4], (32, 40)[i % 2]
        chat = i % 3 != 0
        # every fifth prompt carries extra leading tokens: a different prompt length, offline-checked only
        prefix = "<|startoftext|>" * (1 + (i % 5 == 4))
        jobs.append((item, knobs, max_tokens, chat, prefix))

    def ask(job):
        item, knobs, max_tokens, chat, prefix = job
        if chat and prefix == "<|startoftext|>":
            r = server.client.chat.completions.create(
                model=server.model, messages=_chat(item.letters), max_tokens=max_tokens, extra_body=knobs
            )
            return r.choices[0].message.content
        r = server.client.completions.create(
            model=server.model, prompt=prefix + item.prompt, max_tokens=max_tokens, extra_body=knobs
        )
        return r.choices[0].text

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, jobs))
    for (item, knobs, max_tokens, _, prefix), got in zip(jobs, answers):
        ids = offline.model.tokenizer.encode(prefix + item.prompt)
        want = offline.generate([ids], _params(**knobs, gen_length=max_tokens))[0].text
        assert got == want, (item.letters, knobs, prefix)
        if len(prefix) == len("<|startoftext|>"):
            assert task.check(item.letters, got), (item.letters, knobs, got)


def test_a_client_that_disconnects_frees_its_slot(server):
    aborted = server.metric('dinfer_requests_total{finish_reason="abort"}')
    with httpx.stream(
        "POST", server.url + "/v1/completions", timeout=60,
        json={"prompt": "<|startoftext|>plmoknijbu=", "stream": True, "max_tokens": 48, "strategy": "low_confidence",
              "block_length": 48},
    ) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text": ""' not in line:
                break  # one chunk of text, then hang up mid-stream
    deadline = time.time() + 30
    while server.metric('dinfer_requests_total{finish_reason="abort"}') < aborted + 1 and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric('dinfer_requests_total{finish_reason="abort"}') == aborted + 1
    assert server.metric("dinfer_running_requests") == 0


def test_a_non_streamed_client_that_hangs_up_frees_its_row_at_once(server):
    """A whole (non-streamed) answer's client that closes the connection while its rows run:
    the server sees the disconnect when it happens, aborts the rows and sends nothing."""
    import socket
    from urllib.parse import urlsplit

    aborted = server.metric('dinfer_requests_total{finish_reason="abort"}')
    body = json.dumps({"prompt": "<|startoftext|>plmoknijbu=", "max_tokens": 48, "strategy": "low_confidence",
                       "block_length": 48}).encode()  # fmt: skip
    where = urlsplit(server.url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.time() + 30
        while server.metric("dinfer_running_requests") < 1 and time.time() < deadline:
            time.sleep(0.005)
        assert server.metric("dinfer_running_requests") == 1  # running: 48 one-token steps take a while
    deadline = time.time() + 30
    while server.metric('dinfer_requests_total{finish_reason="abort"}') < aborted + 1 and time.time() < deadline:
        time.sleep(0.05)
    assert server.metric('dinfer_requests_total{finish_reason="abort"}') == aborted + 1
    assert server.metric("dinfer_running_requests") == 0


BAD = [
    ("completions", {"prompt": "abc", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "abc", "max_tokens": 500}, "max_tokens"),
    ("completions", {"prompt": "abc", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"prompt": "abc", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "abc", "threshold": 1.5}, "threshold"),
    ("completions", {"prompt": "abc", "strategy": "greedy"}, "strategy"),
    ("completions", {"prompt": "abc", "cache": "lru"}, "cache"),
    ("completions", {"prompt": "abc", "block_length": 0}, "block_length"),
    ("completions", {"prompt": "abc", "n": 2}, "n"),
    ("completions", {"prompt": "abc", "stop": [""]}, "stop"),
    ("completions", {"prompt": "abc", "seed": -3}, "seed"),
    ("completions", {"prompt": "abc", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "abc", "top_p": 0.5}, "top_p"),
    ("completions", {"prompt": "abc", "treshold": 0.5}, "treshold"),  # unknown fields are ignored, misspelt knobs not
    ("completions", {"prompt": "abc", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": 12}, "prompt"),
    ("completions", {"prompt": [1, 99]}, "prompt"),
    ("completions", {"prompt": "a" * 70}, "prompt"),
    ("completions", {"prompt": "abc", "model": "gpt-4"}, "model"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages[0]"),
]


@pytest.mark.parametrize("endpoint, body, field", BAD, ids=[f"{e}-{f}" for e, _, f in BAD])
def test_bad_requests_are_400s_naming_the_field(server, endpoint, body, field):
    r = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == (404 if field == "model" else 400), err
    assert err["param"] == field and field.split(".")[-1].split("[")[0] in err["message"], err


def test_body_that_is_not_json_is_a_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def small_server():
    """One row at a time, two waiting at most; forwards holding the poison token raise."""
    s = Server("--max-num-seqs", "1", "--max-queue", "2", "--drain-timeout", "20",
               launcher=[sys.executable, str(ROOT / "tests" / "fault_server.py")])  # fmt: skip
    yield s
    s.stop()


def test_queue_overflow_answers_429_and_nothing_hangs(small_server):
    def ask(i):
        try:
            r = small_server.client.chat.completions.create(model=small_server.model, messages=_chat("qwertyuiop"))
            return r.choices[0].message.content
        except openai.RateLimitError as e:
            assert "max_queue 2" in str(e)
            return 429

    with ThreadPoolExecutor(20) as pool:
        outcomes = list(pool.map(ask, range(20)))
    answered = [o for o in outcomes if o != 429]
    assert 3 <= len(answered) < 20 and all(task.check("qwertyuiop", a) for a in answered)
    assert httpx.get(small_server.url + "/health").json()["status"] == "ok"


def test_a_failing_step_is_a_500_and_the_server_keeps_serving(small_server):
    with pytest.raises(openai.InternalServerError, match="poisoned input"):
        small_server.client.completions.create(model=small_server.model, prompt=[1, POISON, 7, 4])
    r = small_server.client.chat.completions.create(model=small_server.model, messages=_chat("asdfghjklz"))
    assert task.check("asdfghjklz", r.choices[0].message.content)


def test_sigterm_finishes_running_rows_then_exits_0(small_server):
    """Last test of the module: the server is gone afterwards."""
    body = {"prompt": "<|startoftext|>mnbvcxzlkj=", "stream": True, "max_tokens": 48, "strategy": "low_confidence"}
    text = ""
    with httpx.stream("POST", small_server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
                break
        small_server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"  # the running row was finished, not cut
    text += "".join(json.loads(x[6:])["choices"][0]["text"] for x in rest if x.startswith("data: {"))
    assert task.check("mnbvcxzlkj", text)
    assert small_server.proc.wait(timeout=30) == 0
    log = small_server.proc.stdout.read()  # one line when draining starts, one when stopped
    assert "dinfer-rt: SIGTERM: draining: 1 running, 0 waiting" in log, log[-2000:]
    assert "dinfer-rt stopped: 1 of the 1 requests in flight while draining were answered, 0 cancelled" in log


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "zombie" in status.read_text()


def test_data_parallel_replicas_share_requests_survive_a_dead_replica_and_stop_with_the_server(offline):
    """``serve --data-parallel-size 2``: two engine processes behind one front end. Concurrent
    clients get their offline answers (streamed or not) and both replicas serve; a bad request is
    still refused at once; a replica killed mid-run is reported and the other keeps answering;
    Ctrl-C (SIGINT to the process group) drains and exits 0, no replica printing a traceback."""
    import os

    s = Server("--data-parallel-size", "2", "--max-num-seqs", "4")
    try:
        items = task.heldout(8)
        want = [o.text for o in offline.generate([it.letters for it in items], _params())]

        def ask(i_item):
            i, item = i_item
            if i % 2:
                stream = s.client.chat.completions.create(model=s.model, messages=_chat(item.letters), stream=True)
                return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            reply = s.client.chat.completions.create(model=s.model, messages=_chat(item.letters))
            return reply.choices[0].message.content

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, enumerate(items))) == want
        replicas = httpx.get(s.url + "/health").json()["replicas"]
        assert [r["alive"] for r in replicas] == [True, True] and all(r["served"] >= 2 for r in replicas)
        bad = httpx.post(f"{s.url}/v1/completions", json={"prompt": [1, 99]}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        os.kill(replicas[1]["pid"], signal.SIGKILL)
        deadline = time.time() + 30
        while httpx.get(s.url + "/health").json()["replicas"][1]["alive"] and time.time() < deadline:
            s.client.chat.completions.create(model=s.model, messages=_chat(items[0].letters))
        assert not httpx.get(s.url + "/health").json()["replicas"][1]["alive"]
        for item, text in zip(items[:3], want[:3]):
            reply = s.client.chat.completions.create(model=s.model, messages=_chat(item.letters))
            assert reply.choices[0].message.content == text  # the live replica answers
        s.interrupt()  # Ctrl-C reaches the replica too: it leaves the drain to the front end
        assert s.proc.wait(timeout=60) == 0
        assert "Traceback" not in s.proc.stdout.read()
    finally:
        s.stop()
    deadline = time.time() + 20
    while not all(_gone(r["pid"]) for r in replicas) and time.time() < deadline:
        time.sleep(0.2)
    assert all(_gone(r["pid"]) for r in replicas)


def test_tensor_parallel_serving_answers_as_one_process_and_exits_when_a_rank_dies(offline):
    """``serve --tensor-parallel-size 2``: one engine replica whose two ranks load their shards
    once and step together (rank 0 broadcasts each round's commands). Chat and completions,
    streamed or not, answer as the one-process model does; a rank killed mid-request fails that
    request naming the rank, /health turns unhealthy and the server exits non-zero on its own."""
    import os
    import threading

    s = Server("--tensor-parallel-size", "2", "--max-num-seqs", "4")
    try:
        items = task.heldout(3)
        want = [o.text for o in offline.generate([it.letters for it in items], _params())]
        reply = s.client.chat.completions.create(model=s.model, messages=_chat(items[0].letters))
        assert reply.choices[0].message.content == want[0]
        stream = s.client.chat.completions.create(model=s.model, messages=_chat(items[1].letters), stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want[1]
        prompt = offline.model.tokenizer.apply_chat_template(_chat(items[2].letters))
        assert s.client.completions.create(model=s.model, prompt=prompt, max_tokens=40).choices[0].text == want[2]
        (replica,) = httpx.get(s.url + "/health").json()["replicas"]
        assert replica["alive"] and len(replica["ranks"]) == 2 and replica["served"] == 3
        slow = {"prompt": prompt, "max_tokens": 40, "strategy": "low_confidence", "block_length": 8}
        answer: dict = {}
        ask = threading.Thread(
            target=lambda: answer.update(r=httpx.post(f"{s.url}/v1/completions", json=slow, timeout=60))
        )
        ask.start()
        time.sleep(0.5)  # the request is running on both ranks
        os.kill(replica["ranks"][1], signal.SIGKILL)
        ask.join(timeout=60)
        assert answer["r"].status_code >= 500 and "replica 0 rank 1 died" in answer["r"].text
        assert s.proc.wait(timeout=60) != 0  # exits on its own, non-zero
        assert "every engine replica has died: replica 0 rank 1 died" in s.proc.stdout.read()
    finally:
        s.stop()
    assert all(_gone(pid) for pid in replica["ranks"])


def test_the_start_up_heap_is_frozen_and_later_garbage_still_collected():
    """``freeze_startup_heap`` (called by ``serve`` and by each engine process once ready): the
    objects alive at start-up leave the collector's generations, so a full collection no longer
    walks them; a cycle made afterwards is still collected."""
    import gc
    import weakref

    from dinfer_rt.workers import freeze_startup_heap

    class Node:
        pass

    before = Node()
    before.self = before  # a cycle alive at "start-up"
    tracked = len(gc.get_objects())
    try:
        frozen = freeze_startup_heap()
        assert frozen >= tracked // 2 and len(gc.get_objects()) < tracked // 2
        assert not any(o is before for o in gc.get_objects())
        later = Node()
        later.self = later
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None  # garbage made after the freeze is collected as before
    finally:
        gc.unfreeze()
    assert any(o is before for o in gc.get_objects())
