"""Which positions a decoding step computes under each KV-cache policy.

One function serves the batch scheduler (``generate.py``) and the serving engine
(``engine.py``), so a request decodes the same whichever runs it. A step computes the
positions it returns (their K/V are written into the cache in place) and reads every other
position's K/V from the cache; returning every position is a full refresh.

Policies on a bidirectional model (``docs/decoding.md`` has the measurements):
  none      every position, every step
  prefix    block start: every position; then [s, N)
  dual      block start: every position; then [s, e)
  vicinity  like dual, with [s - before, e + after) after the first ``vicinity_warmup``
            forwards (full ones)
  adaptive  block start: every position; then [0, e) (or the ``refresh_window`` positions
            before the block); the masked suffix is what is cached
  anchored  the request's first forward: every position; then the prompt, the block and the
            ``refresh_window`` positions before it (default 0), and at a block's first step
            also the block just finished (its last commits were never computed); the generated
            prefix before that and the masked suffix are cached
  delayed   dKV-Cache's one-step delay: the request's first forward: every position; then
            the prompt, the ``refresh_window`` positions before the block (default 0), the
            block's slots still masked in some row and the slots the previous step committed
            (their K/V, computed while they were masked, are recomputed once from their tokens,
            then cached); committed slots, the generated prefix and the masked suffix are
            cached. Where the decisions run on an accelerator without a host sync, the whole
            block is computed (as ``anchored``), since which slots are masked lives there.
``adaptive``, ``anchored`` and ``delayed`` also refresh every position once a row has committed
``refresh_bound`` tokens since the last refresh (0: every step, i.e. no-cache decoding; by
default 16 for adaptive and never for anchored and delayed, whose masked suffix then keeps the
K/V of the first forward: measured harmless on the embedded task, where the block start's full
refresh is most of adaptive's cost).

Block-causal models (LLaDA2) never let earlier blocks see later ones, so every cached policy
computes [previous block start, e) at a block's first step and [s, e) after it: exact.
"""

from __future__ import annotations

from dinfer_rt.sampling import SamplingParams

Spans = tuple[tuple[int, int], ...]
"""Sorted, disjoint, non-empty [lo, hi) ranges of positions."""


def _merge(ranges: list[tuple[int, int]]) -> Spans:
    out: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def step_window(
    p: SamplingParams,
    *,
    s: int,
    e: int,
    n: int,
    prompt_len: int,
    step: int,
    forward: int,
    pending: int,
    block_causal: bool = False,
    prev_start: int | None = None,
    active: tuple[int, ...] = (),
) -> tuple[Spans, bool]:
    """The spans one step of block [s, e) computes, and whether the commits counted since the
    last refresh restart (a full refresh, or a block start under ``adaptive``).

    ``forward``: this request's forwards so far, this one included (1: its first); ``pending``:
    the most tokens any of its rows committed since the last refresh; ``prev_start``: for a
    block-causal model, the previous block's start (None before the first block); ``active``
    (``delayed`` only): the positions whose K/V this step must compute besides the prompt, i.e.
    the block's slots still masked in some row and the slots committed by the previous step."""
    full: Spans = ((0, n),)
    cache = p.cache
    if cache == "none" or (cache == "vicinity" and forward <= p.vicinity_warmup):
        return full, False
    if block_causal:
        if step == 0:
            return ((0 if prev_start is None else prev_start, e),), False
        return ((s, e),), False
    if cache == "anchored":
        if forward == 1 or pending >= p.refresh_limit():
            return full, True
        before = max(0, s - (p.refresh_window or 0))
        if step == 0:
            before = min(before, max(0, s - p.block_length))
        return _merge([(0, prompt_len), (before, e)]), False
    if cache == "delayed":
        if forward == 1 or pending >= p.refresh_limit():
            return full, True
        before = max(0, s - (p.refresh_window or 0))
        return _merge([(0, prompt_len), (before, s)] + [(q, q + 1) for q in active]), False
    if step == 0:
        return full, True
    if cache == "adaptive":
        if pending >= p.refresh_limit():
            return full, True
        return ((0 if p.refresh_window is None else max(0, s - p.refresh_window), e),), False
    if cache == "prefix":
        return ((s, n),), False
    if cache == "dual":
        return ((s, e),), False
    return ((max(0, s - p.vicinity_before), min(n, e + p.vicinity_after)),), False


def offset_of(spans: Spans, position: int) -> int:
    """Index of ``position`` in the concatenated spans (it must lie in one of them)."""
    before = 0
    for lo, hi in spans:
        if position < hi:
            if position < lo:
                break
            return before + position - lo
        before += hi - lo
    raise ValueError(f"position {position} is not in the computed spans {spans}")
