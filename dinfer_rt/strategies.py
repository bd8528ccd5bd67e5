"""Decision rules: which masked positions of the current block to commit at a step.

Each rule sees the block's logits [B, L, V] (mask token already banned), which slots
are still masked, and how many the linear schedule asks for at this step. It returns
the candidate tokens and a commit mask. Invariants every rule keeps (property-tested):
only masked slots are committed, at least one per row that still has masks, never the
mask token itself.

Editing rules (``EDITING``: LLaDA2.1's ``joint_threshold``) also rewrite slots of the current
block that are already unmasked: their write mask covers masked slots (mask-to-token) and the
``editable`` ones (token-to-token). With them a token is final only when its block finishes, which
the decode state (``decode.Cohort``) tracks; the block's end is the rule's too
(:func:`joint_threshold_block_end`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

NEG = float("-inf")


@dataclass
class StepInput:
    logits: torch.Tensor  # [B, L, V], float
    masked: torch.Tensor  # [B, L] bool
    quota: torch.Tensor  # [B] long: tokens the linear schedule asks for at this step
    temperature: float
    generator: torch.Generator | None
    state: dict = field(default_factory=dict)  # per-block state for stateful rules (credit)
    x0: torch.Tensor | None = None  # with logits=None: argmax and max probability [B, L] from the
    conf: torch.Tensor | None = None  # model's confidence head (greedy rules in STATS_ONLY)
    current: torch.Tensor | None = None  # editing rules: the block's tokens at the start of the step [B, L]
    editable: torch.Tensor | None = None  # editing rules: the slots a token-to-token edit may rewrite [B, L]


def on_logits_device(
    logits: torch.Tensor, masked: torch.Tensor, quota: torch.Tensor, temperature: float, generator, state: dict
) -> StepInput:
    """The rules' input for the logits path: the scheduler keeps ``masked`` / ``quota`` on the
    host while a device backend's logits stay on the device ([B, L, V] is the big one), so the
    small tensors move to the logits and the rule runs there."""
    dev = logits.device
    return StepInput(logits, masked.to(dev), quota.to(dev), temperature, generator, state)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy at T=0; otherwise Gumbel-max in float64 (LLaDA: low precision hurts quality)."""
    if temperature == 0:
        return logits.argmax(-1)
    z = logits.double()
    # drawn on the host generator and moved: the same seed samples the same tokens on every backend
    u = torch.rand(z.shape, dtype=torch.float64, generator=generator).to(z.device).clamp_min(1e-30)
    return (z - temperature * torch.log(-torch.log(u))).argmax(-1)


