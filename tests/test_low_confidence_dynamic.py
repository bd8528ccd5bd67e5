"""SDAR's decoding rule ``low_confidence_dynamic``: the invariants every rule keeps (only masked
slots committed, at least one per row with masks, never the mask token), its own semantics (all
slots above the threshold when at least the quota qualify, else the quota's best) checked
against SDAR's per-row loop written plainly, and the confidence head's path equal to the logits'."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dinfer_rt import strategies
from dinfer_rt.sampling import STRATEGIES, SamplingParams

MASK, VOCAB = 3, 9


def _rule(threshold: float, temperature: float = 0.0):
    params = SamplingParams(strategy="low_confidence_dynamic", threshold=threshold, temperature=temperature)
    return strategies.build(params.validate())


def _random_step(seed: int, batch: int, length: int, quota_max: int):
    """Logits with the mask token banned (as the scheduler does), a random masked set (some rows
    fully decoded) and a random quota per row (0 and more than the masked count included)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, VOCAB, generator=g) * 3
    logits[..., MASK] = float("-inf")
    masked = torch.rand(batch, length, generator=g) < 0.7
    masked[0] = torch.rand(length, generator=g) < 0.2 if batch > 1 else masked[0]
    quota = torch.randint(0, quota_max + 1, (batch,), generator=g)
    return logits, masked, quota, g


def sdar_reference(logits, masked, quota, tau):
    """JetAstra/SDAR ``generate.py``'s ``low_confidence_dynamic`` for one step, per row, greedy;
    the top-quota branch takes at most the masked slots (upstream's top-k would also pick
    unmasked -inf slots and overwrite them), and a quota of 0 commits the best slot."""
    probs = logits.double().softmax(-1)
    conf, x0 = probs.max(-1)
    conf = torch.where(masked, conf, torch.tensor(float("-inf"), dtype=conf.dtype))
    commit = torch.zeros_like(masked)
    for r in range(masked.shape[0]):
        if not masked[r].any():
            continue
        q = max(int(quota[r]), 1)
        high = conf[r] > tau
        if int(high.sum()) >= q:
            commit[r] = high
        else:
            idx = conf[r].topk(min(q, int(masked[r].sum()))).indices
            commit[r, idx] = True
    return x0, commit


def test_the_rule_is_registered_as_a_scheduled_greedy_max_confidence_rule():
    assert "low_confidence_dynamic" in STRATEGIES
    assert "low_confidence_dynamic" in strategies.SCHEDULED  # its quota is the linear schedule's
    assert strategies.SCORE_KIND["low_confidence_dynamic"] == "max"  # the confidence head can serve it


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 4),
    length=st.integers(1, 12),
    quota_max=st.integers(0, 14),
    tau=st.sampled_from([0.05, 0.3, 0.6, 0.9, 1.0]),
    temperature=st.sampled_from([0.0, 1.0]),
)
def test_invariants_over_random_logits(seed, batch, length, quota_max, tau, temperature):
    """Only masked slots, at least one per row with masks, never the mask token: at every
    threshold, quota (0 and beyond the masked count included) and temperature."""
    logits, masked, quota, g = _random_step(seed, batch, length, quota_max)
    x0, commit = _rule(tau, temperature)(strategies.StepInput(logits, masked, quota, temperature, g, {}))
    assert commit.dtype == torch.bool and commit.shape == masked.shape == x0.shape
    assert not (commit & ~masked).any()
    assert ((commit.sum(-1) >= 1) | ~masked.any(-1)).all()
    assert not (x0[commit] == MASK).any()


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 4),
    length=st.integers(1, 12),
    quota_max=st.integers(0, 14),
    tau=st.sampled_from([0.05, 0.3, 0.6, 0.9]),
)
def test_greedy_equals_sdar_per_row_loop(seed, batch, length, quota_max, tau):
    """Greedy commits equal SDAR's loop: argmax tokens; every slot above the threshold when at
    least the quota qualify, else the quota's most confident masked slots."""
    logits, masked, quota, g = _random_step(seed, batch, length, quota_max)
    x0, commit = _rule(tau)(strategies.StepInput(logits, masked, quota, 0.0, g, {}))
    want_x0, want = sdar_reference(logits, masked, quota, tau)
    assert torch.equal(x0, want_x0)
    assert torch.equal(commit, want)


