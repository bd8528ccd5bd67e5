"""A loaded model: spec, weights, tokenizer and compiled graphs on one backend.

``forward`` is the one entry point for every family. It always returns per-position
predictions (Dream's shifted logits are re-aligned so position i predicts token i), and
with a :class:`KVCache` it computes only the requested positions, reading every other
position's K/V from the cache and splicing the fresh K/V in. A :class:`PagedKV` does the same
over a paged pool (blocks of positions named by a block table) that rows can share.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dinfer_rt import quant
from dinfer_rt.backend import Backend
from dinfer_rt.errors import ConfigError, DinferError, GenerationError
from dinfer_rt.executor import Executable
from dinfer_rt.ir import Graph
from dinfer_rt.lowering import lower
from dinfer_rt.model_spec import EOS_TOKENS, ModelSpec
from dinfer_rt.tokenizer import Tokenizer


def _check_compute(want: torch.Tensor, n: int) -> bool:
    if len(want) > 1 and not bool((want[1:] > want[:-1]).all()):
        raise GenerationError("compute must list positions in increasing order, each once")
    if len(want) and not 0 <= int(want[0]) <= int(want[-1]) < n:
        raise GenerationError(f"compute holds positions outside [0, {n})")
    return True


def _covers(want: torch.Tensor, select: torch.Tensor) -> bool:
    """Every position of ``select`` is in the sorted ``want`` (a lookup, not ``isin``'s ~100 us)."""
    if not len(select):
        return True
    if not len(want):
        return False
    at = torch.searchsorted(want, select).clamp_max(len(want) - 1)
    return bool((want[at] == select).all())


@dataclass
class KVCache:
    """Per-layer K/V buffers [B, S, KV, D], indexed by sequence position."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.k[0].shape[1]

    def rows(self, r0: int, r1: int) -> KVCache:
        """Rows [r0, r1) of every buffer, as views: a forward on them writes this cache in place."""
        return KVCache([k[r0:r1] for k in self.k], [v[r0:r1] for v in self.v])


@dataclass
class PagedKV:
    """A paged KV cache: per-layer pools [NB, P, KV, D] and a block table [B, NBT] (int32) that
    puts row b's position p at ``pool[table[b, p // P], p % P]``; the forward reads positions
    0..``length``-1. Blocks are shared by the engine's rows and its prefix cache; block 0 is the
    trash block padding writes land in."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    table: torch.Tensor
    length: int

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    def rows(self, r0: int, r1: int) -> PagedKV:
        """Rows [r0, r1): the same pools under those rows of the table."""
        return PagedKV(self.k, self.v, self.table[r0:r1], self.length)


def _check_paged(cache: PagedKV, batch: int, length: int, where: str) -> None:
    """A clear error for pools, a block table or a length the paged graph cannot use."""
    if (
        not cache.k
        or len(cache.k) != len(cache.v)
        or not all(isinstance(x, torch.Tensor) for x in (*cache.k, *cache.v))
    ):
        raise GenerationError(
            f"{where}: paged KV needs one K and one V pool tensor per layer, got {len(cache.k)} and {len(cache.v)}"
        )
    if any(x.dim() != 4 for x in (*cache.k, *cache.v)):
        shapes = sorted({tuple(x.shape) for x in (*cache.k, *cache.v)})
        raise GenerationError(f"{where}: paged KV pools must be [blocks, positions, kv_heads, head_dim], got {shapes}")
    if not isinstance(cache.table, torch.Tensor):
        raise GenerationError(
            f"{where}: block table must be an int32 [B, NBT] tensor, got {type(cache.table).__name__}"
        )
    t, p, nb = cache.table, cache.block_size, cache.k[0].shape[0]
    if t.dim() != 2 or t.dtype not in (torch.int32, torch.int64):
        raise GenerationError(
            f"{where}: block table must be an int32 (or int64) [B, NBT] tensor, got {t.dtype} {list(t.shape)}"
        )
    if t.shape[0] != batch:
        raise GenerationError(f"{where}: block table has {t.shape[0]} rows, the batch is {batch}")
    if cache.length != length:
        raise GenerationError(f"{where}: paged KV length {cache.length} differs from the sequence length {length}")
    if t.shape[1] * p < length:
        raise GenerationError(
            f"{where}: block table of {t.shape[1]} blocks x {p} positions covers {t.shape[1] * p} < {length} positions"
        )
    if t.device.type == "cpu" and t.numel():
        low, high = (int(x) for x in torch.aminmax(t))
        if not 0 <= low <= high < nb:
            raise GenerationError(f"{where}: block table holds block ids outside [0, {nb}) (min {low}, max {high})")


class CachePool:
    """KV caches lent per shape and taken back, so consecutive ``generate`` calls of one shape
    write the same buffers. A device graph binds the caches by address: with a fresh cache per
    call (per prompt at batch 1) every call captured its graphs anew (measured on an H200: cached
    decoding with ``DINFER_GRAPHS=1`` ran at 0.15-0.35x of uncached). A lent cache is zeroed, as
    a new one is; at most ``keep`` idle caches are held (the most recently returned; 0, where no
    graphs replay, frees each cache when its call ends, as before); a cache in use is never lent
    twice (concurrent callers get their own)."""

    def __init__(self, make: Callable[[int, int], KVCache], keep: int = 2) -> None:
        self.make, self.keep = make, keep
        self.idle: list[KVCache] = []
        self.lock = threading.Lock()

    def acquire(self, batch: int, length: int) -> KVCache:
        with self.lock:
            for i, cache in enumerate(self.idle):
                if (cache.k[0].shape[0], cache.length) == (batch, length):
                    del self.idle[i]
                    break
            else:
                cache = None
        if cache is None:
            return self.make(batch, length)
        for t in (*cache.k, *cache.v):
            t.zero_()
        return cache

    def idle_bytes(self) -> int:
        """Bytes of the idle caches held for reuse (memory a new batch may count as its own)."""
        with self.lock:
            return sum(t.numel() * t.element_size() for c in self.idle for t in (*c.k, *c.v))

    def release(self, cache: KVCache) -> None:
        with self.lock:
            self.idle.append(cache)
            while len(self.idle) > self.keep:
                self.idle.pop(0)


class Model:
    def __init__(
        self,
        path: Path,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        tokenizer: Tokenizer | None,
        backend: Backend,
        dtype: torch.dtype,
        disable_passes: tuple[str, ...] = (),
        tensor_parallel=None,
        weight_format: str | None = None,
    ) -> None:
        self.path, self.spec, self.weights, self.tokenizer = path, spec, weights, tokenizer
        self.backend, self.dtype = backend, dtype
        self.disable_passes = disable_passes  # pass names skipped for this model (e.g. an unfused twin)
        self.tensor_parallel = tensor_parallel  # dinfer_rt.passes.shard.TensorParallel, or None: one rank
        self.bytes_read = 0  # checkpoint bytes the loader read for this model (a shard reads its slices)
        # The format every forward's projections use unless a precision is asked for: None (the
        # dtype's float weights), "int8" / "fp8" (quantised at load), "gptq4" (a GPTQ checkpoint).
        self.weight_format = weight_format
        self.block_size = spec.default_block_size
        self._compiled: dict[tuple, Executable] = {}  # (cached, block size, head, score, per_row, format[, "paged"])
        # the scheduler's KV caches: kept for the next call only where graphs bind their addresses
        self.cache_pool = CachePool(self.new_cache, keep=2 if backend.replays_graphs() else 0)
        self.pass_counts: dict[str, int] = {}  # rewrites per pass in the last compiled graph
        self._small: dict[tuple, object] = {}  # see _memo

    # ---------------------------------------------------------------- graphs
    def graph(self, cached: bool = False, block_size: int | None = None) -> Graph:
        return self.executable(cached, block_size).graph

    def executable(
        self,
        cached: bool,
        block_size: int | None = None,
        head: str = "logits",
        score: str = "max",
        per_row: bool = False,
        precision: str | None = None,
        paged: bool = False,
    ) -> Executable:
        """The compiled forward for one variant. ``precision`` ("int8", "fp8"; None: the model's
        own ``weight_format``) picks the projections' weight format: a precision schedule keeps
        one executable per precision over the float weights plus their quantised copies.
        ``paged``: the KV comes as pools and a block table (:class:`PagedKV`)."""
        bs = (block_size or self.block_size) if self.spec.block_causal else None
        fmt = self.weight_format if precision is None else precision
        key: tuple = (cached, bs, head, score if head == "confidence" else "", per_row, fmt)
        if paged:  # unpaged keys keep their six fields (tests and benchmarks index them)
            key += ("paged",)
        if key not in self._compiled:
            formats = self.backend.capabilities().weight_formats
            if fmt is not None and fmt not in formats:
                from dinfer_rt.errors import BackendError

                raise BackendError(
                    f"backend {self.backend.describe()} has no {fmt} weight kernels; it supports: "
                    f"{', '.join(formats) or 'none'}"
                )
            if fmt != self.weight_format:
                self._quantized_copies(fmt)
            mask = self.mask_id if head == "confidence" else None
            graph = lower(
                self.spec,
                self.dtype,
                cached=cached,
                block_size=bs,
                head=head,
                mask_id=mask,
                score=score,
                per_row=per_row,
                weight_format=fmt,
                paged=paged,
            )
            if self.tensor_parallel is not None:  # shard before fusion: fused kernels see local shapes
                from dinfer_rt.passes.shard import shard_graph

                graph = shard_graph(graph, self.spec, self.tensor_parallel)
            graph, self.pass_counts = self.backend.optimize(graph, self.weights, self.disable_passes)
            self._compiled[key] = self.backend.compile(graph, self.weights)
        return self._compiled[key]

    def _quantized_copies(self, fmt: str) -> None:
        """Add ``fmt``-quantised copies of the decoder projections beside the float weights (once)."""
        if self.weight_format is not None:
            raise ConfigError(
                f"{self.path}: the model holds {self.weight_format} weights only (loaded with quantization="
                f"{self.weight_format!r}); a {fmt} forward needs the float weights: load without quantization"
            )
        quant.check_format(fmt, "precision")
        if self.tensor_parallel is not None:
            raise ConfigError("quantised forwards under tensor parallelism are not supported yet")
        for name in [n for n in self.weights if quant.is_quantizable(n)]:
            qname, sname = quant.quantized_names(name, fmt)
            if qname not in self.weights:
                self.weights[qname], self.weights[sname] = (
                    t.to(self.weights[name].device) for t in quant.quantize(self.weights[name], fmt)
                )

    # ---------------------------------------------------------------- ids
    @property
    def mask_id(self) -> int:
        mid = self.spec.mask_id
        if mid is None and self.tokenizer is not None:
            mid = self.tokenizer.special_id("mask_token")
        if mid is None:
            raise DinferError(
                f"{self.path}: no mask token id (config 'mask_token_id' or tokenizer_config 'mask_token')"
            )
        return mid

    @property
    def eos_ids(self) -> tuple[int, ...]:
        from dinfer_rt.tokenizer import stop_ids

        config_eos = (*self.spec.eos_ids, *getattr(self, "generation_eos_ids", ()))
        return stop_ids(self.tokenizer, config_eos, EOS_TOKENS.get(self.spec.family, ()))

    @property
    def pad_id(self) -> int:
        if self.spec.pad_id is not None:
            return self.spec.pad_id
        return self.eos_ids[0] if self.eos_ids else 0

    # ---------------------------------------------------------------- forward
    def positions(self, attention_mask: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
        """RoPE positions: 0..N-1 (LLaDA, LLaDA-MoE, LLaDA2) or cumsum(mask)-1 with padding (Dream)."""
        b, n = shape
        if attention_mask is not None and self.spec.positions_from_padding:
            return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        return torch.arange(n).expand(b, n)

    def new_cache(self, batch: int, length: int) -> KVCache:
        s = self.spec
        for name, v in (("batch", batch), ("length", length)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise GenerationError(f"new_cache: {name} must be an int >= 1, got {v!r}")
        kv = s.n_kv_heads if self.tensor_parallel is None else self.tensor_parallel.kv_heads(s)
        shape = (batch, length, kv, s.head_dim)
        dev = self.backend.device()
        return KVCache(
            [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(s.n_layers)],
            [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(s.n_layers)],
        )

    def new_paged_pool(self, num_blocks: int, block_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed per-layer K and V pools [num_blocks, block_size, KV, D] for :class:`PagedKV`
        (KV: this rank's share under tensor parallelism, as ``new_cache``)."""
        s = self.spec
        kv = s.n_kv_heads if self.tensor_parallel is None else self.tensor_parallel.kv_heads(s)
        shape = (num_blocks, block_size, kv, s.head_dim)
        dev = self.backend.device()
        return (
            [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(s.n_layers)],
            [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(s.n_layers)],
        )

    def _bind_cache(self, inputs: dict[str, torch.Tensor], cache: KVCache | PagedKV) -> None:
        """Add the cache's per-layer tensors (and a paged cache's block table) to ``inputs``."""
        if len(cache.k) != self.spec.n_layers or len(cache.v) != self.spec.n_layers:
            raise GenerationError(
                f"the KV cache has {len(cache.k)} K and {len(cache.v)} V tensors, the model {self.spec.n_layers} layers"
            )
        for i in range(self.spec.n_layers):
            inputs[f"k_cache.{i}"], inputs[f"v_cache.{i}"] = cache.k[i], cache.v[i]
        if isinstance(cache, PagedKV):
            inputs["block_table"] = cache.table.to(self.backend.device(), torch.int32)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        cache: KVCache | PagedKV | None = None,
        compute: torch.Tensor | None = None,
        block_size: int | None = None,
        precision: str | None = None,
    ) -> torch.Tensor:
        """Logits [B, len(compute), V] predicting the tokens at positions ``compute``.

        ``input_ids`` [B, N] is the whole sequence; ``attention_mask`` [B, N] marks real
        tokens (1) versus padding (0). ``compute`` (default: all N) selects the positions
        to run; with ``cache`` every other position's K/V is read from it.
        """
        inputs, run, want = self._inputs(input_ids, attention_mask, cache, compute)
        paged = isinstance(cache, PagedKV)
        logits = self.executable(cache is not None, block_size, precision=precision, paged=paged)(inputs)["logits"]
        if self.spec.shift_logits:
            logits = logits[:, self._predicted_by(run, want).to(logits.device)]
        return logits

    @torch.no_grad()
    def confidence(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        select: torch.Tensor,
        score: str = "max",
        cache: KVCache | PagedKV | None = None,
        compute: torch.Tensor | None = None,
        block_size: int | None = None,
        precision: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(score, argmax) [B, len(select)] at positions ``select`` (a subset of ``compute``), mask
        token banned, through the confidence head; ``score`` is "max" (top-1 probability),
        "margin" or "entropy" (negative entropy). The LM head runs only at those positions and,
        fused, never builds their [positions x vocab] probabilities."""
        inputs, run, want = self._inputs(input_ids, attention_mask, cache, compute)
        select = select.long()
        # memoised while the same tensors come back (the scheduler's per-window select / compute)
        key = ("select", id(select), select._version, id(run), run._version, id(want), want._version)
        inputs["select"] = self._memo(key, lambda: (self._select_rows(run, want, select), select, run, want))[0]
        paged = isinstance(cache, PagedKV)
        exe = self.executable(
            cache is not None, block_size, head="confidence", score=score, precision=precision, paged=paged
        )
        out = exe(inputs)
        return out["confidence"], out["token"]

    @torch.no_grad()
    def forward_rows(
        self,
        input_ids: torch.Tensor,
        token_index: torch.Tensor,
        positions: torch.Tensor,
        key_valid: torch.Tensor,
        cache: KVCache | PagedKV | None,
        *,
        select: torch.Tensor | None = None,
        score: str = "max",
        block_size: int | None = None,
    ):
        """One forward in which row b computes its own slots ``token_index[b]`` ([B, T]; the
        continuous-batching engine's rows sit at different blocks). ``input_ids`` / ``positions``
        [B, T] are the tokens and RoPE positions at those slots; their K/V are written into
        ``cache`` ([B, S] rows, ``key_valid`` [B, S]) and every query attends over its row's
        valid slots. Returns logits [B, T, V] (unshifted: for Dream, output t predicts slot
        ``token_index[b, t] + 1``), or with ``select`` (indices into T) the confidence head's
        (score, argmax) [B, M].

        Without a cache (``cache=None``: every row computes all of its slots, in any order; not
        for block-causal families, whose mask needs shared slots) the keys are each row's own T
        queries, ``key_valid`` [B, T] marks the real ones, and nothing is written: the
        continuous-batching engine's no-cache path, as cheap as a padded offline batch."""
        b, t = input_ids.shape
        for name, x in (("token_index", token_index), ("positions", positions)):
            if tuple(x.shape) != (b, t):
                raise GenerationError(f"forward_rows: {name} must be [{b}, {t}] like input_ids, got {list(x.shape)}")
        if cache is None:
            return self._forward_rows_uncached(input_ids, positions, key_valid, select, score)
        paged = isinstance(cache, PagedKV)
        if paged:
            if key_valid.dim() != 2 or key_valid.shape[0] != b:
                raise GenerationError(f"forward_rows: key_valid must be [{b}, S], got {list(key_valid.shape)}")
            _check_paged(cache, b, key_valid.shape[1], "forward_rows")
        elif tuple(key_valid.shape) != (b, cache.length) or cache.k[0].shape[0] != b:
            raise GenerationError(
                f"forward_rows: key_valid {list(key_valid.shape)} and the cache [{cache.k[0].shape[0]}, "
                f"{cache.length}] must both be [{b}, S]"
            )
        if t and not 0 <= int(token_index.min()) <= int(token_index.max()) < cache.length:
            raise GenerationError(f"forward_rows: token_index must lie in [0, {cache.length}) (the cache's slots)")
        dev = self.backend.device()
        inputs = {
            "input_ids": input_ids.to(dev),
            "positions": positions.to(dev),
            "token_index": token_index.to(dev),
            "key_valid": key_valid.to(dev),
        }
        self._bind_cache(inputs, cache)
        if select is None:
            return self.executable(True, block_size, per_row=True, paged=paged)(inputs)["logits"]
        inputs["select"] = select.long().to(dev)
        out = self.executable(True, block_size, head="confidence", score=score, per_row=True, paged=paged)(inputs)
        return out["confidence"], out["token"]

    def _forward_rows_uncached(self, input_ids, positions, key_valid, select, score):
        b, t = input_ids.shape
        if self.spec.block_causal:
            raise GenerationError("forward_rows: a block-causal model needs the cache (its mask uses shared slots)")
        if tuple(key_valid.shape) != (b, t):
            raise GenerationError(
                f"forward_rows: without a cache key_valid must be [{b}, {t}], got {list(key_valid.shape)}"
            )
        dev = self.backend.device()
        inputs = {
            "input_ids": input_ids.to(dev),
            "positions": positions.to(dev),
            "token_index": torch.arange(t, device=dev),  # only a block-causal mask would read it
            "key_valid": key_valid.to(dev),
        }
        if select is None:
            return self.executable(False)(inputs)["logits"]
        inputs["select"] = select.long().to(dev)
        out = self.executable(False, head="confidence", score=score)(inputs)
        return out["confidence"], out["token"]

    def _select_rows(self, run: torch.Tensor, want: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """The rows of ``run`` the confidence head reads for ``select`` (checked to be computed)."""
        if not _covers(want, select):
            raise GenerationError("confidence: every selected position must be computed")
        return self._predicted_by(run, select).to(self.backend.device())

    def predicting(self, positions: torch.Tensor) -> torch.Tensor:
        """The position whose output predicts each of ``positions``: itself, or for a family
        trained with shifted logits (Dream) the one before it. The one place the shift lives."""
        return (positions - 1).clamp_min(0) if self.spec.shift_logits else positions

    def _predicted_by(self, run: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Index in ``run`` of the logit that predicts each position."""
        return torch.searchsorted(run, self.predicting(positions))

    def _inputs(self, input_ids, attention_mask, cache, compute):
        if not isinstance(input_ids, torch.Tensor):
            raise GenerationError(
                f"input_ids must be a [batch, length] integer tensor, got {type(input_ids).__name__} "
                "(torch.tensor(ids) makes one; LLM.generate takes lists of ids)"
            )
        if input_ids.dim() != 2:
            raise GenerationError(f"input_ids must be [batch, length], got shape {list(input_ids.shape)}")
        b, n = input_ids.shape
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise GenerationError(f"input_ids must be an integer tensor (int64), got {input_ids.dtype}")
        if input_ids.device.type == "cpu" and n:
            low, high = (int(v) for v in torch.aminmax(input_ids))
            if not 0 <= low <= high < self.spec.vocab:
                raise GenerationError(
                    f"input_ids hold ids outside [0, {self.spec.vocab}) (min {low}, max {high}): "
                    "not in the model's vocabulary"
                )
        if n > self.spec.max_length:
            raise GenerationError(f"sequence of {n} tokens exceeds the model's max length {self.spec.max_length}")
        if cache is None and compute is not None and len(compute) != n:
            raise GenerationError("computing a subset of positions needs a KV cache")
        if compute is None:
            want = self._memo(("arange", n), lambda: torch.arange(n))
        else:
            want = compute.long()
            self._memo(("compute", id(want), want._version, n), lambda: (_check_compute(want, n), want))
        run = want
        if self.spec.shift_logits:  # the positions whose logits predict ``want``
            run = torch.unique(torch.cat((want, self.predicting(want))))
        dev = self.backend.device()
        if attention_mask is None:
            valid = self._memo(("valid", b, n, dev), lambda: torch.ones(b, n, dtype=torch.bool, device=dev))
        else:
            valid = attention_mask.bool().to(dev)
        if attention_mask is None or not self.spec.positions_from_padding:
            # 0..N-1 in every row: the positions of `run` are `run` itself (memoised per run tensor,
            # so the backends' per-forward memos keyed on it are reused while it comes back).
            key = ("positions", b, id(run), run._version, dev)
            pos = self._memo(key, lambda: (run[None].expand(b, -1).contiguous().to(dev), run))[0]
        else:
            pos = self.positions(attention_mask, (b, n))[:, run].contiguous().to(dev)
        inputs = {
            "input_ids": (input_ids if len(run) == n else input_ids[:, run]).to(dev),
            "positions": pos,
            "token_index": run.to(dev),
            "key_valid": valid,
        }
        if isinstance(cache, PagedKV):
            _check_paged(cache, b, n, "paged KV")
            self._bind_cache(inputs, cache)
        elif cache is not None:
            if cache.length != n or cache.k[0].shape[0] != b:
                raise GenerationError(
                    f"KV cache holds [{cache.k[0].shape[0]}, {cache.length}] positions, the input is [{b}, {n}]"
                )
            self._bind_cache(inputs, cache)
        return inputs, run, want

    def _memo(self, key: tuple, build):
        """Small per-shape tensors every forward of a shape needs (aranges, all-valid masks),
        built once: a step then pays no op for them. Bounded: cleared past 256 entries."""
        value = self._small.get(key)
        if value is None:
            if len(self._small) > 256:
                self._small.clear()
            value = self._small[key] = build()
        return value

    __call__ = forward
