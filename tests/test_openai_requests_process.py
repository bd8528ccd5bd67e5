"""``dinfer-rt serve --engine-process`` (issue #40, point 2): the HTTP front (tokenising, chat
templates, validation, SSE) in the server's process, the engine in a process of its own, joined by
the replicas' channel (``dinfer_rt.workers``). Three real servers, each used once for what only a
fresh one shows: answers equal to ``LLM.generate`` then a SIGTERM that drains both processes; a
killed engine that makes the front answer 503 naming it and exit non-zero; a killed front that
leaves no engine behind (checked by pid)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from dinfer_rt.demo import task
from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing.serving import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
MODEL = "dinfer-rt-embedded"
SLOW = {"max_tokens": 48, "strategy": "low_confidence", "block_length": 48}  # one token per forward: many steps


def _start(*args: str) -> ServerProcess:
    s = ServerProcess(
        "--strategy", "threshold", "--block-length", "8", "--engine-process", *args, cwd=ROOT, lifetime=180
    )  # fmt: skip
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return s


def _engine_pid(s: ServerProcess) -> int:
    (replica,) = httpx.get(s.url + "/health", timeout=10).json()["replicas"]
    assert replica["alive"] and replica["pid"] != s.proc.pid
    return replica["pid"]


def _gone(pid: int, within: float) -> bool:
    """Whether process ``pid`` exits (or is left a zombie) within ``within`` seconds."""
    deadline = time.time() + within
    while time.time() < deadline:
        status = Path(f"/proc/{pid}/status")
        try:
            if "zombie" in status.read_text():
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def offline():
    return LLM()


def test_the_split_server_answers_as_offline_and_sigterm_drains_both_processes(offline):
    s = _start()
    try:
        engine = _engine_pid(s)
        items = task.heldout(2)
        params = SamplingParams(strategy="threshold", block_length=8)
        want = [o.text for o in offline.generate([it.letters for it in items], params)]
        reply = s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": items[0].letters}])
        assert reply.choices[0].message.content == want[0]
        prompts = [
            offline.model.tokenizer.apply_chat_template([{"role": "user", "content": it.letters}]) for it in items
        ]
        stream = s.client.completions.create(model=MODEL, prompt=prompts, max_tokens=40, stream=True)
        texts = ["", ""]
        for ch in stream:
            for c in ch.choices:
                texts[c.index] += c.text
        assert texts == want  # a streamed batch through the channel
        body = {"prompt": prompts[1], "stream": True, **SLOW}
        sent = ""
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    sent += json.loads(line[6:])["choices"][0]["text"]
                    if sent:
                        break
            s.proc.send_signal(signal.SIGTERM)  # mid-answer: the row finishes, then both processes exit
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        sent += "".join(json.loads(x[6:])["choices"][0]["text"] for x in rest if x.startswith("data: {"))
        assert task.check(items[1].letters, sent), sent
        assert s.proc.wait(timeout=60) == 0
        assert _gone(engine, 30)
        log = s.proc.stdout.read()  # a clean shutdown says when it drains and what it drained
        assert "dinfer-rt: SIGTERM: draining: 1 running, 0 waiting" in log, log[-2000:]
        assert "dinfer-rt stopped: 1 of the 1 requests in flight while draining were answered, 0 cancelled" in log
    finally:
        s.stop()


def test_a_dead_engine_makes_the_front_answer_503_naming_it_and_exit_nonzero():
    """One row at a time: of four slow requests, the engine is killed while the first runs, so
    three are on it (running or queued there) when it dies; those not finished are 503s naming it."""
    s = _start("--max-num-seqs", "1")
    try:
        engine = _engine_pid(s)
        assert s.client.completions.create(model=MODEL, prompt="<|startoftext|>qwertyuiop=").choices[0].text
        answers: list = []
        body = {"prompt": "<|startoftext|>asdfghjkl=", **SLOW}
        asks = [
            threading.Thread(
                target=lambda: answers.append(httpx.post(s.url + "/v1/completions", json=body, timeout=60))
            )
            for _ in range(4)
        ]
        for ask in asks:
            ask.start()
        deadline = time.time() + 30  # kill the engine once one request runs there and three wait
        while time.time() < deadline:
            health = httpx.get(s.url + "/health").json()
            if health["running"] + health["waiting"] >= 3:  # a loaded machine may miss the exact 1 + 3
                break
            time.sleep(0.01)
        os.kill(engine, signal.SIGKILL)
        for ask in asks:
            ask.join(timeout=60)
        refused = [r for r in answers if r.status_code != 200]
        # three were on the engine at the last look; one may finish between that look and the kill
        assert len(answers) == 4 and len(refused) >= 2, [r.status_code for r in answers]
        for r in refused:
            assert r.status_code == 503, r.text
            assert "the engine is unavailable: replica 0 died (exit code -9)" in r.json()["error"]["message"]
        try:  # until the front has exited, /health says why it cannot serve
            health = httpx.get(s.url + "/health", timeout=10)
            assert health.status_code == 503 and "replica 0 died" in health.json()["error"]["message"]
        except httpx.TransportError:
            pass  # the front has stopped listening: it is on its way out (checked next)
        assert s.proc.wait(timeout=30) != 0
        assert "error: every engine replica has died: replica 0 died (exit code -9)" in s.proc.stdout.read()
    finally:
        s.stop()


def test_a_killed_front_leaves_no_engine_process():
    s = _start()
    try:
        engine = _engine_pid(s)
        os.kill(s.proc.pid, signal.SIGKILL)  # no drain, no shutdown code runs in the front
        s.proc.wait(timeout=30)
        assert _gone(engine, 30), f"engine process {engine} outlived its front end"
    finally:
        s.stop()
