"""Continuous batching at step granularity: every running request advances one scheduler step
per engine step, all of them in ONE forward, each at its own block.

A request's row keeps what ``generate_batch`` keeps for a batch of one: its sequence, current
block, step in the block, schedule, rule state, random generator and cache-policy counters, so
its greedy output equals ``LLM.generate`` of that prompt alone whatever runs beside it. The
forward gives every row its own query window through the per-row ``token_index`` [B, T] of the
IR's attention (``Model.forward_rows``): rows whose windows differ in length are padded to the
longest, the padding queries writing a scratch cache slot no key ever sees. (Padding rather than
shape buckets: a bucket is a separate forward over a contiguous range of cache rows, and rows of
one engine mostly share a cache policy, so their windows match; the engine counts the padded
share in ``stats.padded_tokens``.)

Rows hold KV-cache slots 0..B-1 of one preallocated pool; a retiring row's slot is refilled by
moving the last row into it, so the running rows are always a contiguous view. A row retires at
the step whose committed prefix (the generated tokens up to the first position still masked,
which can no longer change) holds an EOS, a stop string or ``max_tokens`` tokens.

Thread model: ``submit`` and ``abort`` may be called from any thread; ``step`` from one.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dinfer_rt import cache_policy, strategies
from dinfer_rt.cache_policy import Spans
from dinfer_rt.errors import GenerationError
from dinfer_rt.generate import check_token_ids
from dinfer_rt.ir import ops
from dinfer_rt.model import KVCache, Model
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.stopping import before_eos, cut_at_stop, first_stop


class QueueFull(GenerationError):
    """The wait queue is at its bound (``max_queue``): the server answers 429."""


class EngineClosed(GenerationError):
    """The engine is draining (shutdown): no new requests."""


Listener = Callable[["Request", str], None]
"""``(request, event)`` with event "update" (more tokens became final) or "finish"; called on
the engine's thread, so it must only hand the event on (the server posts it to its loop)."""


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    listener: Listener | None = None
    return_canvas: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    status: str = "waiting"  # waiting | running | finished
    finish_reason: str | None = None  # stop | length | abort | error
    error: BaseException | None = None
    final_ids: list[int] = field(default_factory=list)  # generated ids that can no longer change
    canvas: list[int] | None = None  # the whole generated region after the last step (return_canvas)
    output_ids: list[int] = field(default_factory=list)  # at finish: cut at EOS, stop string, max_tokens
    text: str = ""
    forwards: int = 0  # forwards this request took part in
    admitted: float | None = None
    finished: float | None = None

    @property
    def done(self) -> bool:
        return self.status == "finished"


@dataclass
class EngineStats:
    steps: int = 0  # forwards run (one per engine step with running rows)
    row_forwards: int = 0  # sum over steps of the rows in the forward
    committed: int = 0  # tokens committed
    computed_tokens: int = 0  # query slots computed, padding included
    padded_tokens: int = 0  # of which padding
    finished: int = 0
    failed: int = 0