def linear_schedule(n_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """[B] counts -> [B, steps]: step j commits k // S + (j < k % S) (LLaDA ``get_num_transfer_tokens``)."""
    base = (n_masked // steps)[:, None].expand(-1, steps)
    extra = (torch.arange(steps, device=n_masked.device)[None, :] < (n_masked % steps)[:, None]).long()
    return base + extra


def _top_quota(score: torch.Tensor, masked: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """Commit the ``quota[r]`` best-scoring masked slots of each row (batched, rank-masked top-k)."""
    score = score.masked_fill(~masked, NEG)
    order = score.argsort(dim=-1, descending=True, stable=True)  # ties: the lower slot (as native.c)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(score.shape[-1], device=score.device).expand_as(order)
    )
    q = torch.minimum(quota.clamp_min(1), masked.sum(-1))
    return masked & (rank < q[:, None])


def _confidence(logits: torch.Tensor, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32).softmax(-1)
    return probs.gather(-1, x0[..., None]).squeeze(-1), probs


def candidates(s: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidate tokens, their probability): from the confidence head when the engine used it,
    else sampled from the logits."""
    if s.logits is None:
        return s.x0, s.conf
    x0 = sample(s.logits, s.temperature, s.generator)
    return x0, _confidence(s.logits, x0)[0]


def _at_least_one(commit: torch.Tensor, conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    best = conf.masked_fill(~masked, NEG).argmax(-1, keepdim=True)
    forced = torch.zeros_like(commit).scatter_(-1, best, True) & masked
    return (commit | forced) & masked


def low_confidence(s: StepInput):
    x0, conf = candidates(s)
    return x0, _top_quota(conf, s.masked, s.quota)


def random_remask(s: StepInput):
    x0 = sample(s.logits, s.temperature, s.generator)
    score = torch.rand(s.masked.shape, generator=s.generator).to(s.masked.device)
    return x0, _top_quota(score, s.masked, s.quota)


def maskgit_plus(s: StepInput):
    return low_confidence(s)


def topk_margin(s: StepInput):
    if s.logits is None:  # the confidence head computed the margin
        return s.x0, _top_quota(s.conf, s.masked, s.quota)
    x0 = sample(s.logits, s.temperature, s.generator)
    top2 = s.logits.float().softmax(-1).topk(2, dim=-1).values
    return x0, _top_quota(top2[..., 0] - top2[..., 1], s.masked, s.quota)


def entropy(s: StepInput):
    if s.logits is None:  # the confidence head computed the negative entropy
        return s.x0, _top_quota(s.conf, s.masked, s.quota)
    x0 = sample(s.logits, s.temperature, s.generator)
    logp = s.logits.float().log_softmax(-1)
    neg_entropy = (logp.exp() * logp).nan_to_num(0.0).sum(-1)
    return x0, _top_quota(neg_entropy, s.masked, s.quota)


def threshold_commit(conf: torch.Tensor, masked: torch.Tensor, tau: float) -> torch.Tensor:
    """The masked slots with confidence >= ``tau``, and at least each row's best masked slot."""
    return _at_least_one(masked & (conf >= tau), conf, masked)


def make_threshold(tau: float) -> Callable:
    def threshold(s: StepInput):
        x0, conf = candidates(s)
        return x0, threshold_commit(conf, s.masked, tau)

    return threshold


def make_factor(f: float) -> Callable:
    """Fast-dLLM factor rule: commit the top n with (n + 1) * (1 - c_n) < f, at least one."""

    def factor(s: StepInput):
        x0, conf = candidates(s)
        c = conf.masked_fill(~s.masked, NEG).sort(-1, descending=True).values
        n = torch.arange(1, c.shape[-1] + 1, device=c.device)
        ok = ((n + 1) * (1 - c) < f) & (c > NEG)
        count = ok.long().cumprod(-1).sum(-1)  # the scan stops at the first failure
        return x0, _top_quota(conf, s.masked, count)  # a count of 0 still commits the best slot

    return factor


def make_hierarchical(high: float, low: float) -> Callable:
    """dInfer hierarchical rule, per row: all slots above ``high``; plus, in each maximal run of
    masked slots, its best slot if above ``low``; plus the row's best slot."""

    def hierarchical(s: StepInput):
        x0, conf = candidates(s)
        conf = conf.masked_fill(~s.masked, NEG)
        b, L = s.masked.shape
        start = s.masked & ~torch.nn.functional.pad(s.masked, (1, 0))[:, :L]
        seg = start.long().cumsum(-1) * s.masked  # segment id per masked slot, 0 elsewhere
        seg_max = torch.full((b, L + 1), NEG, dtype=conf.dtype, device=conf.device)  # float64 logits: float64
        seg_max = seg_max.scatter_reduce(1, seg, conf, reduce="amax")
        rep = s.masked & (conf == seg_max.gather(1, seg)) & (conf > low)
        return x0, _at_least_one((conf > high) | rep, conf, s.masked)

    return hierarchical


def make_credit(tau: float, decay: float, boost: float, alpha: float) -> Callable:
    """dInfer credit decoding: accumulate per-slot credit for repeatedly top-ranked tokens and
    threshold-decode on logits + alpha * log(1 + credit)."""

    def credit(s: StepInput):
        c = s.state.get("credit")
        if c is None or c.shape != s.logits.shape:
            c = torch.zeros(s.logits.shape, dtype=torch.float32, device=s.logits.device)
        else:
            c = c * decay
        p1, i1 = s.logits.float().softmax(-1).max(-1)
        c.scatter_add_(-1, i1[..., None], (p1.pow(boost) * s.masked)[..., None])
        s.state["credit"] = c
        fused = s.logits.float() + alpha * torch.log1p(c)
        x0 = sample(fused, s.temperature, s.generator)
        conf, _ = _confidence(fused, x0)
        return x0, _at_least_one(s.masked & (conf >= tau), conf, s.masked)

    return credit


def make_low_confidence_dynamic(tau: float) -> Callable:
    """SDAR's ``low_confidence_dynamic`` (JetAstra/SDAR ``generate.py``): per row, every masked
    slot with confidence > ``tau`` (strictly, as upstream) when at least the step's quota of them
    qualify, else the quota's best masked slots. The quota is the linear schedule's (SDAR: block
    length // steps). A quota of 0 still commits at least the best slot (upstream would commit
    none and waste the forward); greedy is argmax (the sampler, not a division by T=0)."""

    def low_confidence_dynamic(s: StepInput):
        x0, conf = candidates(s)
        above = s.masked & (conf > tau)
        enough = above.sum(-1) >= s.quota.clamp_min(1)
        return x0, torch.where(enough[:, None], above, _top_quota(conf, s.masked, s.quota))

    return low_confidence_dynamic


def penalize_previous(logits: torch.Tensor, current: torch.Tensor, penalty: float) -> torch.Tensor:
    """SGLang's ``penalty_lambda`` for joint_threshold: at every slot but the block's first, the
    logit of the token the slot before holds is lowered by ``penalty`` (discourages a token
    repeating its left neighbour). Returns a new tensor; ``penalty`` 0 returns ``logits``."""
    if penalty == 0 or logits.shape[1] < 2:
        return logits
    out = logits.clone()
    prev = current[:, :-1, None].to(out.device)
    out[:, 1:].scatter_add_(-1, prev, torch.full(prev.shape, -penalty, dtype=out.dtype, device=out.device))
    return out


def make_joint_threshold(tau: float, edit_tau: float, penalty: float) -> Callable:
    """LLaDA2.1's joint threshold (mask-to-token + token-to-token editing), one step, batched
    over rows. From one forward over the block:

    - M2T: the masked slots whose candidate's probability is > ``tau``; a row with masks and none
      above commits its most probable masked slot;
    - T2T: the ``editable`` slots (unmasked at the start of the step, not prompt, the row's block
      not finished) whose candidate differs from the current token with probability >
      ``edit_tau`` (0: every disagreeing slot).

    Both from the same candidates (argmax, or a Gumbel sample with temperature; probability of
    the un-tempered softmax after the ``penalty`` of :func:`penalize_previous`). Returns the
    candidates and the write mask (M2T | T2T); the caller separates them by ``masked``."""

    def joint_threshold(s: StepInput):
        if s.logits is None:
            raise ValueError("joint_threshold needs the block's logits (it has no confidence-head form)")
        if s.current is None:  # called as a plain rule (no block state): mask-to-token only
            if penalty:
                raise ValueError("joint_threshold with penalty_lambda needs the block's current tokens")
            x0 = sample(s.logits, s.temperature, s.generator)
            conf = _confidence(s.logits, x0)[0]
            return x0, _at_least_one(s.masked & (conf > tau), conf, s.masked)
        z = penalize_previous(s.logits, s.current, penalty)
        x0 = sample(z, s.temperature, s.generator)
        conf = _confidence(z, x0)[0]
        m2t = _at_least_one(s.masked & (conf > tau), conf, s.masked)
        if s.editable is None:
            return x0, m2t
        t2t = s.editable & (x0 != s.current.to(x0.device)) & (conf > edit_tau)
        return x0, m2t | t2t

    return joint_threshold


def joint_threshold_block_end(
    has_mask: torch.Tensor, edited: torch.Tensor, post_steps: torch.Tensor, max_post_steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The editing rule's block end, per row, for a step of rows still decoding the block:
    ``has_mask`` [B] (the row's block had a mask at the start of the step), ``edited`` [B]
    (the step rewrote a token), ``post_steps`` [B] (steps so far that started with no mask,
    this one included). Returns (decide: the step's decisions apply, ends: the block is final
    after this step). A step starting with no mask past ``max_post_steps`` such steps decides
    nothing and ends the block (its forward saw the final tokens, so the K/V it wrote are
    theirs); one starting with no mask that edits nothing ends it too (SGLang JointThreshold)."""
    over = ~has_mask & (post_steps > max_post_steps)
    decide = ~over
    ends = over | (~has_mask & ~edited)
    return decide, ends


EDITING = ("joint_threshold",)
"""Rules that rewrite unmasked slots of the current block: a token is final when its block ends."""

PRESETS: dict[str, dict] = {
    # LLaDA2.1 model card (as quoted by third parties; the paper gives no numbers): threshold /
    # edit threshold / max post steps, with block 32 and greedy decoding
    "llada2.1-quality": dict(strategy="joint_threshold", threshold=0.7, edit_threshold=0.5, max_post_steps=16),
    "llada2.1-speed": dict(strategy="joint_threshold", threshold=0.5, edit_threshold=0.0, max_post_steps=16),
}


def preset_fields(name: str) -> dict:
    """The SamplingParams fields a named preset sets (``--preset`` / the body field ``preset``);
    an unknown name is an error listing the known ones."""
    from dinfer_rt.errors import GenerationError

    if not isinstance(name, str) or name not in PRESETS:
        raise GenerationError(f"preset: unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return dict(PRESETS[name])


SCHEDULED = ("low_confidence", "random", "maskgit_plus", "topk_margin", "entropy", "low_confidence_dynamic")
SCORE_KIND = {
    "low_confidence": "max",
    "maskgit_plus": "max",
    "threshold": "max",
    "factor": "max",
    "hierarchical": "max",
    "topk_margin": "margin",
    "entropy": "entropy",
    "low_confidence_dynamic": "max",
}
"""Rules that, when greedy, need only each position's argmax and one score (the confidence head's kind)."""
STATS_ONLY = tuple(SCORE_KIND)

REFRESHED_CACHES = ("adaptive", "anchored", "delayed")
"""Cache policies with a periodic full refresh (``refresh_bound``) and a refresh window (``cache_policy``)."""
KV_CACHES = ("prefix", "dual", "vicinity", *REFRESHED_CACHES)
"""Cache policies that reuse K/V across forwards (every one but ``none``)."""

READ_BY: dict[str, tuple[tuple[str, tuple[str, ...] | None], ...]] = {
    # field: the conditions under which a decode reads it, each (setting, its values that read the
    # field; None: any value but None); a field is read when all of them hold
    "threshold": (("strategy", ("threshold", "hierarchical", "credit", "low_confidence_dynamic", "joint_threshold")),),
    "low_threshold": (("strategy", ("hierarchical",)),),
    "factor": (("strategy", ("factor",)),),
    "steps": (("strategy", SCHEDULED),),  # the linear schedule's quota; the threshold rules run to no mask
    "edit_threshold": (("strategy", EDITING),),
    "max_post_steps": (("strategy", EDITING),),
    "penalty_lambda": (("strategy", EDITING),),
    "credit_decay": (("strategy", ("credit",)),),
    "credit_boost": (("strategy", ("credit",)),),
    "credit_alpha": (("strategy", ("credit",)),),
    "vicinity_before": (("cache", ("vicinity",)),),
    "vicinity_after": (("cache", ("vicinity",)),),
    "vicinity_warmup": (("cache", ("vicinity",)),),
    "refresh_bound": (("cache", REFRESHED_CACHES),),
    "refresh_window": (("cache", REFRESHED_CACHES),),
    "precision_refresh": (("precision_schedule", None), ("cache", KV_CACHES)),
}
"""Which strategy / cache / setting reads each rule-specific SamplingParams field (``build`` binds
the strategies' fields, ``cache_policy`` the caches', ``decode`` ``precision_refresh``). A field
set explicitly that the run does not read would be ignored silently: ``unread`` names it."""


def unread(params, given, request_settable=()) -> list[tuple[str, str, tuple[str, ...] | None]]:
    """For each field named in ``given`` (set explicitly, not by a preset or a default) that
    ``params`` would not read (``READ_BY``), ``(field, setting, values)``: its first condition
    ``params`` does not meet. Conditions on a setting in ``request_settable`` are skipped (a
    server's default for a field a request can make read by setting that setting itself)."""
    out = []
    for name in given:
        for setting, values in READ_BY.get(name, ()):
            if setting in request_settable:
                continue
            value = getattr(params, setting)
            if value is None if values is None else value not in values:
                out.append((name, setting, values))
                break
    return out


def build(params) -> Callable[[StepInput], tuple[torch.Tensor, torch.Tensor]]:
    """The decision rule named by ``params.strategy`` with its parameters bound."""
    name = params.strategy
    if name == "threshold":
        return make_threshold(params.threshold)
    if name == "factor":
        return make_factor(params.factor)
    if name == "hierarchical":
        return make_hierarchical(params.threshold, params.low_threshold)
    if name == "credit":
        return make_credit(params.threshold, params.credit_decay, params.credit_boost, params.credit_alpha)
    if name == "low_confidence_dynamic":
        return make_low_confidence_dynamic(params.threshold)
    if name == "joint_threshold":
        return make_joint_threshold(params.threshold, params.edit_threshold, params.penalty_lambda)
    return {
        "low_confidence": low_confidence,
        "random": random_remask,
        "maskgit_plus": maskgit_plus,
        "topk_margin": topk_margin,
        "entropy": entropy,
    }[name]
