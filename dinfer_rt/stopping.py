"""Where generated text ends: EOS, stop strings (OpenAI's rule: the stop string itself is not
returned) and the text that is safe to stream. Shared by ``LLM.generate`` and the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterable

Decode = Callable[[list[int]], str]


def before_eos(ids: list[int], eos: Iterable[int]) -> list[int]:
    """The ids up to (not including) the first EOS."""
    eos = set(eos)
    return ids[: next((j for j, t in enumerate(ids) if t in eos), len(ids))]


def first_stop(text: str, stop: tuple[str, ...]) -> int:
    """Index of the earliest stop string in ``text``, or -1."""
    return min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)


def cut_at_stop(decode: Decode, ids: list[int], text: str, stop: tuple[str, ...]) -> tuple[int, str]:
    """(tokens kept, text) cut before the first stop string; the tokens kept are those whose text
    lies wholly before it."""
    at = first_stop(text, stop)
    if at < 0:
        return len(ids), text
    keep = 0
    while keep < len(ids) and len(decode(ids[: keep + 1])) <= at:
        keep += 1
    return keep, text[:at]


def streamable(text: str, stop: tuple[str, ...], final: bool) -> str:
    """The part of ``text`` (decoded from final tokens) that can be sent now: never a stop string
    or what follows it, and while the row runs, hold back a trailing U+FFFD (a multi-byte
    character split across tokens) and any tail that could still grow into a stop string."""
    at = first_stop(text, stop)
    if at >= 0:  # the row ends at this step; the stop string itself is never sent
        return text[:at]
    if final:
        return text
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = max((k for s in stop for k in range(1, min(len(s), end + 1)) if text[end - k : end] == s[:k]), default=0)
    return text[: end - hold]
