"""``validate``'s checks of the editing rule (``joint_threshold``, LLaDA2.1) on a backend.

The rule runs inside the one decode state machine (``decode.Cohort``): through the backend's
edit kernel where it has one (cuda, rocm_dcu, ascend), else in torch where its logits live. Two checks, each
against an oracle written here independently of ``strategies`` / ``decode`` (float64, one row
and one slot at a time, the reference algorithm as SGLang's JointThreshold and the LLaDA2.1
report state it):

- **probes**: crafted logits whose probabilities sit exactly on the thresholds (p = 1 with
  threshold / edit threshold 1, p = 1 at prompt slots with edit threshold 0), fed to the
  backend's state machine on its device: every write must equal the oracle's, no tolerance
  (``>=`` for ``>``, or an editable prompt slot, fails here);
- **lock-step decisions** from the model's own logits: per step the oracle decides on the
  float64 reference model's logits, the backend's state machine on its own; a disagreement
  (commit, edit, token or block end) is allowed only at a near tie (a probability within the
  margin of the threshold or edit threshold, or two candidates within it); both then go on from
  the oracle's state.
"""

from __future__ import annotations

import math

import torch

from dinfer_rt.decode import Cohort
from dinfer_rt.model import Model
from dinfer_rt.sampling import SamplingParams

RULE = "joint_threshold"


def oracle_step(block: list[int], logits: torch.Tensor, prompt: list[bool], post: int, p: SamplingParams, mask: int):
    """One reference step for one row's block (float64): (new block, committed slots, edited
    slots, post steps, finished, probabilities of the candidates, top-2 margins)."""
    z = logits.double().clone()
    z[:, mask] = -math.inf
    n = len(block)
    if p.penalty_lambda > 0:
        for i in range(1, n):
            z[i, block[i - 1]] -= p.penalty_lambda
    probs = z.softmax(-1)
    top2 = probs.topk(2, dim=-1)
    x0 = [int(t) for t in top2.indices[:, 0]]
    prob = [float(v) for v in top2.values[:, 0]]
    margin = [float(a - b) for a, b in top2.values.tolist()]
    has_mask = any(t == mask for t in block)
    commit: set[int] = set()
    if has_mask:
        commit = {i for i in range(n) if block[i] == mask and prob[i] > p.threshold}
        if not commit:
            masked = [i for i in range(n) if block[i] == mask]
            commit = {max(masked, key=lambda i: (prob[i], -i))}
    else:
        post += 1
        if post > p.max_post_steps:
            return list(block), set(), set(), post, True, prob, margin
    editable = [block[i] != mask and not prompt[i] for i in range(n)]
    edit = {i for i in range(n) if editable[i] and x0[i] != block[i] and prob[i] > p.edit_threshold}
    if not commit and not edit:
        return list(block), set(), set(), post, True, prob, margin
    new = [x0[i] if i in commit or i in edit else block[i] for i in range(n)]
    return new, commit, edit, post, False, prob, margin


def _near(i: int, block, prob, test_prob, margin, p: SamplingParams, mask: int, eps: float) -> bool:
    """Whether slot ``i``'s decision could flip with rounding: a probability (either side) within
    ``eps`` of the threshold or edit threshold, two candidates within it, or (a masked slot)
    the row's two best masked slots within it (the forced commit)."""
    on_edge = any(abs(a - c) < eps for a in (prob[i], test_prob[i]) for c in (p.threshold, p.edit_threshold))
    best = sorted((prob[j] for j in range(len(block)) if block[j] == mask), reverse=True)
    forced_tie = block[i] == mask and len(best) > 1 and best[0] - best[1] < eps
    return on_edge or margin[i] < eps or forced_tie


def _block_size(model: Model, params: SamplingParams) -> int | None:
    return params.block_length if model.spec.block_causal else None