def test_both_branches_on_a_hand_made_block():
    """Row 0: three slots above 0.9 and a quota of 2: all three go. Row 1: one slot above 0.9 and
    a quota of 2: the two best go, one of them below the threshold. Row 2: nothing masked."""
    conf_rows = [[0.95, 0.97, 0.3, 0.99], [0.95, 0.6, 0.7, 0.55], [0.99, 0.99, 0.99, 0.99]]
    logits = torch.full((3, 4, VOCAB), -30.0)
    for r, row in enumerate(conf_rows):
        for j, p in enumerate(row):  # token 1 gets probability p, token 2 the rest (the max: max(p, 1 - p))
            logits[r, j, 1], logits[r, j, 2] = torch.tensor(p).log(), torch.tensor(1 - p).log()
    logits[..., MASK] = float("-inf")
    masked = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    x0, commit = _rule(0.9)(strategies.StepInput(logits, masked, torch.tensor([2, 2, 2]), 0.0, None, {}))
    assert commit.tolist() == [[True, True, False, True], [True, False, True, False], [False] * 4]
    assert x0[0].tolist() == [1, 1, 2, 1]  # argmax: slot 2's token 2 has 0.7
    # the threshold is strict, as upstream: a slot exactly at it does not count
    exact = torch.tensor([[0.9, 0.2]]).log().expand(1, 2, 2)
    at = torch.cat((exact.transpose(1, 2), torch.full((1, 2, VOCAB - 2), -30.0)), -1)
    at[..., MASK] = float("-inf")
    _, c = _rule(0.9)(strategies.StepInput(at, torch.ones(1, 2, dtype=torch.bool), torch.tensor([1]), 0.0, None, {}))
    assert c.sum() == 1  # fell back to the top-1, not "every slot >= 0.9"


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), length=st.integers(1, 16), steps=st.integers(1, 16), tau=st.floats(0.05, 1.0))
def test_a_block_finishes_within_its_scheduled_steps(seed, length, steps, tau):
    """Each step commits at least its quota, so the linear schedule's block (SDAR: B // steps per
    step) is done after at most ``steps`` forwards, and committed slots never change."""
    g = torch.Generator().manual_seed(seed)
    x = torch.full((2, length), MASK)
    plan = strategies.linear_schedule((x == MASK).sum(-1), steps)
    rule = _rule(tau)
    for step in range(steps):
        masked = x == MASK
        if not masked.any():
            break
        logits = torch.randn(2, length, VOCAB, generator=g) * 2
        logits[..., MASK] = float("-inf")
        x0, commit = rule(strategies.StepInput(logits, masked, plan[:, step], 0.0, g, {}))
        assert (commit.sum(-1) >= torch.minimum(plan[:, step].clamp_min(1), masked.sum(-1))).all()
        before = x.clone()
        x = torch.where(commit, x0, x)
        assert torch.equal(x[~masked], before[~masked])
    assert not (x == MASK).any()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 3), length=st.integers(1, 10), quota_max=st.integers(0, 6))
def test_confidence_head_path_equals_the_logits_path(seed, batch, length, quota_max):
    """Served by the fused confidence head (argmax and max probability, mask token banned) the
    rule commits what it commits from the logits."""
    logits, masked, quota, g = _random_step(seed, batch, length, quota_max)
    rule = _rule(0.6)
    x0, commit = rule(strategies.StepInput(logits, masked, quota, 0.0, g, {}))
    conf, tok = logits.softmax(-1).max(-1)
    hx0, hcommit = rule(strategies.StepInput(None, masked, quota, 0.0, g, {}, x0=tok, conf=conf))
    assert torch.equal(hx0, x0) and torch.equal(hcommit, commit)
