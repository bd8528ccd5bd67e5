"""A tensor-parallel replica's ranks leave promptly when their front end is gone (#37 point 4):
the front end and the lead rank are killed while the group is still starting (the follower then
waits in the rendezvous, where no collective error would ever reach it), and the follower must
exit within a bound far below the group's 600 s timeout, checked by its pid. One launch: a front
end process starting ``ReplicaPool(1, tp_size=2)`` on the embedded model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dinfer_rt.loader import EMBEDDED_MODEL

BOUND_S = 45.0  # the follower's imports under a loaded 2-core CI machine, plus the watch's poll
FRONT_END = f"""
from dinfer_rt.workers import ReplicaPool
ReplicaPool(1, {{"path": {str(EMBEDDED_MODEL)!r}, "backend": "cpu"}}, {{}}, max_queue=4, tp_size=2)
"""


def _children(pid: int) -> list[int]:
    """``pid``'s spawned children (multiprocessing's ``spawn_main``), oldest first."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            found.append((int(fields[19]), int(entry.name)))  # starttime (field 22), pid
    return [p for _, p in sorted(found)]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_the_follower_exits_when_the_front_end_and_the_lead_die_during_start():
    front = subprocess.Popen([sys.executable, "-c", FRONT_END], stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline and front.poll() is None:
            ranks = _children(front.pid)
            time.sleep(0.02)
        assert len(ranks) == 2, f"the front end did not start two ranks: {ranks}, exit {front.poll()}"
        lead, follower = ranks  # started in rank order
        front.kill()
        front.wait()
        os.kill(lead, signal.SIGKILL)
        killed = time.monotonic()
        while _alive(follower) and time.monotonic() - killed < BOUND_S:
            time.sleep(0.1)
        took = time.monotonic() - killed
        assert not _alive(follower), f"follower rank (pid {follower}) still alive {took:.0f} s after its lead died"
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if front.poll() is None:
            front.kill()
            front.wait()


HANG_TIMEOUT_S = 15  # the group's collective timeout here: above the ranks' compile skew on a loaded 2-core machine


def test_a_hung_follower_ends_its_replica_after_the_collective_timeout_naming_it():
    """A follower rank that hangs (SIGSTOP: alive, never answering) while the replica serves: the
    lead's collective fails after ``collective_timeout`` (``serve --distributed-timeout``), not the
    600 s default, so the request fails naming the replica and the timeout, the replica is marked
    dead and its ranks are killed, the stopped one included. In-process front end, one TP-2 replica."""
    from dinfer_rt.sampling import SamplingParams
    from dinfer_rt.workers import LOST_PEER_EXIT_CODE, ReplicaPool

    load = {"path": str(EMBEDDED_MODEL), "backend": "cpu"}
    pool = ReplicaPool(1, load, {}, max_queue=4, tp_size=2, collective_timeout=HANG_TIMEOUT_S, timeout=180)
    params = SamplingParams(strategy="threshold", block_length=8, gen_length=16)
    lead, follower = pool.rank_pids[0]
    try:

        def serve(prompt: list[int], bound: float):
            req = pool.submit(prompt, params)
            deadline = time.monotonic() + bound
            while not req.done and time.monotonic() < deadline:
                pool.step()
            assert req.done, f"no answer within {bound:.0f} s"
            return req

        ok = serve([5, 6, 7, 8], 120)  # both ranks have compiled the shapes: no skew left
        assert ok.finish_reason in ("stop", "length") and ok.error is None
        os.kill(follower, signal.SIGSTOP)
        hung = time.monotonic()
        failed = serve([5, 6, 7, 9], HANG_TIMEOUT_S + 60)
        took = time.monotonic() - hung
        assert failed.finish_reason == "error", failed.finish_reason
        message = str(failed.error)  # the lead's own words, or the front end's when it saw the lead exit first
        assert "tensor-parallel group broke" in message, message
        assert f"{HANG_TIMEOUT_S} s" in message and "--distributed-timeout" in message, message
        assert took >= HANG_TIMEOUT_S - 1, f"failed after {took:.1f} s: before the timeout, not from it"
        deadline = time.monotonic() + 10
        while pool.alive != [False] and time.monotonic() < deadline:
            pool.step()
        assert pool.alive == [False] and pool.procs[0].exitcode == LOST_PEER_EXIT_CODE
        why = f"replica 0: its tensor-parallel group broke (one of ranks 1..1 died or hung past the {HANG_TIMEOUT_S} s"
        assert why in pool.death_reason(), pool.death_reason()
        deadline = time.monotonic() + 10
        while _alive(follower) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(follower) and not _alive(lead)  # the stopped rank was killed, not left behind
    finally:
        for pid in (lead, follower):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        pool.close()
        pool.shutdown()
