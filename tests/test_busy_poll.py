"""``serve --busy-poll`` (``dinfer_rt.idle.BusyPoll``): an idle engine loop polls for work for a
window after its last step instead of sleeping at once. Checked: the window's logic (off at 0,
on after work, bounded by ``at_most``, ended by readiness), bad windows named, and a server
whose loop busy-polls between requests answering as one that sleeps does, and as
``LLM.generate``, the engine process's loop included."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest

from dinfer_rt.errors import DinferError
from dinfer_rt.idle import BusyPoll


def test_a_zero_window_never_spins():
    idle = BusyPoll(0)
    idle.worked()
    assert idle.spin(lambda: True) is False  # not even a poll: the caller sleeps at once
    assert idle.spins == 0


def test_no_spin_before_any_work():
    idle = BusyPoll(math.inf)
    assert idle.spin(lambda: False) is False  # a server that never stepped sleeps
    assert idle.spins == 0


def test_spin_ends_when_ready():
    idle = BusyPoll(math.inf)
    idle.worked()
    calls = {"n": 0}

    def ready() -> bool:
        calls["n"] += 1
        return calls["n"] > 5

    assert idle.spin(ready) is True
    assert idle.spins == 5


def test_spin_ends_with_the_window_and_at_most():
    idle = BusyPoll(0.02)
    idle.worked()
    assert idle.spin(lambda: False) is False  # the window ran out
    assert idle.spins > 0
    before = idle.spins
    assert idle.spin(lambda: False) is False  # and stays out until the next work
    assert idle.spins == before
    always = BusyPoll(math.inf)
    always.worked()
    assert always.spin(lambda: False, at_most=0.01) is False  # a caller's bound (a TP lead's heartbeat)
    assert always.spins > 0


def test_spinning_leaves_the_gil_to_other_threads():
    """A thread spinning here must not keep the GIL (a pure-Python spin keeps it for the switch
    interval on every hand-over): with that interval at 1 s, another thread still gets its 50
    turns well within the 10 s the spin may take (a GIL-keeping spin: about 50 s)."""
    import sys

    interval = sys.getswitchinterval()
    idle = BusyPoll(math.inf)
    idle.worked()
    done = threading.Event()
    turns = {"n": 0}

    def other() -> None:
        while not done.is_set():
            turns["n"] += 1
            time.sleep(0.0005)  # a thread that wakes often, like the HTTP loop on a burst

    sys.setswitchinterval(1.0)
    try:
        t = threading.Thread(target=other)
        t.start()
        found = idle.spin(lambda: turns["n"] >= 50, at_most=10)
    finally:
        done.set()
        sys.setswitchinterval(interval)
    t.join()
    assert found, f"the other thread got {turns['n']} turns in 10 s of spinning"


@pytest.mark.parametrize("window", [-1.0, float("nan"), "2", True])
def test_a_bad_window_is_named(window):
    with pytest.raises(ValueError, match="busy-poll window"):
        BusyPoll(window)


@pytest.mark.parametrize("window, message", [(-1.0, "must be a finite number in"), (float("nan"), "got nan")])
def test_serve_config_names_the_flag(window, message):
    from dinfer_rt.server import ServeConfig

    with pytest.raises(DinferError, match=r"busy_poll \(--busy-poll\)") as e:
        ServeConfig(busy_poll=window).check()
    assert message in str(e.value)
    ServeConfig(busy_poll=math.inf).check()  # always polling, as SGLang does by default
    ServeConfig(busy_poll=2.0).check()


def test_a_busy_polling_server_answers_as_a_sleeping_one():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dinfer_rt.demo import task
    from dinfer_rt.llm import LLM
    from dinfer_rt.sampling import SamplingParams
    from dinfer_rt.server import ServeConfig, build_app

    llm = LLM()
    params = SamplingParams(block_length=8, strategy="threshold")
    items = task.heldout(3)
    want = [o.text for o in llm.generate([it.letters for it in items], params)]
    got = {}
    for window in (0.0, 30.0):
        app = build_app(llm.model, params, ServeConfig(max_num_seqs=4, busy_poll=window))
        texts = []
        with TestClient(app) as client:
            for it in items:  # one after another: each finds the loop idle (polling or asleep)
                r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": it.letters}]})
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["message"]["content"])
        got[window] = (texts, app.state.loop.idle.spins)
    assert got[0.0][0] == want and got[30.0][0] == want
    assert got[0.0][1] == 0  # off by default: never polled
    assert got[30.0][1] > 0  # the later requests were found by polling


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_the_engine_process_loop_busy_polls_then_sleeps():
    """``serve --engine-process --busy-poll 3``: the replica's loop answers as ``LLM.generate``,
    polls its inbox right after a request (CPU while idle) and sleeps once the window has passed
    (next to none). CPU time, not wall time, and a margin of about 50x between the two."""
    from dinfer_rt.demo import task
    from dinfer_rt.llm import LLM
    from dinfer_rt.loader import default_model_path
    from dinfer_rt.sampling import SamplingParams
    from dinfer_rt.workers import ReplicaPool

    params = SamplingParams(block_length=8, strategy="threshold")
    items = task.heldout(2)
    llm = LLM(backend="cpu")
    want = [o.token_ids for o in llm.generate([it.letters for it in items], params)]
    load = {"path": str(default_model_path()), "backend": "cpu"}
    pool = ReplicaPool(1, load, {"max_num_seqs": 4, "block_length": 8}, max_queue=4, timeout=180, busy_poll=3.0)
    try:
        got = []
        for it in items:
            req = pool.submit(llm.encode(it.letters, True), params)
            while not req.done:
                pool.step()
            assert req.error is None
            got.append(req.output_ids)
        assert got == want
        pid = pool.procs[0].pid
        c0 = _cpu_s(pid)
        time.sleep(1.0)  # inside the window: polling
        polling = _cpu_s(pid) - c0
        time.sleep(3.0)  # past it: asleep
        c1 = _cpu_s(pid)
        time.sleep(1.0)
        sleeping = _cpu_s(pid) - c1
        assert polling > 0.03 and polling > 2 * sleeping, (polling, sleeping)
    finally:
        pool.close()
        pool.shutdown()
