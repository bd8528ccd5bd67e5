"""The engine processes' channel to the HTTP front: one pipe per engine process, written by the
engine's own thread, one message per loop turn (a step's events and its report together).

Why not a ``multiprocessing.Queue`` for this direction: its ``put`` hands every message to a
feeder thread that pickles and writes it, and in an engine process that thread takes the
interpreter from the engine's next step, once per event and once per step report (a streamed
request has an event at most steps). Here the engine thread writes a turn's messages itself,
in one pipe write, and the front waits on every engine's pipe at once
(:meth:`EventReceiver.receive`). Commands travel the other way on a queue still: the front must
never block on a busy engine's full pipe (a long prompt's submit during a long step), and the
front's feeder thread competes with no engine.

A request's final ids only grow (they can no longer change), so each event carries the ids after
the ones already sent, not the whole answer so far (:class:`EventSender` keeps what it sent;
:func:`apply_event` extends the front's mirror); log-probabilities likewise.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import time
from collections.abc import Callable

from dinfer_rt.engine import Request


class EventSender:
    """An engine process's end: :meth:`listener` is every request's listener (it encodes the
    event); :meth:`flush` sends what the turn collected as one message. ``extra``: per finish,
    what else the front should know at that moment (the prefix cache's counters)."""

    def __init__(self, conn: mpc.Connection | None, index: int, extra: Callable[[], dict] | None = None) -> None:
        self.conn, self.index, self.extra = conn, index, extra
        self.events: list[tuple[str, str, dict]] = []
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (final ids, log-probabilities) sent
        self.messages = 0  # pipe writes made (tests, benchmarks)

    def listener(self, req: Request, event: str) -> None:
        n_final, n_lp = self._sent.get(req.id, (0, 0))
        start = n_final if n_final <= len(req.final_ids) else 0  # never shorter; if so, resend whole
        msg: dict = {"final": (start, req.final_ids[start:])}
        if req.canvas is not None:
            msg["canvas"] = list(req.canvas)
        if req.provisional_ids or req.stream_provisional:
            msg["provisional"] = list(req.provisional_ids)
        if req.params.logprobs is not None:  # aligned with final_ids, sent from where the last event ended
            lo = n_lp if n_lp <= len(req.logprobs) else 0
            msg["logprobs"] = (lo, req.logprobs[lo:], req.top_logprobs[lo:])
            n_lp = len(req.logprobs)
        if req.edits or req.post_steps:
            msg.update(edits=req.edits, post_steps=req.post_steps)
        if req.cached_tokens:  # known from admission on (usage.prompt_tokens_details)
            msg["cached_tokens"] = req.cached_tokens
        if event == "finish":
            err = None if req.error is None else f"{type(req.error).__name__}: {req.error}"
            msg.update(reason=req.finish_reason, error=err, output_ids=req.output_ids, text=req.text)
            msg["forwards"] = req.forwards
            if self.extra is not None:
                msg.update(self.extra())
            self._sent.pop(req.id, None)
        else:
            self._sent[req.id] = (len(req.final_ids), n_lp)
        self.events.append((req.id, event, msg))

    def refuse(self, request_id: str, error: str) -> None:
        """A submit the engine refused: its finish, with the reason."""
        self.events.append((request_id, "finish", {"final": (0, []), "reason": "error", "error": error}))

    def flush(self, report: dict | None = None) -> bool:
        """Send the turn's events and ``report`` (the step's counters) in one write; False when the
        front's end is closed (it is gone or shutting down: nobody reads any more)."""
        if not self.events and report is None:
            return True
        events, self.events = self.events, []
        if self.conn is None:
            return True
        try:
            self.conn.send((self.index, events, report))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            return False
        self.messages += 1
        return True


def apply_event(req: Request, msg: dict) -> None:
    """Bring the front's mirror of a request up to an engine event (:meth:`EventSender.listener`)."""
    start, ids = msg["final"]
    del req.final_ids[start:]
    req.final_ids.extend(ids)
    req.canvas = msg.get("canvas")
    req.provisional_ids = msg.get("provisional", [])
    if "logprobs" in msg:
        lo, lps, tops = msg["logprobs"]
        del req.logprobs[lo:], req.top_logprobs[lo:]
        req.logprobs.extend(lps)
        req.top_logprobs.extend(tops)
    req.edits, req.post_steps = msg.get("edits", 0), msg.get("post_steps", 0)
    req.cached_tokens = msg.get("cached_tokens", req.cached_tokens)


class EventReceiver:
    """The front's end: every engine process's pipe, by replica index."""

    def __init__(self, conns: dict[int, mpc.Connection]) -> None:
        self.conns = dict(conns)

    def receive(self, timeout: float) -> list[tuple[int, list, dict | None]]:
        """The messages waiting on any pipe (waiting up to ``timeout`` s for the first). A pipe
        whose engine process is gone (end of file) is dropped: its death is found by its exit
        code, which names it."""
        if not self.conns:  # every engine process is gone: its exit code names it; no busy loop meanwhile
            time.sleep(timeout)
            return []
        out = []
        for conn in mpc.wait(list(self.conns.values()), timeout):
            try:
                while conn.poll(0):
                    out.append(conn.recv())
            except (EOFError, OSError):
                self._drop(conn)
        return out

    def _drop(self, conn: mpc.Connection) -> None:
        self.conns = {i: c for i, c in self.conns.items() if c is not conn}
        conn.close()

    def close(self) -> None:
        """Close every pipe: an engine process still writing then finds it closed and stops."""
        for conn in self.conns.values():
            conn.close()
        self.conns = {}
