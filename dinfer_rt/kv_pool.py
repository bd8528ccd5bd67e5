"""The engine's KV-cache pool before it is allocated: how many rows it holds and their bytes,
under ``max_num_seqs`` or a memory budget (``EngineArgs.kv_cache_memory`` /
``kv_cache_memory_fraction``). One arithmetic for the engine (which allocates the pool) and
``serve``'s start-up check (which measures it against the free memory).

Two layouts. Paged (``EngineArgs.kv_block_size`` > 0, the default): blocks of that many
positions (``kv_blocks.py``), as many as the budget holds and never more than every row at
``max_model_len`` needs; a request takes the blocks of its own length at admission, and the
prefix cache keeps its blocks in the same pool. Contiguous rows (``kv_block_size`` 0; a static
batch's own pool): ``max_model_len`` positions per row, ``max_num_seqs`` rows or fewer under a
budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dinfer_rt.engine_args import EngineArgs, pool_rows
from dinfer_rt.errors import GenerationError
from dinfer_rt.kv_blocks import blocks_for

DEFAULT_KV_FRACTION = 0.5
"""A paged pool without a budget takes at most this fraction of the free memory after the weights
(vLLM's ``--gpu-memory-utilization`` is 0.9 of the whole device; the rest here is left to
activations, device graphs and the prefix cache's bookkeeping), and never more than every row
at ``max_model_len`` would need."""


def format_bytes(n: float) -> str:
    """``1.5 GiB``, ``585.0 KiB``, ``12 B``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def available_memory(device) -> int | None:
    """Free memory where the KV pool would live: MemAvailable on the CPU, the free device memory
    on CUDA / ROCm; None where unknown (other devices)."""
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # no usable runtime here: unknown
            return None
    return None


def check_batch_fits(
    spec, dtype: torch.dtype, device, rows: int, positions: int, kv_heads: int | None = None, held: int = 0
) -> None:
    """A static batch's KV cache (``rows`` x ``positions``) must fit the free memory plus ``held``
    (idle caches kept for reuse, which a new batch may take or free): refused naming the bytes and
    what to lower, not left to the allocator's traceback (or to a swap storm). Unknown free
    memory (some devices): not checked."""
    need = rows * kv_row_bytes(spec, dtype, positions, kv_heads)
    free = available_memory(device)
    if free is not None and device.type == "cuda":  # what torch's allocator holds unused is room too
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if free is not None and need > free + held:
        free += held
        raise GenerationError(
            f"the KV cache for {rows} row(s) x {positions} positions needs {format_bytes(need)} ({need} bytes), "
            f"more than the {format_bytes(free)} free on {device}: lower the batch (batch_size), gen_length "
            "or the prompt length"
        )


def kv_row_bytes(spec, dtype: torch.dtype, positions: int, kv_heads: int | None = None) -> int:
    """Bytes of ``positions`` positions of one KV pool row (``Model.new_cache``'s tensors): K and V
    per layer, each ``positions x kv_heads x head_dim`` of ``dtype`` (``kv_heads``: a rank's share
    under tensor parallelism; default the model's)."""
    item = torch.empty((), dtype=dtype).element_size()
    kv = spec.n_kv_heads if kv_heads is None else kv_heads
    return 2 * spec.n_layers * positions * kv * spec.head_dim * item


def _made_of(spec, dtype: torch.dtype, kv_heads: int | None, positions: str) -> str:
    """How a row's (or a block's) bytes are made, for messages: ``positions`` x layers x K and V x
    KV heads x head_dim x the dtype's bytes."""
    kv = spec.n_kv_heads if kv_heads is None else kv_heads
    item = torch.empty((), dtype=dtype).element_size()
    return (
        f"{positions} x {spec.n_layers} layers x K and V x {kv} KV heads x head_dim {spec.head_dim} x {item} bytes "
        f"({str(dtype).removeprefix('torch.')})"
    )


@dataclass(frozen=True)
class KVPoolPlan:
    """The engine's KV pool before it is allocated (:func:`kv_pool_plan`): the engine allocates it,
    ``serve``'s start-up check measures it against the free memory."""

    row_bytes: int  # one pool row: ``positions`` x layers x K and V x KV heads x head_dim x dtype
    positions: int  # per row: max_model_len (+ 1 scratch slot)
    rows: int  # rows decoded at once: max_num_seqs, or fewer under a budget
    pool_rows: int  # rows allocated: ``rows``, and with device graphs the padding rows of its bucket
    budget: int | None  # the byte budget (None: sized by max_num_seqs)
    shape: str  # how a row's (paged: a block's) bytes are made, for messages
    block_size: int = 0  # paged: positions per block (0: contiguous rows)
    num_blocks: int = 0  # paged: blocks in the pool, the trash block included
    block_bytes: int = 0  # paged: one block over every layer, K and V

    @property
    def paged(self) -> bool:
        return self.block_size > 0

    @property
    def nbytes(self) -> int:
        """What the pool takes: paged, its blocks and its block table (host int32); else its rows."""
        if self.paged:
            return self.num_blocks * self.block_bytes + self.table_bytes
        return self.pool_rows * self.row_bytes

    @property
    def table_bytes(self) -> int:
        """Paged: the block table, ``pool_rows`` x :attr:`max_blocks` int32 entries."""
        return self.pool_rows * self.max_blocks * 4 if self.paged else 0

    @property
    def max_blocks(self) -> int:
        """Paged: a table row's entries (``positions``, the scratch slot included)."""
        return blocks_for(self.positions, self.block_size) if self.paged else 0

    @property
    def capacity(self) -> int:
        """Positions the pool can give requests at once (paged: every block but the trash one)."""
        return (self.num_blocks - 1) * self.block_size if self.paged else self.rows * (self.positions - 1)


def kv_budget(args: EngineArgs, free: int | None) -> int | None:
    """The KV pool's byte budget: ``kv_cache_memory``, or ``kv_cache_memory_fraction`` of ``free``
    (the free memory after the weights, :func:`available_memory`); None: no budget."""
    if args.kv_cache_memory is not None:
        return args.kv_cache_memory
    if args.kv_cache_memory_fraction is None:
        return None
    if free is None:
        raise GenerationError(
            "kv_cache_memory_fraction (--kv-cache-memory-fraction): the free memory of this device is unknown; "
            "give the budget in bytes (kv_cache_memory, --kv-cache-memory)"
        )
    return int(free * args.kv_cache_memory_fraction)


def kv_pool_plan(
    spec,
    dtype: torch.dtype,
    args: EngineArgs,
    max_model_len: int,
    *,
    scratch_slot: bool = True,
    kv_heads: int | None = None,
    graphs: bool = False,
    free: int | None = None,
) -> KVPoolPlan:
    """The rows of the engine's KV pool and their bytes, the one arithmetic the engine and
    ``serve``'s start-up check share. A row is ``max_model_len`` (+ the scratch slot) positions x
    layers x K and V x KV heads x head_dim x dtype bytes. Without a budget: ``max_num_seqs`` rows
    (with device graphs, the pool also holds the padding rows of its bucket). With one
    (``kv_cache_memory``, or ``kv_cache_memory_fraction`` of ``free``): rows = min(max_num_seqs,
    budget // row bytes), the bucket's padding rows only as far as the budget holds them (a forward
    whose padding would not fit runs eagerly). A budget below one row is an error naming both."""
    positions = max_model_len + int(scratch_slot)
    row = kv_row_bytes(spec, dtype, positions, kv_heads)
    scratch = " + 1 scratch" if scratch_slot else ""
    shape = _made_of(spec, dtype, kv_heads, f"{positions} positions (max_model_len {max_model_len}{scratch})")
    if args.kv_block_size:
        return _paged_plan(spec, dtype, args, max_model_len, positions, row, kv_heads, graphs, free)
    budget = kv_budget(args, free)
    if budget is None:
        return KVPoolPlan(row, positions, args.max_num_seqs, pool_rows(args, graphs), None, shape)
    fit = budget // row
    if fit < 1:
        if args.kv_cache_memory is not None:
            source = "kv_cache_memory, --kv-cache-memory"
        else:
            source = (
                f"kv_cache_memory_fraction {args.kv_cache_memory_fraction} (--kv-cache-memory-fraction) "
                f"of {free} bytes free"
            )
        raise GenerationError(
            f"the KV-cache budget of {budget} bytes ({format_bytes(budget)}; {source}) holds no pool row: one row "
            f"needs {row} bytes ({format_bytes(row)}: {shape}); raise --kv-cache-memory (or "
            f"--kv-cache-memory-fraction) to at least {row} bytes, or lower --max-model-len ({max_model_len})"
        )
    rows = min(args.max_num_seqs, fit)
    pool = min(pool_rows(dataclasses.replace(args, max_num_seqs=rows), graphs), fit)
    return KVPoolPlan(row, positions, rows, pool, budget, shape)


def _paged_plan(spec, dtype, args: EngineArgs, max_model_len: int, positions: int, row: int, kv_heads, graphs, free):
    """A paged pool (``kv_pool_plan`` with ``kv_block_size``): blocks of ``kv_block_size``
    positions, at most what ``max_num_seqs`` rows at ``max_model_len`` need (+ the trash block);
    fewer under a budget, or without one, ``DEFAULT_KV_FRACTION`` of ``free`` where that is known.
    Rows are table rows (cheap): ``max_num_seqs`` of them always."""
    size = args.kv_block_size
    if size > positions:
        raise GenerationError(
            f"kv_block_size {size} (--kv-block-size) exceeds the {positions} positions of a row (max_model_len "
            f"{max_model_len} + 1 scratch): a block never holds more than one request's positions, so the rest "
            f"of it would be memory no request uses; use at most {positions}, or 0 for contiguous rows"
        )
    block = kv_row_bytes(spec, dtype, size, kv_heads)
    shape = _made_of(spec, dtype, kv_heads, f"blocks of {size} positions (--kv-block-size)")
    full = args.max_num_seqs * blocks_for(max_model_len, size) + 1
    budget = kv_budget(args, free)
    if budget is None:
        num = full if free is None else min(full, int(free * DEFAULT_KV_FRACTION) // block)
        if num < 2:
            raise GenerationError(
                f"the KV pool's default share of the free memory ({DEFAULT_KV_FRACTION} x {free} bytes, "
                f"{format_bytes(free)}) holds {max(num - 1, 0)} KV blocks of {block} bytes ({format_bytes(block)}: "
                f"{shape}) besides the trash block; a paged pool needs 2: give --kv-cache-memory, or lower "
                "--kv-block-size"
            )
    else:
        num = min(full, budget // block)
        if num < 2:
            source = "kv_cache_memory, --kv-cache-memory"
            if args.kv_cache_memory is None:
                fraction = args.kv_cache_memory_fraction
                source = f"kv_cache_memory_fraction {fraction} (--kv-cache-memory-fraction) of {free} bytes free"
            raise GenerationError(
                f"the KV-cache budget of {budget} bytes ({format_bytes(budget)}; {source}) holds {num} KV block"
                f"{'' if num == 1 else 's'}: a paged pool needs 2 blocks (one is the trash block) of {block} bytes "
                f"({format_bytes(block)}: "
                f"{shape}); raise --kv-cache-memory (or --kv-cache-memory-fraction) to at least {2 * block} bytes"
            )
    # a request holds at least one block: more rows than usable blocks would never all run
    rows = min(args.max_num_seqs, num - 1)
    return KVPoolPlan(
        row, positions, rows, pool_rows(dataclasses.replace(args, max_num_seqs=rows), graphs), budget, shape,
        block_size=size, num_blocks=num, block_bytes=block,
    )  # fmt: skip


def pool_summary(plan: KVPoolPlan, max_model_len: int, max_num_seqs: int) -> str:
    """The start-up line on an engine's KV pool (``serve`` prints it; an engine process sends it
    to its front): its blocks (paged) or the rows it took (of the ``max_num_seqs`` asked for), and
    their bytes."""
    if plan.paged:
        budget = "" if plan.budget is None else f"; budget {format_bytes(plan.budget)} ({plan.budget} bytes)"
        full = (plan.num_blocks - 1) // blocks_for(max_model_len, plan.block_size)
        return (
            f"dinfer-rt KV pool: paged, {plan.num_blocks - 1} blocks of {plan.block_size} positions = "
            f"{format_bytes(plan.nbytes)} ({plan.nbytes} bytes, {plan.block_bytes} per block, block table "
            f"included{budget}); "
            f"{plan.rows} rows decode at once, each taking the blocks of its own length "
            f"({full} rows at the full {max_model_len} positions would fit)"
        )
    rows = f"{plan.rows} rows decode at once"
    if plan.rows < max_num_seqs:
        rows += f" (--max-num-seqs {max_num_seqs}: the budget holds {plan.rows})"
    budget = "" if plan.budget is None else f", budget {format_bytes(plan.budget)} ({plan.budget} bytes)"
    return (
        f"dinfer-rt KV pool: {rows}; {plan.pool_rows} rows x {plan.positions} positions = "
        f"{format_bytes(plan.nbytes)} ({plan.nbytes} bytes, {plan.row_bytes} per row{budget})"
    )