def probes(test: Model) -> dict:
    """Crafted steps on ``test``'s state machine (its logits on its device) against the oracle."""
    mask, v = test.mask_id, test.spec.vocab
    tokens = [t for t in range(6, v) if t != mask][:4]
    lb = 4
    prompt = [tokens[0]] * (6 if test.spec.block_causal else 3)  # block-causal: the first block holds 2 prompt slots
    cases = []
    for tau, edit_tau in ((1.0, 1.0), (1.0, 0.0), (0.5, 1.0)):
        params = SamplingParams(
            strategy=RULE, gen_length=8, block_length=lb, threshold=tau, edit_threshold=edit_tau, max_post_steps=2,
            early_stop=False,
        )  # fmt: skip
        cohort = Cohort(test, [prompt], params)
        state = {"final": False, "post": 0}
        violations = []
        step = 0
        while cohort.prepare() and step < 20:
            s, e = cohort.s, cohort.e
            if step == 0 or s != state.get("s"):
                state = {"final": False, "post": 0, "s": s, "prompt": [t != mask for t in cohort.x[0, s:e].tolist()]}
            logits = torch.full((1, e - s, v), -math.inf)
            for i in range(e - s):  # p = 1 exactly: a token other than the one the slot holds
                cur = int(cohort.x[0, s + i])
                logits[0, i, tokens[(tokens.index(cur) + 1) % 4] if cur in tokens else tokens[(i + step) % 4]] = 0.0
            block = cohort.x[0, s:e].tolist()
            want = oracle_step(block, logits[0], state["prompt"], state["post"], params, mask)
            state["post"], state["final"] = want[3], want[4]
            cohort.last_forward = step
            cohort.decide(logits.to(test.backend.device()))
            got = cohort.x[0, s:e].tolist()
            if got != want[0] or bool(cohort.block_final[0]) != want[4]:
                violations.append({"threshold": tau, "edit_threshold": edit_tau, "step": step, "block": block,
                                   "backend": got, "oracle": want[0]})  # fmt: skip
                break
            step += 1
        cases.append({"threshold": tau, "edit_threshold": edit_tau, "steps": step, "violations": violations})
    return {"passed": all(not c["violations"] for c in cases), "cases": cases}


def decisions(test: Model, ref: Model, prompts: list[list[int]], params: SamplingParams, eps: float) -> dict:
    """Lock-step editing decisions of ``test``'s state machine on its own logits against the
    oracle on ``ref``'s (float64), from the same states; disagreements only at near ties."""
    cohort = Cohort(test, prompts, params)
    mask = test.mask_id
    bs = _block_size(test, params)
    rows = cohort.b
    steps, violations, near_ties, edits = 0, [], 0, 0
    state: dict = {}
    while cohort.prepare() and steps < 400:
        s, e = cohort.s, cohort.e
        if state.get("s") != s:
            state = {"s": s, "final": [bool(f) for f in cohort.block_final], "post": [0] * rows,
                     "prompt": [[t != mask for t in row] for row in cohort.x[:, s:e].tolist()]}  # fmt: skip
        x = cohort.x.clone()
        ref_logits = ref.forward(x, cohort.attn, block_size=bs).double()[:, s:e]
        test_logits = test.forward(x.to(test.backend.device()), cohort.attn, block_size=bs)[:, s:e]
        test_probs = test_logits.double().cpu()
        test_probs[..., mask] = -math.inf
        test_probs = test_probs.softmax(-1)
        cohort.last_forward = steps
        cohort.decide(test_logits.float() if test_logits.dtype != torch.float64 else test_logits)
        for r in range(rows):
            if state["final"][r]:
                continue
            block = x[r, s:e].tolist()
            new, commit, edit, post, final, prob, margin = oracle_step(
                block, ref_logits[r], state["prompt"][r], state["post"][r], params, mask
            )
            edits += len(edit)
            got = cohort.x[r, s:e].tolist()
            if got != new or bool(cohort.block_final[r]) != final:
                tp = test_probs[r].max(-1).values.tolist()
                differ = [i for i in range(len(block)) if got[i] != new[i]]
                if not differ or not all(_near(i, block, prob, tp, margin, params, mask, eps) for i in differ):
                    violations.append(
                        {"step": steps, "row": r, "block_start": s, "backend": got, "oracle": new,
                         "backend_final": bool(cohort.block_final[r]), "oracle_final": final}
                    )  # fmt: skip
                else:
                    near_ties += 1
            cohort.x[r, s:e] = torch.tensor(new, dtype=cohort.x.dtype)  # both go on from the oracle's state
            cohort.block_final[r] = final
            state["post"][r], state["final"][r] = post, final
        steps += 1
    return {
        "passed": not violations,
        "rule": RULE,
        "steps": steps,
        "oracle_edits": edits,
        "near_ties": near_ties,
        "violations": violations[:10],
        "near_tie_margin": eps,
    }


def check(test: Model, ref: Model, prompts: list[list[int]], params: SamplingParams, eps: float) -> dict:
    """Both checks: passed only when the probes and the lock-step decisions pass."""
    pr = probes(test)
    dec = decisions(test, ref, prompts, params, eps)
    return {"passed": pr["passed"] and dec["passed"], "rule": RULE, "probes": pr, "decisions": dec}
