"""Which positions each cache policy computes (``dinfer_rt.cache_policy``), shared by the
batch scheduler and the serving engine."""

import math

import pytest

from dinfer_rt.cache_policy import offset_of, step_window
from dinfer_rt.sampling import SamplingParams


def window(cache, *, s, step, forward, pending=0, n=52, prompt_len=12, block=8, active=(), **kw):
    p = SamplingParams(cache=cache, block_length=block, gen_length=40, **kw)
    return step_window(
        p, s=s, e=min(s + block, n), n=n, prompt_len=prompt_len, step=step, forward=forward, pending=pending,
        active=active,
    )  # fmt: skip


def test_anchored_computes_the_prompt_the_block_and_at_block_start_the_block_just_finished():
    assert window("anchored", s=12, step=0, forward=1) == (((0, 52),), True)  # the first forward fills the cache
    assert window("anchored", s=12, step=3, forward=4) == (((0, 20),), False)  # prompt + block, touching
    assert window("anchored", s=28, step=0, forward=9) == (((0, 12), (20, 36)), False)  # + the block just finished
    assert window("anchored", s=28, step=2, forward=11) == (((0, 12), (28, 36)), False)
    assert window("anchored", s=28, step=2, forward=11, refresh_window=5) == (((0, 12), (23, 36)), False)
    assert window("anchored", s=28, step=0, forward=9, refresh_window=10) == (((0, 12), (18, 36)), False)


def test_anchored_refreshes_only_at_its_bound_and_never_by_default():
    assert SamplingParams(cache="anchored").refresh_limit() == math.inf
    assert SamplingParams(cache="adaptive").refresh_limit() == 16
    assert window("anchored", s=44, step=0, forward=14, pending=1000) == (((0, 12), (36, 52)), False)
    assert window("anchored", s=44, step=0, forward=14, pending=6, refresh_bound=6) == (((0, 52),), True)
    assert window("anchored", s=20, step=1, forward=3, refresh_bound=0) == (((0, 52),), True)  # every step


def test_adaptive_and_the_fixed_policies_keep_their_windows():
    assert window("adaptive", s=28, step=0, forward=9) == (((0, 52),), True)
    assert window("adaptive", s=28, step=1, forward=10) == (((0, 36),), False)
    assert window("adaptive", s=28, step=1, forward=10, refresh_window=4) == (((24, 36),), False)
    assert window("adaptive", s=28, step=1, forward=10, pending=16) == (((0, 52),), True)
    assert window("prefix", s=28, step=1, forward=10) == (((28, 52),), False)
    assert window("dual", s=28, step=1, forward=10) == (((28, 36),), False)
    assert window("vicinity", s=28, step=1, forward=10, vicinity_before=3, vicinity_after=2) == (((25, 38),), False)
    assert window("vicinity", s=28, step=1, forward=2, vicinity_warmup=4) == (((0, 52),), False)
    assert window("none", s=28, step=1, forward=10) == (((0, 52),), False)


def test_block_causal_models_compute_from_the_previous_block_at_block_start():
    p = SamplingParams(cache="anchored", block_length=8, gen_length=40)
    kw = dict(e=24, n=52, prompt_len=12, forward=5, pending=0, block_causal=True)
    assert step_window(p, s=16, step=0, prev_start=8, **kw) == (((8, 24),), False)
    assert step_window(p, s=16, step=0, prev_start=None, **kw) == (((0, 24),), False)
    assert step_window(p, s=16, step=2, prev_start=8, **kw) == (((16, 24),), False)


def test_offset_of_counts_the_positions_before_it_across_spans():
    spans = ((0, 12), (20, 36))
    assert offset_of(spans, 0) == 0 and offset_of(spans, 20) == 12 and offset_of(spans, 28) == 20
    with pytest.raises(ValueError, match="not in the computed spans"):
        offset_of(spans, 15)


def test_delayed_computes_the_prompt_and_the_active_slots_only():
    assert window("delayed", s=12, step=0, forward=1, active=(12, 13)) == (((0, 52),), True)  # fills the cache
    # the prompt, then the masked / just-committed slots 14, 15 and 18 (merged where they touch)
    assert window("delayed", s=12, step=2, forward=3, active=(14, 15, 18)) == (((0, 12), (14, 16), (18, 19)), False)
    assert window("delayed", s=12, step=2, forward=3, active=(12, 13)) == (((0, 14),), False)  # touching the prompt
    # a block's first step: the previous block's last commits (19) are recomputed with its masks
    assert window("delayed", s=20, step=0, forward=5, active=(19, 20, 21, 22)) == (((0, 12), (19, 23)), False)
    assert window("delayed", s=28, step=1, forward=9, active=(30,), refresh_window=3) == (
        ((0, 12), (25, 28), (30, 31)),
        False,
    )
    assert SamplingParams(cache="delayed").refresh_limit() == math.inf
    assert window("delayed", s=28, step=1, forward=9, pending=4, refresh_bound=4, active=(30,)) == (((0, 52),), True)