class _Row:
    """One running request's decoding state (what generate_batch keeps for a batch of one)."""

    def __init__(self, req: Request, model: Model, slot: int) -> None:
        p = req.params
        self.req, self.p, self.slot, self.mask_id = req, p, slot, model.mask_id
        self.p_len, self.n = len(req.prompt), len(req.prompt) + p.gen_length
        self.lb = p.block_length
        self.x = torch.cat((torch.tensor(req.prompt, dtype=torch.long), torch.full((p.gen_length,), model.mask_id)))
        self.rule = strategies.build(p)
        self.scheduled = p.strategy in strategies.SCHEDULED
        self.per_block = p.steps_per_block()
        self.gen = torch.Generator().manual_seed(p.seed)
        self.use_confidence = p.confidence_head and p.strategy in strategies.STATS_ONLY and p.temperature == 0
        self.score = strategies.SCORE_KIND.get(p.strategy, "max")
        self.nfe = 0
        self.pending = 0  # adaptive / anchored cache: tokens committed since the last full refresh
        self.prev_start: int | None = None  # block-causal cache: the previous block's start
        self.last_commits: tuple[int, ...] = ()  # delayed cache: the slots the last step committed
        self.pred_offsets: torch.Tensor | None = None  # delayed: the block offsets computed (None: all)
        self.s = (self.p_len // self.lb) * self.lb if model.spec.block_causal else self.p_len
        self._start_block(model.mask_id)

    def _start_block(self, mask_id: int) -> None:
        self.e = min(self.s + self.lb, self.n)
        masked = (self.x[self.s : self.e] == mask_id).sum()[None]
        self.plan = strategies.linear_schedule(masked, self.per_block)
        self.state: dict = {}
        self.step = 0

    def advance(self, mask_id: int) -> bool:
        """Move past finished blocks (checked every ``sync_every`` steps, as the scheduler does);
        False when every block is done."""
        while self.s < self.n:
            if self.step % self.p.sync_every == 0 and not bool((self.x[self.s : self.e] == mask_id).any()):
                self.s += self.lb
                if self.s < self.n:
                    self._start_block(mask_id)
                continue
            if self.step >= 4 * self.lb + self.per_block:
                raise GenerationError(f"block [{self.s}, {self.e}) did not finish in {self.step} steps")
            return True
        return False

    def window(self, block_causal: bool) -> Spans:
        """Slots this step computes under the row's cache policy (``cache_policy.step_window``)."""
        active: tuple[int, ...] = ()
        if self.p.cache == "delayed":
            masked = (self.x[self.s : self.e] == self.mask_id).nonzero().flatten() + self.s
            active = tuple(sorted(set(masked.tolist()) | set(self.last_commits)))
        spans, restart = cache_policy.step_window(
            self.p, s=self.s, e=self.e, n=self.n, prompt_len=self.p_len, step=self.step, forward=self.nfe,
            pending=self.pending, block_causal=block_causal, prev_start=self.prev_start, active=active,
        )  # fmt: skip
        if block_causal and self.step == 0 and self.p.cache != "none":
            self.prev_start = self.s
        if restart:
            self.pending = 0
        return spans

    def queries(self, block_causal: bool, shift: bool) -> torch.Tensor:
        """This step's slots, in the order the forward takes them: first the slots whose outputs
        predict the block (the block itself, under ``delayed`` its computed slots, ``pred_offsets``;
        for Dream the slot before each), then the rest."""
        self.nfe += 1
        spans = self.window(block_causal)
        self.pred_offsets = None
        if not any(lo <= self.s and self.e <= hi for lo, hi in spans):  # delayed: part of the block
            at = torch.cat([torch.arange(lo, hi) for lo, hi in spans])
            self.pred_offsets = at[(at >= self.s) & (at < self.e)] - self.s
        if shift:  # position i is predicted by the output at i - 1
            spans = tuple((max(0, lo - 1), hi) for lo, hi in spans)
        block = torch.arange(self.s, self.e) if self.pred_offsets is None else self.pred_offsets + self.s
        pred = block - 1 if shift else block
        rest = torch.cat([torch.arange(lo, hi) for lo, hi in spans])
        if len(spans) > 1:  # Dream's shifted spans may overlap
            rest = rest.unique()
        if self.pred_offsets is None:
            rest = rest[(rest < pred[0]) | (rest > pred[-1])]
        else:
            rest = rest[~torch.isin(rest, pred)]
        return torch.cat((pred, rest))


def _scatter(values: torch.Tensor, offsets: torch.Tensor, width: int, fill) -> torch.Tensor:
    """[1, k, ...] outputs at block ``offsets`` placed into a [1, width, ...] block filled with ``fill``."""
    out = values.new_full((1, width, *values.shape[2:]), fill)
    out[:, offsets] = values
    return out


def check_request(
    prompt: list[int],
    params: SamplingParams,
    max_tokens: int | None,
    *,
    vocab: int,
    max_model_len: int,
    block_size: int | None,
    has_tokenizer: bool,
) -> int:
    """The engine's admission checks: a ``GenerationError`` naming the field, else ``max_tokens``
    (default ``params.gen_length``)."""
    params.validate()
    if params.cfg_scale > 0:
        raise GenerationError("cfg_scale: classifier-free guidance is not served by the engine (LLM.generate has it)")
    if params.precision_schedule is not None:
        raise GenerationError(
            "precision_schedule: not served by the engine yet (LLM.generate has it); serve a quantised "
            "model with --quantization instead"
        )
    if block_size is not None and params.block_length != block_size:
        raise GenerationError(
            f"block_length {params.block_length}: this block-causal model is served with block_length "
            f"{block_size} only (its attention mask is compiled for it)"
        )
    if not prompt:
        raise GenerationError("prompt: at least one token is needed")
    check_token_ids([prompt], vocab)
    max_tokens = params.gen_length if max_tokens is None else max_tokens
    if not 1 <= max_tokens <= params.gen_length:
        raise GenerationError(f"max_tokens {max_tokens} must be in [1, gen_length {params.gen_length}]")
    if len(prompt) + params.gen_length > max_model_len:
        raise GenerationError(
            f"prompt ({len(prompt)} tokens) + {params.gen_length} generated = {len(prompt) + params.gen_length} "
            f"tokens exceeds the max model length {max_model_len}"
        )
    if params.stop and not has_tokenizer:
        raise GenerationError("stop: stop strings need the model's tokenizer (loaded without one)")
    return max_tokens


def notify(req: Request, event: str) -> None:
    """Hand an event to the request's listener; a listener that fails (its client's event loop
    gone) must not stop the engine, so its error only detaches it."""
    if req.listener is not None:
        try:
            req.listener(req, event)
        except Exception:
            req.listener = None


class Engine:
    """Continuous batching over one model: ``submit`` requests, call ``step`` until idle.

    ``max_num_seqs`` rows run at once; ``max_num_batched_tokens`` bounds the query slots of one
    forward at admission (a row's first forward computes its whole sequence), so a long prompt
    waits for room instead of stalling every running row; ``max_queue`` bounds the waiting
    requests (``QueueFull`` past it); ``max_model_len`` sizes the KV-cache pool (default: the
    model's max length). Block-causal models (LLaDA2) compile their mask for one block size:
    ``block_length`` (requests with another are refused)."""

    def __init__(
        self,
        model: Model,
        *,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 4096,
        max_queue: int | None = None,
        max_model_len: int | None = None,
        block_length: int | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or (max_queue is not None and max_queue < 0):
            raise GenerationError("Engine: max_num_seqs and max_num_batched_tokens must be >= 1, max_queue >= 0")
        self.model = model
        self.max_num_seqs, self.max_num_batched_tokens, self.max_queue = max_num_seqs, max_num_batched_tokens, max_queue
        self.max_model_len = min(max_model_len or model.spec.max_length, model.spec.max_length)
        self.block_size = (block_length or SamplingParams().block_length) if model.spec.block_causal else None
        self.mask_id, self.eos = model.mask_id, set(model.eos_ids)
        self.cache = model.new_cache(max_num_seqs, self.max_model_len + 1)  # + a scratch slot for padding
        self.rows: list[_Row] = []  # slot order
        self.waiting: deque[Request] = deque()
        self.stats = EngineStats()
        self._lock = threading.Lock()
        self._aborted: set[str] = set()
        self._ids = itertools.count()
        self.closed = False

    # ---------------------------------------------------------------- requests
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        max_tokens: int | None = None,
        request_id: str | None = None,
        listener: Listener | None = None,
        return_canvas: bool = False,
    ) -> Request:
        """Validate and queue a request (ids). ``max_tokens`` cuts the output (default
        ``params.gen_length``, which must hold it). Raises ``GenerationError`` naming the field."""
        max_tokens = self.check_request(prompt, params, max_tokens)
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt), params, max_tokens, listener, return_canvas)
        with self._lock:
            if self.closed:
                raise EngineClosed("the engine is shutting down and admits no new requests")
            if self.max_queue is not None and len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the wait queue is full ({len(self.waiting)} of max_queue {self.max_queue})")
            self.waiting.append(req)
        return req

    def check_request(self, prompt: list[int], params: SamplingParams, max_tokens: int | None) -> int:
        """What ``submit`` refuses, without queueing (a front end over replicas checks it before
        routing): a ``GenerationError`` naming the field, else the request's ``max_tokens``."""
        return check_request(
            prompt, params, max_tokens, vocab=self.model.spec.vocab, max_model_len=self.max_model_len,
            block_size=self.block_size, has_tokenizer=self.model.tokenizer is not None,
        )  # fmt: skip

    def abort(self, request_id: str) -> None:
        """Cancel a request (a client went away): its slot is freed at the next step."""
        with self._lock:
            self._aborted.add(request_id)

    def close(self) -> None:
        """Stop admitting: ``submit`` raises ``EngineClosed``; queued requests are failed with it."""
        with self._lock:
            self.closed = True
            queued, self.waiting = list(self.waiting), deque()
        for req in queued:
            self._finish(req, "abort", EngineClosed("the server shut down before this request started"))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.rows)

    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self) -> list[Request]:
        """Admit, run one forward for every running row, apply each row's rule, retire finished
        rows. Returns the requests finished in this step. An exception inside the step fails
        only the requests of this step."""
        finished: list[Request] = []
        self._drop_aborted(finished)
        windows: list[torch.Tensor] = []
        for row in list(self.rows):  # rows that finished their last block retire now
            try:
                if not row.advance(self.mask_id):
                    self._retire(row, "length", finished)
            except GenerationError as err:
                self._retire(row, "error", finished, err)
        for row in self.rows:
            windows.append(row.queries(self.model.spec.block_causal, self.model.spec.shift_logits))
        self._admit(windows, finished)
        if not self.rows:
            return finished
        try:
            self._forward_and_commit(windows)
        except Exception as err:  # fail this step's requests, keep serving
            for row in list(self.rows):
                self._retire(row, "error", finished, err)
            return finished
        for row in list(self.rows):
            self._check_final(row, finished)
        return finished

    def _drop_aborted(self, finished: list[Request]) -> None:
        with self._lock:
            aborted, self._aborted = self._aborted, set()
            if aborted:
                keep = deque(r for r in self.waiting if r.id not in aborted)
                gone = [r for r in self.waiting if r.id in aborted]
                self.waiting = keep
            else:
                gone = []
        for req in gone:
            self._finish(req, "abort")
            finished.append(req)
        for row in [r for r in self.rows if r.req.id in aborted]:
            self._retire(row, "abort", finished)

    def _admit(self, windows: list[torch.Tensor], finished: list[Request]) -> None:
        used = sum(len(w) for w in windows)
        while len(self.rows) < self.max_num_seqs:
            with self._lock:
                if not self.waiting:
                    return
                req = self.waiting[0]
                need = len(req.prompt) + req.params.gen_length  # its first forward refreshes everything
                if self.rows and used + need > self.max_num_batched_tokens:
                    return
                self.waiting.popleft()
            try:
                row = _Row(req, self.model, len(self.rows))
                if not row.advance(self.mask_id):
                    raise GenerationError("nothing to generate")
                w = row.queries(self.model.spec.block_causal, self.model.spec.shift_logits)
            except Exception as err:
                self._finish(req, "error", err)
                finished.append(req)
                continue
            req.status, req.admitted = "running", time.perf_counter()
            self.rows.append(row)
            windows.append(w)
            used += len(w)

    def _forward_and_commit(self, windows: list[torch.Tensor]) -> None:
        m, rows = self.model, self.rows
        b = len(rows)
        t = max(len(w) for w in windows)
        s_len = max(r.n for r in rows) + 1
        scratch = s_len - 1  # never a valid key: padding queries write here
        token_index = torch.full((b, t), scratch, dtype=torch.long)
        input_ids = torch.full((b, t), self.mask_id, dtype=torch.long)
        positions = torch.zeros((b, t), dtype=torch.long)
        key_valid = torch.zeros((b, s_len), dtype=torch.bool)
        for i, (row, w) in enumerate(zip(rows, windows)):
            token_index[i, : len(w)], input_ids[i, : len(w)], positions[i, : len(w)] = w, row.x[w], w
            key_valid[i, : row.n] = True
        cache = KVCache([k[:b, :s_len] for k in self.cache.k], [v[:b, :s_len] for v in self.cache.v])
        if not m.spec.block_causal and all(r.p.cache == "none" for r in rows):
            # every row computes its whole sequence: no cache to write, keys are the row's own queries
            cache, key_valid = None, torch.arange(t)[None, :] < torch.tensor([len(w) for w in windows])[:, None]
        lb = max(r.e - r.s for r in rows)
        confidence = all(r.use_confidence for r in rows) and len({r.score for r in rows}) == 1
        if confidence:
            conf, token = m.forward_rows(
                input_ids, token_index, positions, key_valid, cache,
                select=torch.arange(min(lb, t)), score=rows[0].score, block_size=self.block_size,
            )  # fmt: skip
            conf, token = conf.cpu(), token.cpu()
            logits = None
        else:
            logits = m.forward_rows(input_ids, token_index, positions, key_valid, cache, block_size=self.block_size)
        st = self.stats
        st.steps += 1
        st.row_forwards += b
        st.computed_tokens += b * t
        st.padded_tokens += b * t - sum(len(w) for w in windows)
        for i, row in enumerate(rows):
            row.req.forwards += 1
            L = row.e - row.s
            block = row.x[row.s : row.e]
            masked = (block == self.mask_id)[None]
            quota = row.plan[:, min(row.step, row.per_block - 1)] if row.scheduled else torch.ones(1, dtype=torch.long)
            k = L if row.pred_offsets is None else len(row.pred_offsets)  # outputs predicting the block
            if row.use_confidence:
                if logits is not None:
                    c, tk = ops.confidence(logits[i : i + 1, :k].float(), banned=self.mask_id, kind=row.score)
                    c, tk = c.cpu(), tk.cpu()
                else:
                    c, tk = conf[i : i + 1, :k], token[i : i + 1, :k]
                if row.pred_offsets is not None:  # delayed: the uncomputed block slots are committed
                    c, tk = _scatter(c, row.pred_offsets, L, 0), _scatter(tk, row.pred_offsets, L, self.mask_id)
                x0 = torch.where(masked, tk, self.mask_id)
                probs = torch.where(masked, c, torch.zeros((), dtype=c.dtype))
                step_in = strategies.StepInput(None, masked, quota, 0.0, row.gen, row.state, x0=x0, conf=probs)
            else:
                out = logits[i : i + 1, :k].cpu().clone()
                if row.pred_offsets is not None:
                    out = _scatter(out, row.pred_offsets, L, 0)
                out[..., self.mask_id] = float("-inf")
                step_in = strategies.StepInput(out, masked, quota, row.p.temperature, row.gen, row.state)
            x0, commit = row.rule(step_in)
            commit &= masked
            row.x[row.s : row.e] = torch.where(commit[0], x0[0], block)
            if row.p.cache == "delayed":
                row.last_commits = tuple((commit[0].nonzero().flatten() + row.s).tolist())
            n_commit = int(commit.sum())
            row.pending += n_commit
            st.committed += n_commit
            row.step += 1

    # ---------------------------------------------------------------- retirement
    def _check_final(self, row: _Row, finished: list[Request]) -> None:
        """Publish the newly final tokens; retire on EOS, a stop string or max_tokens."""
        req, gen = row.req, row.x[row.p_len :]
        masked = (gen == self.mask_id).nonzero()
        final = gen[: int(masked[0]) if len(masked) else len(gen)].tolist()
        if req.return_canvas:
            req.canvas = gen.tolist()
        grew = len(final) > len(req.final_ids)
        req.final_ids = final
        if grew or req.return_canvas:
            notify(req, "update")
        if not grew:
            return
        kept = before_eos(final, self.eos)
        if len(kept) < len(final):
            self._retire(row, "stop", finished)
        elif len(final) >= req.max_tokens:
            self._retire(row, "length", finished)
        elif req.params.stop and first_stop(self.model.tokenizer.decode(kept), req.params.stop) >= 0:
            self._retire(row, "stop", finished)

    def _retire(self, row: _Row, reason: str, finished: list[Request], err: BaseException | None = None) -> None:
        """Free the row's slot (the last row moves into it) and finish its request."""
        i, last = self.rows.index(row), len(self.rows) - 1
        if i != last:
            moved = self.rows[last]
            for buf in (*self.cache.k, *self.cache.v):
                buf[i, : moved.n].copy_(buf[last, : moved.n])
            moved.slot = i
            self.rows[i] = moved
        self.rows.pop()
        self._finish(row.req, reason, err)
        finished.append(row.req)

    def _finish(self, req: Request, reason: str, err: BaseException | None = None) -> None:
        ids = before_eos(req.final_ids, self.eos)[: req.max_tokens]
        tok = self.model.tokenizer
        text = tok.decode(ids) if tok is not None else ""
        if req.params.stop and tok is not None:
            keep, text = cut_at_stop(tok.decode, ids, text, req.params.stop)
            ids = ids[:keep]
        req.output_ids, req.text = ids, text
        req.finish_reason, req.error, req.status, req.finished = reason, err, "finished", time.perf_counter()
        if reason == "error":
            self.stats.failed += 1
        else:
            self.stats.finished += 1
        notify(req, "finish")

    # ---------------------------------------------------------------- in-process use
    def run_until_idle(self, max_steps: int | None = None) -> None:
        steps = 0
        while self.has_work():
            self.step()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                return

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, max_tokens: int | None = None
    ) -> list[Request]:
        """Submit every prompt and step until all are finished (in-process continuous batching)."""
        reqs = [self.submit(p, params, max_tokens=max_tokens) for p in prompts]
        self.run_until_idle()
        return reqs
