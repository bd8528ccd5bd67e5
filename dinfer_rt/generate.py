"""The shared diffusion scheduler: semi-autoregressive blocks, decision rules, KV-cache policies.

One loop serves every backend: the model is only asked for logits at chosen positions
(``Model.forward(..., cache=, compute=)``), or, for greedy rules that need only each masked
position's argmax and one score, for the fused confidence head (``Model.confidence``); the
cache buffers live in the runtime and the attention op splices fresh K/V into them in place.

Cache policies (none, prefix, dual, vicinity, adaptive, anchored, delayed): ``cache_policy.py`` says
which positions each step computes; ``docs/decoding.md`` has their measured accuracy.
On a bidirectional model the cached K/V outside the computed range go stale as tokens
are committed (the approximation Fast-dLLM names); the benchmark measures its accuracy cost.

Precision schedules (``precision.py``): each forward's weight format follows the block's masked
fraction or step; a low-precision forward whose commits would finish the block is redone in full
precision (rule state and random state restored first), so every block's last decisions are the
full-precision model's. ``precision_refresh`` recomputes the cached K/V at the first
full-precision forward after low-precision ones (the cached policies' stale low-precision K/V).

Decisions on the device: when the backend has a commit kernel (``Backend.commit_kernel``) and
the rule is greedy threshold or low_confidence through the confidence head, the sequence stays
on the device, the head scores every block slot (a fixed shape) and the kernel commits in place;
the host syncs once per block (the schedule) and once per ``sync_every`` steps (block done?).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dinfer_rt import cache_policy, strategies
from dinfer_rt.cache_policy import Spans
from dinfer_rt.errors import GenerationError
from dinfer_rt.model import Model
from dinfer_rt.precision import PrecisionSchedule
from dinfer_rt.sampling import SamplingParams


@dataclass
class BatchResult:
    tokens: torch.Tensor  # [B, G] generated slots (EOS-filled after early stop)
    committed: torch.Tensor  # [B] tokens the model committed per row
    nfe: int  # forwards run for this batch
    wall_s: float
    step_s: list[float]  # wall time of each forward
    commit_step: torch.Tensor  # [B, G] forward index at which each slot was committed (-1: never)
    precision_forwards: dict[str, int] = dataclasses.field(default_factory=dict)  # forwards per precision


def _pad_left(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, n - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[r, n - len(p) :] = 1
    return ids, mask


def check_token_ids(prompts: list[list[int]], vocab: int) -> None:
    """Prompt ids must be ints in [0, vocab): the embedding would index out of range otherwise."""
    for r, p in enumerate(prompts):
        for j, t in enumerate(p):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise GenerationError(
                    f"prompt {r}: token {j} is {t!r}; token ids must be ints in [0, {vocab}) (the model's vocabulary)"
                )


StopCheck = Callable[[int, list[int]], bool]
"""``(row, the row's generated ids up to the end of the block just finished) -> stop now?``"""


@torch.no_grad()
def generate_batch(
    model: Model, prompts: list[list[int]], params: SamplingParams, stop: StopCheck | None = None
) -> BatchResult:
    """Decode ``params.gen_length`` slots after each prompt (left-padded into one batch).

    ``stop`` is asked at the end of every block for each row still running; a row it stops is
    finished like one that produced EOS (the rest filled, no more forwards spent on it)."""
    params.validate()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GenerationError("every prompt must have at least one token")
    check_token_ids(prompts, model.spec.vocab)
    mask_id, eos = model.mask_id, model.eos_ids
    prompt_ids, prompt_mask = _pad_left(prompts, model.pad_id)
    b, p_len = prompt_ids.shape
    g, lb = params.gen_length, params.block_length
    n = p_len + g
    if n > model.spec.max_length:
        raise GenerationError(
            f"prompt ({p_len}) + gen_length ({g}) = {n} tokens exceeds the model's max length {model.spec.max_length}"
        )
    x = torch.cat((prompt_ids, torch.full((b, g), mask_id, dtype=torch.long)), dim=1)
    attn = torch.cat((prompt_mask, torch.ones(b, g, dtype=torch.long)), dim=1)
    if attn.all():
        attn = None
    rule = strategies.build(params)
    scheduled = params.strategy in strategies.SCHEDULED
    per_block = params.steps_per_block()
    gen = torch.Generator().manual_seed(params.seed)
    forward = _Forwarder(model, attn, params, p_len, b, n)
    try:
        on_device = forward.device_rule is not None  # decisions on the device: x stays there
        dev = model.backend.device() if on_device else torch.device("cpu")
        x = x.to(dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        committed = torch.zeros(b, dtype=torch.long, device=dev)
        commit_step = torch.full((b, g), -1, dtype=torch.long, device=dev)
        ones = torch.ones(b, dtype=torch.long, device=dev)  # the quota of the unscheduled rules
        any_done = False  # whether some row has finished (rows finish only between blocks; no sync)
        start = time.perf_counter()
        # Block-causal models (LLaDA2) align blocks to absolute position 0, so the first block may
        # hold the prompt's tail; bidirectional models start the first block right after the prompt.
        first = (p_len // lb) * lb if model.spec.block_causal else p_len
        for s in range(first, n, lb):
            e = min(s + lb, n)
            block_masked = x[:, s:e] == mask_id
            plan = strategies.linear_schedule(block_masked.sum(-1).cpu(), per_block).to(dev)  # one sync per block
            state: dict = {}
            step = 0
            while True:
                is_mask = x[:, s:e] == mask_id
                if step % params.sync_every == 0 and not is_mask.any():  # the host sync
                    break
                if step >= 4 * lb + per_block:  # safety cap: every rule commits >= 1 per step
                    raise GenerationError(f"block [{s}, {e}) did not finish in {step} steps")
                masked = is_mask & ~done[:, None] if any_done else is_mask
                quota = plan[:, min(step, per_block - 1)] if scheduled else ones
                precision = forward.precision_for(masked, max(s, p_len) - s, step)
                out = forward(x, s, e, step, precision)
                if on_device:  # the backend's kernel decides and writes the block in place: no host sync
                    commit = forward.commit(out[1], masked, quota, out[0], x[:, s:e], rule=forward.device_rule)
                else:

                    def decide(out, masked=masked, quota=quota, state=state):
                        if forward.use_confidence:  # the head already banned the mask token
                            step_in = strategies.StepInput(None, masked, quota, 0.0, gen, state, x0=out[0], conf=out[1])
                        else:
                            out[..., mask_id] = float("-inf")  # never commit the mask token
                            step_in = strategies.on_logits_device(out, masked, quota, params.temperature, gen, state)
                        x0, commit = rule(step_in)
                        return x0.to(masked.device), commit.to(masked.device) & masked

                    saved = (dict(state), gen.get_state()) if precision is not None else None
                    x0, commit = decide(out)
                    if precision is not None and (masked.any(-1) & ~(masked & ~commit).any(-1)).any():
                        # these commits would finish some row's block: the full-precision model decides them
                        state.clear()
                        state.update(saved[0])
                        gen.set_state(saved[1])
                        x0, commit = decide(forward(x, s, e, step, None))
                    x[:, s:e] = torch.where(commit, x0, x[:, s:e])
                committed += commit.sum(-1)
                forward.note_commits(commit)
                lo = max(s, p_len)  # a block-causal first block may start inside the prompt
                commit_step[:, lo - p_len : e - p_len].masked_fill_(commit[:, lo - s :], forward.nfe - 1)
                step += 1
            newly = torch.zeros_like(done)
            if params.early_stop and eos:
                newly |= torch.isin(x[:, s:e], torch.tensor(eos, device=dev)).any(-1) & ~done
            if stop is not None:
                final = x[:, p_len:e].cpu()  # the block is complete: every slot up to e is final
                for r in (~done & ~newly).nonzero().flatten().tolist():
                    newly[r] |= stop(r, final[r].tolist())
            if newly.any():
                fill = model.pad_id if model.pad_id in eos else (eos[0] if eos else model.pad_id)
                x[newly, e:] = fill
                done |= newly
                any_done = True
                if done.all():
                    break
        wall = time.perf_counter() - start
        return BatchResult(
            x[:, p_len:].cpu(),
            committed.cpu(),
            forward.nfe,
            wall,
            forward.step_s,
            commit_step.cpu(),
            dict(forward.precision_forwards),
        )
    finally:  # the cache goes back to the model's pool for the next call (same buffers)
        forward.release()


class _Forwarder:
    """Runs the forward each step needs under the cache policy."""

    def release(self) -> None:
        """Hands the KV cache back to the model's pool (the next call of this shape reuses it)."""
        if self.cache is not None:
            self.model.cache_pool.release(self.cache)
            self.cache = None

    def __init__(self, model: Model, attn, params: SamplingParams, p_len: int, batch: int, n: int) -> None:
        self.model, self.attn, self.params, self.p_len = model, attn, params, p_len
        self.block_size = params.block_length if model.spec.block_causal else None
        self.cache = model.cache_pool.acquire(batch, n) if params.cache != "none" else None
        self.prev_start: int | None = None
        # adaptive / anchored / delayed cache: tokens each row committed since the last full refresh (not
        # counted when no bound applies: on a device the count is a host sync per step)
        counted = params.cache in ("adaptive", "anchored", "delayed") and math.isfinite(params.refresh_limit())
        self.pending = torch.zeros(batch, dtype=torch.long) if counted else None
        self.use_confidence = (
            params.confidence_head
            and params.strategy in strategies.STATS_ONLY
            and params.temperature == 0
            and params.cfg_scale == 0
        )
        self.nfe = 0
        self.block_start = 0  # the block the last forward decoded
        self.last_commits: tuple[int, ...] = ()  # delayed cache: positions the last step committed
        self._windows: dict[tuple[Spans, int], tuple[torch.Tensor, int, torch.Tensor | int]] = {}
        self._slots: dict[tuple[int, int], torch.Tensor] = {}
        self.step_s: list[float] = []
        # Greedy threshold / top-k decisions run on the device when the backend has a commit kernel.
        rules = {"threshold": "threshold", "low_confidence": "top_k"}
        self.schedule = None
        if params.precision_schedule is not None:
            self.schedule = PrecisionSchedule.parse(params.precision_schedule)
            self.schedule.check_model(model.dtype, model.weight_format)
        self.precision_forwards: dict[str, int] = {}
        self.last_precision: str | None = None
        self.refresh_next = False  # precision_refresh: the next full-precision forward refreshes the cache
        # A schedule may redo a step's decisions in full precision: they stay on the host.
        on_device_ok = self.use_confidence and self.schedule is None
        self.commit = model.backend.commit_kernel() if on_device_ok else None
        self.device_rule = rules.get(params.strategy) if self.commit is not None else None
        if self.device_rule == "threshold":
            self.commit = functools.partial(self.commit, threshold=params.threshold)

    def _positions(self, spans: Spans, s: int, e: int) -> tuple[torch.Tensor, int, torch.Tensor | int]:
        """The spans' positions as one tensor (one per window: the model's and the kernels'
        per-forward memos keyed on it are then reused by every step that computes it), their
        count, and where the block [s, e) lies among them: the index of ``s`` when the whole
        block is computed, else (``delayed``) the block slots computed."""
        key = (spans, s)
        if key not in self._windows:  # from Python ints, one tensor each (delayed: a new window most steps)
            listed = [q for lo, hi in spans for q in range(lo, hi)]
            whole = any(lo <= s and e <= hi for lo, hi in spans)
            block = [q - s for q in listed if s <= q < e]  # may be empty: long, never float
            where = cache_policy.offset_of(spans, s) if whole else torch.tensor(block, dtype=torch.long)
            self._windows[key] = (torch.tensor(listed, dtype=torch.long), len(listed), where)
        return self._windows[key]

    def _block_slots(self, s: int, e: int) -> torch.Tensor:
        """``arange(s, e)``, one tensor per block."""
        if (s, e) not in self._slots:
            self._slots[(s, e)] = torch.arange(s, e)
        return self._slots[(s, e)]

    def note_commits(self, commit: torch.Tensor) -> None:
        """The scheduler's commits of the step just run (the adaptive, anchored and delayed
        policies count them; delayed recomputes their K/V once more, now from their tokens)."""
        if self.pending is not None:
            self.pending += commit.sum(-1).cpu()
        if self.params.cache == "delayed" and commit.device.type == "cpu":
            self.last_commits = tuple((commit.any(0).nonzero().flatten() + self.block_start).tolist())

    def precision_for(self, masked: torch.Tensor, prompt_slots: int, step: int) -> str | None:
        """The schedule's weight format for this step (None: full precision): the masked fraction
        is that of the least-masked running row over the block's generated slots."""
        if self.schedule is None:
            return None
        running = masked.any(-1)
        slots = masked.shape[1] - prompt_slots
        frac = float(masked[running].sum(-1).min()) / slots if bool(running.any()) and slots > 0 else 0.0
        return self.schedule.choose(frac, step)

    def __call__(self, x: torch.Tensor, s: int, e: int, step: int, precision: str | None = None):
        """The block's logits [B, e - s, V], or with the confidence head (argmax, probability) [B, e - s]."""
        t0 = time.perf_counter()
        name = precision or (self.schedule.full if self.schedule is not None else "full")
        self.precision_forwards[name] = self.precision_forwards.get(name, 0) + 1
        if self.params.precision_refresh and self.last_precision is not None and precision is None:
            self.refresh_next = True
        self.last_precision = precision
        out = self._step(x, s, e, step, precision)
        self.block_start = s
        self.step_s.append(time.perf_counter() - t0)
        return out

    def _step(self, x: torch.Tensor, s: int, e: int, step: int, precision: str | None = None):
        self.nfe += 1
        m = self.model
        if self.params.cfg_scale > 0:
            return self._guided(x, precision)[:, s:e]
        spans, cached = self._window(x, s, e, step)
        if cached and self.refresh_next:  # K/V written by low-precision forwards: recompute them all
            spans = ((0, x.shape[1]),)
        self.refresh_next = False
        compute, width, where = self._positions(spans, s, e)
        compute = compute if cached else None
        # Rows are run in slices of at most max_forward_tokens computed positions: a long refresh
        # of a big batch then holds a slice's activations, not the whole batch's (chunked prefill).
        per = max(1, self.params.max_forward_tokens // width) if self.params.max_forward_tokens else x.shape[0]
        slices = [(r, min(r + per, x.shape[0])) for r in range(0, x.shape[0], per)]

        def rows(r0: int, r1: int):
            whole = r0 == 0 and r1 == x.shape[0]
            cache = None if not cached else (self.cache if whole else self.cache.rows(r0, r1))
            attn = self.attn if self.attn is None or whole else self.attn[r0:r1]
            return (x if whole else x[r0:r1]), attn, cache

        if not self.use_confidence:
            parts = []
            for r0, r1 in slices:
                xs, attn, cache = rows(r0, r1)
                parts.append(
                    m.forward(xs, attn, cache=cache, compute=compute, block_size=self.block_size, precision=precision)
                )
            logits = torch.cat(parts) if len(parts) > 1 else parts[0]
            if isinstance(where, int):
                return logits[:, where : where + e - s]
            # delayed: only the block's masked and just-committed slots were computed; the others
            # are committed (the rules decide masked slots only), their logits left at zero
            block = logits.new_zeros((logits.shape[0], e - s, logits.shape[2]))
            block[:, where] = logits[:, torch.searchsorted(compute, where + s)]
            return block
        # Confidence head: the LM head runs only where some row still has a mask (on the device
        # path, at every block slot: a fixed shape and no host sync to find them).
        if self.device_rule is not None:  # one tensor per window (the model's memos key on it)
            select = self._block_slots(s, e) if isinstance(where, int) else where + s
        else:
            select = torch.arange(s, e)[(x[:, s:e] == m.mask_id).any(0)]
        score = strategies.SCORE_KIND[self.params.strategy]
        outs = []
        for r0, r1 in slices:
            xs, attn, cache = rows(r0, r1)
            outs.append(
                m.confidence(
                    xs,
                    attn,
                    select=select,
                    score=score,
                    cache=cache,
                    compute=compute,
                    block_size=self.block_size,
                    precision=precision,
                )
            )
        conf, token = outs[0] if len(outs) == 1 else (torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]))
        if self.device_rule is not None:
            if isinstance(where, int):
                return token, conf
            # delayed: the uncomputed block slots are committed; the kernel reads masked ones only
            full = token.new_full((x.shape[0], e - s), m.mask_id), conf.new_zeros((x.shape[0], e - s))
            full[0][:, where], full[1][:, where] = token, conf
            return full
        x0 = torch.full((x.shape[0], e - s), m.mask_id, dtype=torch.long)
        probs = torch.zeros((x.shape[0], e - s), dtype=conf.dtype)
        x0[:, select - s], probs[:, select - s] = token.cpu(), conf.cpu()
        return x0, probs

    def _window(self, x: torch.Tensor, s: int, e: int, step: int) -> tuple[Spans, bool]:
        """Spans of positions this step computes, and whether it reads and writes the cache."""
        n = x.shape[1]
        if self.cache is None:
            return ((0, n),), False
        pending = int(self.pending.max()) if self.pending is not None else 0
        active: tuple[int, ...] = ()
        if self.params.cache == "delayed":
            if self.device_rule is not None and x.device.type != "cpu":  # on a device: whole block, no sync
                active = tuple(range(s if step else max(self.p_len, s - self.params.block_length), e))
            else:
                masked = (x[:, s:e] == self.model.mask_id).any(0).nonzero().flatten() + s
                active = tuple(sorted(set(masked.tolist()) | set(self.last_commits)))
        spans, restart = cache_policy.step_window(
            self.params, s=s, e=e, n=n, prompt_len=self.p_len, step=step, forward=self.nfe,
            pending=pending, block_causal=self.model.spec.block_causal, prev_start=self.prev_start,
            active=active,
        )  # fmt: skip
        if self.model.spec.block_causal and step == 0:
            self.prev_start = s
        if restart and self.pending is not None:
            self.pending.zero_()
        return spans, True

    def _guided(self, x: torch.Tensor, precision: str | None = None) -> torch.Tensor:
        """Classifier-free guidance: the unconditional row has its prompt masked (LLaDA ``generate``)."""
        u = x.clone()
        u[:, : self.p_len] = self.model.mask_id
        attn = None if self.attn is None else torch.cat((self.attn, self.attn))
        both = self.model.forward(torch.cat((x, u)), attn, block_size=self.block_size, precision=precision)
        cond, uncond = both.chunk(2)
        return uncond + (self.params.cfg_scale + 1) * (cond - uncond)
