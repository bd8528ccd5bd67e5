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
