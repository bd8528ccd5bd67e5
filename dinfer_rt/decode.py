"""The decode state and its step: the one diffusion state machine every entry point runs.

A :class:`Cohort` is a set of rows decoded together in one frame: the prompts of a static
batch (left-padded to a common length, as LLaDA's ``generate`` does) or one served request.
Its rows share their block, their step in it and the cache-policy window, so one forward
serves all of them; each row keeps its own schedule, rule state and commits. Per step the
engine (``engine.py``) asks each cohort to :meth:`~Cohort.prepare` (advance past finished
blocks, choose the precision, plan the window), runs the forward, and hands each cohort
block-aligned outputs to :meth:`~Cohort.decide` (the decision rule, batched over the rows).

Two ways to run a step's forward, same decisions either way:

- **lockstep** (:meth:`Cohort.forward`): one cohort alone, one ``compute`` window with static
  shapes over its cache rows; the only path for classifier-free guidance and precision
  schedules, and the one where the backend's device-side commit kernel keeps the sequence on
  the device (one host sync per block plus one per ``sync_every`` steps);
- **per-row** (:func:`forward_rows`): several cohorts at different blocks in one forward, each
  row with its own query window (``Model.forward_rows``), padded to the longest.

Blocks: block-causal models (LLaDA2) align blocks to absolute position 0, so the first block
may hold the prompt's tail; bidirectional models start the first block right after the prompt.

Cache policies (none, prefix, dual, vicinity, adaptive, anchored, delayed): ``cache_policy.py``
says which positions each step computes. Precision schedules (``precision.py``): a
low-precision forward whose commits would finish some row's block is redone in full precision
(rule state and random state restored first), so every block's last decisions are the
full-precision model's; ``precision_refresh`` recomputes the cached K/V at the first
full-precision forward after low-precision ones.
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
from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import GenerationError
from dinfer_rt.ir import ops
from dinfer_rt.model import Model
from dinfer_rt.model_runner import ForwardInputs, RowWindows
from dinfer_rt.precision import PrecisionSchedule
from dinfer_rt.sampling import SamplingParams

StopCheck = Callable[[int, list[int]], bool]
"""``(row, the row's generated ids up to the end of the block just finished) -> stop now?``"""


@dataclass
class BatchResult:
    """What a static batch produced (``engine.run_batch``)."""

    tokens: torch.Tensor  # [B, G] generated slots (filled after a row finished early)
    committed: torch.Tensor  # [B] tokens the model committed per row
    nfe: int  # forwards run for this batch
    wall_s: float
    step_s: list[float]  # wall time of each forward
    commit_step: torch.Tensor  # [B, G] forward index at which each slot was committed (-1: never)
    precision_forwards: dict[str, int] = dataclasses.field(default_factory=dict)  # forwards per precision
    requests: list = dataclasses.field(default_factory=list)  # the engine's Request per row (text, output ids)


@dataclass
class Window:
    """The positions one step computes for a cohort (every row the same)."""

    compute: torch.Tensor  # [W] frame positions computed (increasing)
    cached: bool  # reads and writes the cache (False: a full uncached forward)
    where: torch.Tensor | int  # the block's place in ``compute``: its offset, or (delayed) the block slots computed
    precision: str | None
    guided: bool = False  # classifier-free guidance: a full uncached forward of conditional + unconditional rows


def pad_left(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded into one [B, P] frame, and the mask of real tokens."""
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


def uses_confidence_head(params: SamplingParams, args: EngineArgs | None = None) -> bool:
    """Whether a request's decisions need only each slot's argmax and one score (the fused
    confidence head): greedy, unguided, a rule in ``STATS_ONLY``, and not turned off by the
    engine (``EngineArgs.confidence_head``); not when it asks for ``logprobs`` (they need the logits)."""
    return (
        (args is None or args.confidence_head)
        and params.strategy in strategies.STATS_ONLY
        and params.temperature == 0
        and params.cfg_scale == 0
        and params.logprobs is None
    )


def edits_on_device(params: SamplingParams, args: EngineArgs | None = None) -> bool:
    """Whether an editing request's steps can run on a backend's edit kernel: greedy,
    unguided, joint_threshold without ``penalty_lambda`` (its decision needs each slot's argmax
    and probability only: the confidence head), the head not turned off by the engine, no
    ``logprobs`` (they need the logits)."""
    return (
        (args is None or args.confidence_head)
        and params.strategy == "joint_threshold"
        and params.temperature == 0
        and params.cfg_scale == 0
        and params.penalty_lambda == 0
        and params.logprobs is None
    )


class Cohort:
    """Rows decoded in one frame, block by block: the decode state and its step.

    ``run`` is assigned by the engine before the first forward: its runner
    (``model_runner.py``), which runs a forward's inputs on every rank; the cohort's rows of the
    engine's KV-cache pool start at ``start_row``."""

    def __init__(
        self, model: Model, prompts: list[list[int]], params: SamplingParams, args: EngineArgs | None = None
    ) -> None:
        params = params.for_model(model.spec)  # validated, its block length resolved
        args = args or EngineArgs()
        if args.sync_every > (limit := params.max_block_steps()):
            raise GenerationError(
                f"sync_every {args.sync_every} must be <= {limit}: a block runs at most {limit} steps "
                f"(4 x block_length {params.block_length} + {params.steps_per_block()} steps per block), so "
                "its completion would never be checked"
            )
        self.sync_every, self.max_forward_tokens = args.sync_every, args.max_forward_tokens
        model.spec.check_cache_policy(params.cache)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GenerationError("every prompt must have at least one token")
        check_token_ids(prompts, model.spec.vocab)
        self.model, self.params = model, params
        self.mask_id = model.mask_id
        ids, prompt_mask = pad_left(prompts, model.pad_id)
        b, p_len = ids.shape
        g, lb = params.gen_length, params.block_length
        n = p_len + g
        if n > model.spec.max_length:
            raise GenerationError(
                f"prompt ({p_len}) + gen_length ({g}) = {n} tokens exceeds the model's max length "
                f"{model.spec.max_length}"
            )
        self.b, self.p_len, self.n = b, p_len, n
        self.pads = [p_len - len(p) for p in prompts]
        attn = torch.cat((prompt_mask, torch.ones(b, g, dtype=torch.long)), dim=1)
        self.attn = None if attn.all() else attn
        self.rule = strategies.build(params)
        # an editing rule (joint_threshold) rewrites unmasked slots of the block: a token is final
        # only when its block ends, per row (``block_final``), not when it is unmasked
        self.editing = params.strategy in strategies.EDITING
        self.scheduled = params.strategy in strategies.SCHEDULED
        self.per_block = params.steps_per_block()
        self.gen = torch.Generator().manual_seed(params.seed)
        self.block_size = lb if model.spec.block_causal else None
        self.use_confidence = uses_confidence_head(params, args)
        self.score = strategies.SCORE_KIND.get(params.strategy, "max")
        self.schedule = None
        if params.precision_schedule is not None:
            self.schedule = PrecisionSchedule.parse(params.precision_schedule)
            self.schedule.check_model(model.dtype, model.weight_format)
        # Greedy threshold / top-k decisions run on the device when the backend has a commit
        # kernel; a schedule may redo a step's decisions in full precision, so they stay on the host.
        self.commit = model.backend.commit_kernel() if self.use_confidence and self.schedule is None else None
        self.device_rule = {"threshold": "threshold", "low_confidence": "top_k"}.get(params.strategy)
        if self.commit is None:
            self.device_rule = None
        elif self.device_rule is None:
            self.commit = None
        elif self.device_rule == "threshold":
            self.commit = functools.partial(self.commit, threshold=params.threshold)
        if self.editing and self.schedule is None and edits_on_device(params, args):
            # greedy joint_threshold needs per slot only the argmax and its probability: the
            # confidence head over the whole block, and the backend's edit kernel writes the
            # commits and edits in place; the block end stays on the device (``block_final``)
            kernel = model.backend.edit_kernel()
            if kernel is not None:
                self.use_confidence, self.device_rule = True, "joint"
                self.commit = functools.partial(
                    kernel, threshold=params.threshold, edit_threshold=params.edit_threshold
                )
        dev = model.backend.device() if self.device_rule is not None else torch.device("cpu")
        self.x = torch.cat((ids, torch.full((b, g), self.mask_id, dtype=torch.long)), dim=1).to(dev)
        self.done = torch.zeros(b, dtype=torch.bool, device=dev)
        self.any_done = False  # some row finished (no sync needed to know)
        self.committed = torch.zeros(b, dtype=torch.long, device=dev)
        self.edits = torch.zeros(b, dtype=torch.long, device=dev)  # token-to-token rewrites per row (editing rules)
        self.post_steps = torch.zeros(b, dtype=torch.long, device=dev)  # forwards a row's block started with no mask
        self.unreported = [0, 0]  # (edits, post steps) since the engine last read them
        self._unread = torch.zeros(2, dtype=torch.long, device=dev)  # the same, not yet read on the host
        self.block_final = torch.zeros(b, dtype=torch.bool, device=dev)  # editing: the row's current block is final
        self.commit_step = torch.full((b, g), -1, dtype=torch.long, device=dev)
        # ``params.logprobs``: per generated slot, the log-probability of the token the forward
        # that last wrote it gave it (and its top alternatives); on the host (the logits path)
        self.logprobs = params.logprobs
        if self.logprobs is not None:
            k = min(self.logprobs, model.spec.vocab - 1)  # the mask token is never an alternative
            self.token_logprob = torch.zeros((b, g), dtype=torch.float32)
            self.top_ids = torch.zeros((b, g, k), dtype=torch.long)
            self.top_logprob = torch.zeros((b, g, k), dtype=torch.float32)
        self._ones = torch.ones(b, dtype=torch.long, device=dev)  # the quota of the unscheduled rules
        self.stop: StopCheck | None = None
        self.requests: list = []  # the engine's Request of each row
        self.start_row = 0  # the first of its rows in the engine's KV-cache pool
        self.run: Callable[[ForwardInputs], object] | None = None  # the engine's runner
        # the cache policy's counters
        self.prev_start: int | None = None  # block-causal: the previous block's start
        # block-causal: leading positions whose K/V are in the pool before the first forward (copied
        # from the engine's prefix cache, ``prefix_cache.py``, or computed by its chunked prefill);
        # that forward computes from here, not from 0. Bidirectional (the approximate prefix cache):
        # prompt positions whose copied K/V no forward of this request recomputes (``_spans``)
        self.cached_prefix = 0
        # adaptive / anchored / delayed: tokens each row committed since the last full refresh
        # (not counted when no bound applies: on a device the count is a host sync per step)
        counted = params.cache in ("adaptive", "anchored", "delayed") and math.isfinite(params.refresh_limit())
        self.pending = torch.zeros(b, dtype=torch.long) if counted else None
        self.last_commits: tuple[int, ...] = ()  # delayed: positions the last step committed
        self.nfe = 0
        self.block_start = 0  # the block the last forward decoded
        self._windows: dict[tuple[Spans, int], tuple[torch.Tensor, torch.Tensor | int]] = {}
        self._slots: dict[tuple[int, int], torch.Tensor] = {}
        self.step_s: list[float] = []
        # the engine's count of forwards (commit_step indexes them); alone: this cohort's own
        self.on_forward: Callable[[float], int] | None = None
        self.last_forward = -1
        self.precision_forwards: dict[str, int] = {}
        self.last_precision: str | None = None
        self.refresh_next = False  # precision_refresh: the next full-precision forward refreshes the cache
        # the block being decoded
        self.s = (p_len // lb) * lb if model.spec.block_causal else p_len
        self.e = self.s
        self.step = 0
        self.started = False
        self.finished = False
        self.window: Window | None = None

    # ---------------------------------------------------------------- per block
    @property
    def row_dependent(self) -> bool:
        """Whether the window or precision of a step would depend on which rows share it: the
        delayed window (the slots masked in some row), a refresh bound (the most any row
        committed) or a precision schedule (the least-masked row). A static batch of such
        requests decodes as one cohort per prompt, so each prompt decodes as it would alone."""
        p = self.params
        return p.cache == "delayed" or self.pending is not None or self.schedule is not None

    @property
    def fill_id(self) -> int:
        """What a finished row's remaining slots hold (EOS, or the pad id when it is an EOS)."""
        eos = self.model.eos_ids
        return self.model.pad_id if self.model.pad_id in eos else (eos[0] if eos else self.model.pad_id)

    def _start_block(self) -> None:
        self.e = min(self.s + self.params.block_length, self.n)
        masked = (self.x[:, self.s : self.e] == self.mask_id).sum(-1).cpu()  # one sync per block
        self.plan = strategies.linear_schedule(masked, self.per_block).to(self.x.device)
        self.state: dict = {}
        self.step = 0
        if self.editing:  # the block's prompt slots are fixed now: what is not masked at its start
            # (on the sequence's device: the device rule keeps the block end there, no host sync)
            self.prompt_block = self.x[:, self.s : self.e] != self.mask_id
            self.block_final = self.done.clone()
            self.block_post = torch.zeros(self.b, dtype=torch.long, device=self.x.device)  # no-mask steps per row

    def _end_block(self) -> None:
        """The block is final: rows the stop check stops finish (the rest of them filled)."""
        if self.stop is None:
            return
        final = self.x[:, self.p_len : self.e].cpu()
        for r in (~self.done).nonzero().flatten().tolist():
            if self.stop(r, final[r].tolist()):
                self.finish_row(r)

    def finish_row(self, r: int) -> None:
        """Row ``r`` needs no more decoding (its request ended): its masked slots are filled, so
        the rules never pick it again and a block never waits for it."""
        if not bool(self.done[r]):
            self.done[r] = True
            self.any_done = True
            self.block_final[r] = True
            row = self.x[r]
            row.masked_fill_(row == self.mask_id, self.fill_id)

    def prepare(self) -> bool:
        """Move past finished blocks and plan this step's forward; False when nothing is left
        to decode (every block done, or every row finished)."""
        p = self.params
        while True:
            if self.finished:
                return False
            if not self.started:
                self.started = True
                self._start_block()
            is_mask = self.x[:, self.s : self.e] == self.mask_id
            # the host sync, every sync_every steps (read only then: on a device, a sync)
            if self.step % self.sync_every == 0 and (
                bool(self.block_final.all()) if self.editing else not bool(is_mask.any())
            ):
                self._end_block()
                self.s += p.block_length
                if self.s >= self.n or bool(self.done.all()):
                    self.finished = True
                    return False
                self._start_block()
                continue
            if self.step >= p.max_block_steps():  # safety cap: every rule commits >= 1 per step
                raise GenerationError(f"block [{self.s}, {self.e}) did not finish in {self.step} steps")
            self.masked = is_mask & ~self.done[:, None] if self.any_done else is_mask
            self.quota = self.plan[:, min(self.step, self.per_block - 1)] if self.scheduled else self._ones
            self.precision = self._precision_for(self.masked, max(self.s, self.p_len) - self.s, self.step)
            self.window = self._plan(self.precision)
            return True

    def _precision_for(self, masked: torch.Tensor, prompt_slots: int, step: int) -> str | None:
        """The schedule's weight format for this step (None: full precision): the masked fraction
        is that of the least-masked running row over the block's generated slots."""
        if self.schedule is None:
            return None
        running = masked.any(-1)
        slots = masked.shape[1] - prompt_slots
        frac = float(masked[running].sum(-1).min()) / slots if bool(running.any()) and slots > 0 else 0.0
        return self.schedule.choose(frac, step)

    # ---------------------------------------------------------------- the window
    def _plan(self, precision: str | None) -> Window:
        """Count the forward and choose the positions it computes (stateful: once per forward)."""
        name = precision or (self.schedule.full if self.schedule is not None else "full")
        self.precision_forwards[name] = self.precision_forwards.get(name, 0) + 1
        if self.params.precision_refresh and self.last_precision is not None and precision is None:
            self.refresh_next = True
        self.last_precision = precision
        self.nfe += 1
        if self.params.cfg_scale > 0:
            return Window(torch.arange(self.n), False, self.s, precision, guided=True)
        spans, cached = self._spans()
        if cached and self.refresh_next:  # K/V written by low-precision forwards: recompute them all
            spans = ((0, self.n),)
        self.refresh_next = False
        compute, where = self._positions(spans)
        return Window(compute, cached, where, precision)

    def _spans(self) -> tuple[Spans, bool]:
        """Spans of positions this step computes, and whether it reads and writes the cache."""
        p, s, e, n = self.params, self.s, self.e, self.n
        if p.cache == "none":
            return ((0, n),), False
        pending = int(self.pending.max()) if self.pending is not None else 0
        active: tuple[int, ...] = ()
        if p.cache == "delayed":
            if self.editing or (self.device_rule is not None and self.x.device.type != "cpu"):
                # an editing rule may rewrite any slot; on a device: no sync. The whole block
                active = tuple(range(s if self.step else max(self.p_len, s - p.block_length), e))
            else:
                masked = (self.x[:, s:e] == self.mask_id).any(0).nonzero().flatten() + s
                active = tuple(sorted(set(masked.tolist()) | set(self.last_commits)))
        block_causal = self.model.spec.block_causal
        # the first block's first forward starts past the cached prefix (block-causal: exact)
        prev_start = self.prev_start if self.prev_start is not None else (self.cached_prefix or None)
        spans, restart = cache_policy.step_window(
            p, s=s, e=e, n=n, prompt_len=self.p_len, step=self.step, forward=self.nfe,
            pending=pending, block_causal=block_causal, prev_start=prev_start, active=active,
        )  # fmt: skip
        if block_causal and self.step == 0:
            self.prev_start = s
        if restart and self.pending is not None:
            self.pending.zero_()
        if self.cached_prefix and not block_causal:
            # approximate prefix cache: the copied prompt K/V stay for the request's whole life
            # (refreshes included): the compute they save, and the approximation (prefix_cache.py);
            # a shifted-logits family (Dream) still recomputes position c - 1 (it predicts c)
            c = self.cached_prefix
            spans = tuple((max(lo, c), hi) for lo, hi in spans if hi > c)
        return spans, True

    def _positions(self, spans: Spans) -> tuple[torch.Tensor, torch.Tensor | int]:
        """The spans' positions as one tensor (one per window: the model's and the kernels'
        per-forward memos keyed on it are reused by every step that computes it) and where the
        block lies among them: the index of its start when it is computed whole, else
        (``delayed``) the block slots computed."""
        s, e = self.s, self.e
        key = (spans, s)
        if key not in self._windows:  # from Python ints, one tensor each (delayed: a new window most steps)
            listed = [q for lo, hi in spans for q in range(lo, hi)]
            whole = any(lo <= s and e <= hi for lo, hi in spans)
            block = [q - s for q in listed if s <= q < e]  # may be empty: long, never float
            where = cache_policy.offset_of(spans, s) if whole else torch.tensor(block, dtype=torch.long)
            self._windows[key] = (torch.tensor(listed, dtype=torch.long), where)
        return self._windows[key]

    def _block_slots(self) -> torch.Tensor:
        """``arange(s, e)``, one tensor per block."""
        key = (self.s, self.e)
        if key not in self._slots:
            self._slots[key] = torch.arange(self.s, self.e)
        return self._slots[key]

    # ---------------------------------------------------------------- lockstep forward
    def forward(self, window: Window) -> tuple | torch.Tensor:
        """The lockstep forward of this step: the block's logits [B, L, V], or with the
        confidence head (argmax, probability) [B, L] (device rule: (token, score))."""
        t0 = time.perf_counter()
        out = self._forward(window)
        self.block_start = self.s
        self.ran(time.perf_counter() - t0)
        return out

    def ran(self, wall: float) -> None:
        """Record a forward this cohort took part in (lockstep, or the engine's per-row one)."""
        self.step_s.append(wall)
        self.last_forward = self.on_forward(wall) if self.on_forward is not None else self.nfe - 1

    def _forward(self, w: Window):
        m, x, s, e = self.model, self.x, self.s, self.e
        if w.guided:
            return self._guided(w.precision)[:, s:e]
        compute = w.compute if w.cached else None
        # Rows run in slices of at most max_forward_tokens computed positions: a long refresh of a
        # big batch then holds a slice's activations, not the whole batch's (chunked prefill).
        width = len(w.compute)
        mft = self.max_forward_tokens
        per = max(1, mft // width) if mft else self.b
        slices = [(r, min(r + per, self.b)) for r in range(0, self.b, per)]

        def rows(r0: int, r1: int, select: torch.Tensor | None = None) -> ForwardInputs:
            whole = r0 == 0 and r1 == self.b
            cache = (self.start_row + r0, r1 - r0, self.n) if w.cached else None
            attn = self.attn if self.attn is None or whole else self.attn[r0:r1]
            return ForwardInputs(
                x if whole else x[r0:r1], attn, compute=compute, cache=cache, select=select, score=self.score,
                block_size=self.block_size, precision=w.precision,
            )  # fmt: skip

        if not self.use_confidence:
            parts = [_kept(self.run(rows(r0, r1)), len(slices)) for r0, r1 in slices]
            logits = torch.cat(parts) if len(parts) > 1 else parts[0]
            if isinstance(w.where, int):
                return logits[:, w.where : w.where + e - s]
            # delayed: only the block's masked and just-committed slots were computed; the others
            # are committed (the rules decide masked slots only), their logits left at zero
            block = logits.new_zeros((logits.shape[0], e - s, logits.shape[2]))
            block[:, w.where] = logits[:, torch.searchsorted(w.compute, w.where + s)]
            return block
        # Confidence head: the LM head runs only where some row still has a mask (on the device
        # path, at every block slot: a fixed shape and no host sync to find them).
        if self.device_rule is not None:  # one tensor per window (the model's memos key on it)
            select = self._block_slots() if isinstance(w.where, int) else w.where + s
        else:
            select = torch.arange(s, e)[(x[:, s:e] == m.mask_id).any(0)]
        outs = [_kept(self.run(rows(r0, r1, select)), len(slices)) for r0, r1 in slices]
        conf, token = outs[0] if len(outs) == 1 else (torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]))
        if self.device_rule is not None:
            if isinstance(w.where, int):
                return token, conf
            # delayed: the uncomputed block slots are committed; the kernel reads masked ones only
            full = token.new_full((self.b, e - s), m.mask_id), conf.new_zeros((self.b, e - s))
            full[0][:, w.where], full[1][:, w.where] = token, conf
            return full
        x0 = torch.full((self.b, e - s), m.mask_id, dtype=torch.long)
        probs = torch.zeros((self.b, e - s), dtype=conf.dtype)
        x0[:, select - s], probs[:, select - s] = token.cpu(), conf.cpu()
        return x0, probs

    def _guided(self, precision: str | None = None) -> torch.Tensor:
        """Classifier-free guidance: the unconditional row has its prompt masked (LLaDA ``generate``)."""
        x = self.x
        u = x.clone()
        u[:, : self.p_len] = self.mask_id
        attn = None if self.attn is None else torch.cat((self.attn, self.attn))
        both = self.run(ForwardInputs(torch.cat((x, u)), attn, block_size=self.block_size, precision=precision))
        cond, uncond = both.chunk(2)
        return uncond + (self.params.cfg_scale + 1) * (cond - uncond)

    # ---------------------------------------------------------------- per-row forward
    def queries(self) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """This step's slots in the order a per-row forward takes them (the same for every row):
        first the slots whose outputs predict the block (the block itself, under ``delayed`` its
        computed slots; for Dream the slot before each), then the rest. Also how many outputs
        predict the block, and (delayed) which block offsets they are."""
        w, s = self.window, self.s
        computed = w.compute
        offsets = None if isinstance(w.where, int) else w.where
        block = self._block_slots() if offsets is None else offsets + s
        pred = self.model.predicting(block)
        rest = computed
        if self.model.spec.shift_logits:  # the outputs that predict the computed positions too
            rest = torch.unique(torch.cat((computed, self.model.predicting(computed))))
        rest = rest[~torch.isin(rest, pred)]
        return torch.cat((pred, rest)), len(pred), offsets

    def block_outputs(self, out, k: int, offsets: torch.Tensor | None, logits: bool):
        """A per-row forward's outputs for this cohort's rows (the first ``k`` predict the block)
        in the lockstep forward's block-aligned form."""
        L, mask_id = self.e - self.s, self.mask_id
        if logits:
            block = out[:, :k]
            if self.use_confidence:  # the head's rule on logits: its score here
                conf, token = ops.confidence(block.float(), banned=mask_id, kind=self.score)
                return self._place_scores(token, conf, offsets, L)
            if offsets is None:
                return block
            full = block.new_zeros((block.shape[0], L, block.shape[2]))
            full[:, offsets] = block
            return full
        conf, token = out
        return self._place_scores(token[:, :k], conf[:, :k], offsets, L)

    def _place_scores(self, token: torch.Tensor, conf: torch.Tensor, offsets, L: int):
        if offsets is not None:  # delayed: the uncomputed block slots are committed
            t, c = token.new_full((token.shape[0], L), self.mask_id), conf.new_zeros((conf.shape[0], L))
            t[:, offsets], c[:, offsets] = token, conf
            token, conf = t, c
        if self.device_rule is not None:
            return token.to(self.x.device), conf.to(self.x.device)
        masked = self.x[:, self.s : self.e] == self.mask_id
        token, conf = token.cpu(), conf.cpu()
        return torch.where(masked, token, self.mask_id), torch.where(masked, conf, torch.zeros((), dtype=conf.dtype))

    # ---------------------------------------------------------------- decisions
    def decide(self, out) -> torch.Tensor:
        """Apply the rule to this step's block-aligned outputs and commit in place; returns the
        commit mask [B, L]."""
        if self.editing:
            return self._decide_editing(out)
        s, e, masked, quota = self.s, self.e, self.masked, self.quota
        if self.device_rule is not None:  # the backend's kernel decides and writes the block in place
            commit = self.commit(out[1], masked, quota, out[0], self.x[:, s:e], rule=self.device_rule)
        else:
            saved = (dict(self.state), self.gen.get_state()) if self.precision is not None else None
            x0, commit = self._rule(out)
            if self.precision is not None and (masked.any(-1) & ~(masked & ~commit).any(-1)).any():
                # these commits would finish some row's block: the full-precision model decides them
                self.state.clear()
                self.state.update(saved[0])
                self.gen.set_state(saved[1])
                self.window = self._plan(None)
                out = self.forward(self.window)
                x0, commit = self._rule(out)
            self.x[:, s:e] = torch.where(commit, x0, self.x[:, s:e])
            if self.logprobs is not None:
                self._record_logprobs(out, x0, commit)
        self.committed += commit.sum(-1)
        if self.pending is not None:
            self.pending += commit.sum(-1).cpu()
        if self.params.cache == "delayed" and commit.device.type == "cpu":
            self.last_commits = tuple((commit.any(0).nonzero().flatten() + self.block_start).tolist())
        lo = max(s, self.p_len)  # a block-causal first block may start inside the prompt
        self.commit_step[:, lo - self.p_len : e - self.p_len].masked_fill_(commit[:, lo - s :], self.last_forward)
        self.step += 1
        return commit

    def _rule(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        masked, p = self.masked, self.params
        if self.use_confidence:  # the head already banned the mask token
            step_in = strategies.StepInput(None, masked, self.quota, 0.0, self.gen, self.state, x0=out[0], conf=out[1])
        else:
            out[..., self.mask_id] = float("-inf")  # never commit the mask token
            step_in = strategies.on_logits_device(out, masked, self.quota, p.temperature, self.gen, self.state)
        x0, commit = self.rule(step_in)
        return x0.to(masked.device), commit.to(masked.device) & masked

    def _decide_editing(self, out) -> torch.Tensor:
        """One step of an editing rule (joint_threshold), batched over the rows: mask-to-token and
        token-to-token writes from the same forward, then each row's block end
        (:func:`strategies.joint_threshold_block_end`). Rows whose block is final decide nothing.
        Returns the mask-to-token commit mask [B, L] (edits are counted in ``self.edits``)."""
        s, e, p = self.s, self.e, self.params
        device = self.device_rule is not None  # the backend's edit kernel writes the block in place
        current = self.x[:, s:e] if device else self.x[:, s:e].clone()
        masked = self.masked  # masked at the start of the step (the rows still running)
        live = ~self.block_final
        has_mask = masked.any(-1)
        post = live & ~has_mask
        self.block_post += post.long()
        no_edit = torch.zeros_like(has_mask)  # whether the step decides does not depend on its edits
        decide, _ = strategies.joint_threshold_block_end(has_mask, no_edit, self.block_post, p.max_post_steps)
        deciding = live & decide
        masked = masked & deciding[:, None]
        editable = ~masked & ~(current == self.mask_id) & ~self.prompt_block & deciding[:, None]
        if device:
            token, conf = out if isinstance(out, tuple) else self._head(out)
            commit, edit = self.commit(conf, token, masked, editable, current)
        else:
            saved = (dict(self.state), self.gen.get_state()) if self.precision is not None else None
            x0, write = self._edit_rule(out, masked, current, editable)
            if self.precision is not None and (deciding & ~(masked & ~write).any(-1)).any():
                # some row's block could end after this step: the full-precision model decides it
                self.state.clear()
                self.state.update(saved[0])
                self.gen.set_state(saved[1])
                self.window = self._plan(None)
                out = self.forward(self.window)
                x0, write = self._edit_rule(out, masked, current, editable)
            commit, edit = write & masked, write & editable
            self.x[:, s:e] = torch.where(commit | edit, x0, current)
            if self.logprobs is not None:  # an edited slot's log-probability is its last write's
                self._record_logprobs(out, x0, commit | edit)
        _, ends = strategies.joint_threshold_block_end(has_mask, edit.any(-1), self.block_post, p.max_post_steps)
        self.block_final |= live & ends
        n_edits = edit.sum(-1)
        self.edits += n_edits
        self.post_steps += post.long()
        self._unread += torch.stack((n_edits.sum(), post.long().sum()))
        if not device or (self.step + 1) % self.sync_every == 0:  # the device rule: read at the syncs
            self.unreported[0] += int(self._unread[0])
            self.unreported[1] += int(self._unread[1])
            self._unread.zero_()
        self.committed += commit.sum(-1)
        if self.pending is not None:
            self.pending += (commit | edit).sum(-1).to(self.pending.device)
        if self.params.cache == "delayed" and not device:
            self.last_commits = tuple(((commit | edit).any(0).nonzero().flatten() + self.block_start).tolist())
        lo = max(s, self.p_len)
        written = (commit | edit)[:, lo - s :]
        self.commit_step[:, lo - self.p_len : e - self.p_len].masked_fill_(written, self.last_forward)
        self.step += 1
        return commit

    def _record_logprobs(self, logits: torch.Tensor, x0: torch.Tensor, written: torch.Tensor) -> None:
        """``params.logprobs``: for each generated slot this step wrote (``written`` [B, L] on the
        host), the log-softmax of this forward's block logits [B, L, V] at it (float32, float64
        logits in float64; the mask token excluded: its logit is -inf here, as the rules never
        write it; no temperature), read at the written token ``x0``, and the top alternatives."""
        lo = max(self.s, self.p_len) - self.s  # a block-causal first block may start inside the prompt
        rows, cols = written[:, lo:].nonzero(as_tuple=True)
        if len(rows) == 0:
            return
        dev = logits.device
        z = logits[rows.to(dev), (cols + lo).to(dev)]  # [N, V], the written slots only
        lp = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32).log_softmax(-1)
        chosen = lp.gather(-1, x0[rows, cols + lo].to(dev)[:, None]).squeeze(-1)
        slots = cols + (self.s + lo - self.p_len)
        self.token_logprob[rows, slots] = chosen.float().cpu()
        if self.top_ids.shape[-1]:
            top = lp.topk(self.top_ids.shape[-1], dim=-1)
            self.top_logprob[rows, slots] = top.values.float().cpu()
            self.top_ids[rows, slots] = top.indices.cpu()

    def logprobs_of(self, row: int, start: int, end: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """``params.logprobs``: generated slots [start, end) of ``row``: each token's log-probability
        and its top alternatives ``(id, log-probability)``, most likely first."""
        lps = self.token_logprob[row, start:end].tolist()
        ids, top = self.top_ids[row, start:end].tolist(), self.top_logprob[row, start:end].tolist()
        return lps, [list(zip(i, v)) for i, v in zip(ids, top)]

    def _head(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The confidence head's (argmax, score) from block logits [B, L, V] on their device (a
        caller that feeds logits to a device rule: ``validate``'s probes)."""
        conf, token = ops.confidence(
            logits if logits.dtype == torch.float64 else logits.float(), banned=self.mask_id, kind=self.score
        )
        return token.to(self.x.device), conf.to(self.x.device)

    def _edit_rule(self, out, masked, current, editable) -> tuple[torch.Tensor, torch.Tensor]:
        """The editing rule on the block's logits, on the logits' device; results on the host."""
        out[..., self.mask_id] = float("-inf")  # never write the mask token
        dev = out.device
        step_in = strategies.StepInput(
            out, masked.to(dev), self.quota.to(dev), self.params.temperature, self.gen, self.state,
            current=current.to(dev), editable=editable.to(dev),
        )  # fmt: skip
        x0, write = self.rule(step_in)
        write = write.to(masked.device) & (masked | editable)
        return x0.to(masked.device), write

    # ---------------------------------------------------------------- results
    def generated(self) -> torch.Tensor:
        """[B, G] the generated slots as they stand (with an editing rule, the current block's
        tokens are provisional: :meth:`final_lengths`)."""
        return self.x[:, self.p_len :]

    def final_lengths(self, generated: torch.Tensor | None = None) -> list[int]:
        """Per row, how many generated slots are final (can no longer change): up to the first
        slot still masked; with an editing rule, only blocks that have ended (the current block
        once the row's block is final), since any unmasked slot of the block may still be
        rewritten. ``generated``: :meth:`generated` on the host, if the caller has it."""
        gen = (self.generated() if generated is None else generated).cpu()
        g = gen.shape[1]
        is_mask = gen == self.mask_id
        first = torch.where(is_mask.any(-1), is_mask.long().argmax(-1), torch.full((self.b,), g))
        if not self.editing or self.finished:
            return first.tolist()
        if not self.started:
            return [0] * self.b
        ends = torch.where(self.block_final.cpu(), self.e, self.s) - self.p_len
        return torch.minimum(ends.clamp(0, g), first).tolist()


def _kept(out, slices: int):
    """A slice's outputs, copied when more slices follow: a replayed device graph returns its static
    buffers, which the next slice of the same shape (an uncached forward: no pool address in its
    signature) overwrites before the slices are joined."""
    if slices == 1:
        return out
    return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()


def forward_rows(cohorts: list[Cohort], run: Callable[[ForwardInputs], object], cached: bool) -> tuple[list, int, int]:
    """One forward for several cohorts at different blocks, each row with its own query window
    (``Model.forward_rows``), run by the engine's runner ``run``; returns each cohort's
    block-aligned outputs, the queries per row (padded) and the real queries in all. Rows are the
    cohorts' rows in order (pool rows 0..B-1); queries past a row's window are padding that
    writes a scratch slot (the last of the cached length) no key ever sees. The confidence head
    is used when every cohort uses it with one score kind, else logits for all."""
    model = cohorts[0].model
    b = sum(c.b for c in cohorts)
    plans = [c.queries() for c in cohorts]
    t = max(len(q) for q, _, _ in plans)
    uncached = not cached
    s_len = t if uncached else max(c.n for c in cohorts) + 1
    scratch = s_len - 1
    token_index = torch.full((b, t), scratch, dtype=torch.long)
    input_ids = torch.full((b, t), cohorts[0].mask_id, dtype=torch.long)
    positions = torch.zeros((b, t), dtype=torch.long)
    key_valid = torch.zeros((b, s_len), dtype=torch.bool)
    from_padding = model.spec.positions_from_padding
    r = 0
    for c, (q, _, _) in zip(cohorts, plans):
        w = len(q)
        ids = c.x[:, q].cpu()
        for i in range(c.b):
            pad = c.pads[i]
            token_index[r + i, :w], input_ids[r + i, :w] = q, ids[i]
            positions[r + i, :w] = (q - pad).clamp_min(0) if from_padding else q
            if uncached:
                key_valid[r + i, :w] = q >= pad
            else:
                key_valid[r + i, pad : c.n] = True
        r += c.b
    confidence = all(c.use_confidence for c in cohorts) and len({c.score for c in cohorts}) == 1
    block_size = cohorts[0].block_size
    k_max = max(k for _, k, _ in plans)
    out = run(
        ForwardInputs(
            input_ids,
            rows=RowWindows(token_index, positions, key_valid),
            cache=None if uncached else (0, b, s_len),
            select=torch.arange(min(k_max, t)) if confidence else None,
            score=cohorts[0].score,
            block_size=block_size,
        )  # fmt: skip
    )
    results, r = [], 0
    for c, (_, k, offsets) in zip(cohorts, plans):
        part = (out[0][r : r + c.b], out[1][r : r + c.b]) if confidence else out[r : r + c.b]
        results.append(c.block_outputs(part, k, offsets, logits=not confidence))
        c.block_start = c.s
        r += c.b
    return results, t, sum(c.b * len(q) for c, (q, _, _) in zip(cohorts, plans))
