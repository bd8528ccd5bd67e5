"""How an idle engine loop waits for work: at once asleep, or busy-polling for a while first.

Why: on a (virtual) machine whose cores sleep when idle, the first forwards after an idle gap
run slower; a lone offline request measured 10-30% slower after a 0.8 s gap than back to back
on the 2-core CI host (``benchmarks/results/serve_busy_poll.md``), and a request at low load
always follows a gap. A loop that keeps polling for ``window_s`` seconds after its last work
keeps its core awake for the next request, at the price of that core's idle time, which is
SGLang's default (its ``--sleep-on-idle`` turns it off). Here it is opt-in: ``serve
--busy-poll SECONDS``; 0 sleeps at once, ``inf`` always spins.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class BusyPoll:
    """Spins (releasing the GIL every turn) while less than ``window_s`` seconds have passed
    since :meth:`worked` was last called; the caller then blocks as it always does."""

    def __init__(self, window_s: float = 0.0) -> None:
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or math.isnan(window_s):
            raise ValueError(f"busy-poll window must be a number of seconds, got {window_s!r}")
        if window_s < 0:
            raise ValueError(f"busy-poll window must be >= 0 seconds, got {window_s!r}")
        self.window_s = float(window_s)
        self.last_work = -math.inf
        self.spins = 0  # turns spun in all (tests and benchmarks read it)

    def worked(self) -> None:
        """The loop just did work: the window starts again."""
        if self.window_s:
            self.last_work = time.perf_counter()

    def spin(self, ready: Callable[[], bool], at_most: float = math.inf) -> bool:
        """Poll ``ready`` until it is true (returns True), the window since the last work ends,
        or ``at_most`` seconds pass (returns False: the caller blocks on its own wait).

        Each turn is ``time.sleep(0)``, which drops the GIL: an HTTP thread in the same process
        gets it within microseconds, where a pure-Python spin would keep it for the 5 ms switch
        interval on every hand-over."""
        if not self.window_s:
            return False
        now = time.perf_counter()
        end = min(self.last_work + self.window_s, now + at_most)
        while now < end:
            if ready():
                return True
            time.sleep(0)
            self.spins += 1
            now = time.perf_counter()
        return False
