"""The engine processes' channel to the front (``dinfer_rt/channel.py``): a turn's events travel
in one pipe write, final ids and log-probabilities as deltas, and the front's mirror of a request
ends equal to the engine's own request after every turn (a real engine decoding, streamed and
with logprobs); a closed end on either side is reported, never a hang or a traceback."""

from __future__ import annotations

import multiprocessing

import pytest

import dinfer_rt
from dinfer_rt.channel import EventReceiver, EventSender, apply_event
from dinfer_rt.engine import Engine, Request
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing import checkpoints

MIRRORED = ("final_ids", "logprobs", "top_logprobs", "provisional_ids", "edits", "post_steps", "cached_tokens")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return dinfer_rt.load_model(checkpoints.sdar(tmp_path_factory.mktemp("sdar")), backend="cpu")


def _pipe():
    reader, writer = multiprocessing.Pipe(duplex=False)
    return EventReceiver({0: reader}), writer


def _mirror(req: Request) -> Request:
    return Request(req.id, list(req.prompt), req.params, req.max_tokens)


@pytest.mark.parametrize("logprobs", [None, 2])
def test_mirror_follows_a_real_engine_turn_by_turn_with_one_write_per_turn(model, logprobs):
    receiver, writer = _pipe()
    sender = EventSender(writer, 0, extra=lambda: {"prefix_cache": None})
    engine = Engine(model, max_num_seqs=4, block_length=4)
    params = SamplingParams(gen_length=16, block_length=4, strategy="threshold", threshold=0.5, logprobs=logprobs)
    reqs = [engine.submit([7 + i, 20, 9, 30 + i], params, listener=sender.listener) for i in range(3)]
    mirrors = {r.id: _mirror(r) for r in reqs}
    turns = sent_ids = 0
    while engine.has_work():
        engine.step()
        report = {"steps": engine.stats.steps}
        assert sender.flush(report)
        turns += 1
        (msg,) = receiver.receive(timeout=5)  # the whole turn: one message
        index, events, got = msg
        assert index == 0 and got == report
        for rid, event, payload in events:
            start, ids = payload["final"]
            sent_ids += len(ids)
            assert start == len(mirrors[rid].final_ids)  # only what the front does not have yet
            apply_event(mirrors[rid], payload)
            if event == "finish":
                assert payload["reason"] == engine_req(reqs, rid).finish_reason and "prefix_cache" in payload
        for r in reqs:  # after every turn the mirror knows what the engine's request knows
            for name in MIRRORED:
                assert getattr(mirrors[r.id], name) == getattr(r, name), name
    assert sender.messages == turns
    assert sent_ids == sum(len(r.final_ids) for r in reqs)  # each final id crossed the pipe once
    assert all(r.status == "finished" and r.final_ids for r in reqs)
    if logprobs:
        assert all(len(r.logprobs) == len(r.final_ids) for r in reqs)


def engine_req(reqs: list[Request], rid: str) -> Request:
    return next(r for r in reqs if r.id == rid)


def test_a_refused_submit_and_an_empty_turn():
    receiver, writer = _pipe()
    sender = EventSender(writer, 3)
    assert sender.flush() and sender.messages == 0  # nothing to say: nothing written
    sender.refuse("req-9", "GenerationError: too long")
    assert sender.flush()
    ((index, events, report),) = receiver.receive(timeout=5)
    assert (index, report) == (3, None)
    assert events == [("req-9", "finish", {"final": (0, []), "reason": "error", "error": "GenerationError: too long"})]


def test_a_shorter_final_list_is_resent_whole():
    """Final ids never shrink; if they ever did, the mirror must not keep stale ids."""
    receiver, writer = _pipe()
    sender = EventSender(writer, 0)
    req = Request("r", [1], SamplingParams(), 8)
    mirror = _mirror(req)
    for final in ([4, 5, 6], [4, 5, 6, 7], [9]):
        req.final_ids = final
        sender.listener(req, "update")
        sender.flush()
        for _, events, _ in receiver.receive(timeout=5):
            for _, _, payload in events:
                apply_event(mirror, payload)
        assert mirror.final_ids == final


def test_closed_ends_are_reported_not_raised():
    receiver, writer = _pipe()
    sender = EventSender(writer, 0)
    receiver.close()  # the front is gone or shutting down
    sender.events.append(("r", "update", {"final": (0, [1])}))
    assert sender.flush() is False
    receiver, writer = _pipe()
    writer.close()  # the engine process exited: end of file
    assert receiver.receive(timeout=1) == [] and receiver.conns == {}
    assert receiver.receive(timeout=0.01) == []  # nothing left to wait on: no error
