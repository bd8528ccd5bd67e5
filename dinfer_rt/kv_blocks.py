"""The paged KV pool's bookkeeping: which pool block holds each position of each engine row.

The engine's K/V live in blocks of ``block_size`` positions (``Model.new_paged_pool``: per layer
``[num_blocks, block_size, kv_heads, head_dim]``), not in rows of the model's full length: a
request takes the blocks its own length needs (prompt + ``gen_length``) when it is admitted and
gives them back when it ends, so the pool's memory follows the requests that run, not
``max_num_seqs`` x ``max_model_len``. A row's position ``p`` lives at
``pool[table[row, p // block_size], p % block_size]``; forwards get their rows' table slice
(``ForwardInputs.block_table``) and attend through it (``ir.ops.kv_gather`` / ``kv_scatter``).

Blocks are reference counted: a row's table entry holds one reference, and so does the prefix
cache for each block it keeps (``prefix_cache.py``). That is how the running rows and the prefix
cache share one pool: a prefix-cache hit points the new row's table at the cached blocks instead
of copying them. A block referenced twice is never written in place: before a forward writes a
position of a shared block, :meth:`KVBlocks.writable` gives the row a private copy
(copy-on-write), so a row can never change what another row or the cache reads.

Block 0 is the trash block: every table entry that no allocation fills points at it, so padding
writes (graph padding rows and positions, per-row windows' scratch queries) land there and no
real position ever reads it as valid (its keys are masked). This module only counts; the
device copies a copy-on-write needs are done by the caller (``runner.copy_blocks``).
"""

from __future__ import annotations

import torch

from dinfer_rt.errors import GenerationError

TRASH = 0


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold ``positions`` positions."""
    return -(-positions // block_size)


class KVBlocks:
    """Free list, reference counts and the ``[rows, max_blocks]`` int32 block table (host)."""

    def __init__(self, num_blocks: int, block_size: int, rows: int, max_blocks: int) -> None:
        if num_blocks < 2:
            raise GenerationError(f"a paged KV pool needs at least 2 blocks (one is the trash block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.table = torch.zeros((rows, max_blocks), dtype=torch.int32)
        self.refs = [0] * num_blocks
        self.refs[TRASH] = 1  # never free, never counted as shared
        self._free = list(range(num_blocks - 1, 0, -1))  # a stack: low ids first
        self.allocated = [0] * rows  # table entries each row holds references for
        self.shared = [0] * rows  # leading entries of each row that may be shared (copy-on-write checks)
        self.copied_blocks = 0  # copy-on-write copies so far

    # ---------------------------------------------------------------- capacity
    @property
    def usable(self) -> int:
        """Blocks a request may ever hold: all but the trash block."""
        return self.num_blocks - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.usable - self.free

    def blocks_for(self, positions: int) -> int:
        return blocks_for(positions, self.block_size)

    # ---------------------------------------------------------------- rows
    def allocate(self, row: int, positions: int, shared: list[int] = ()) -> None:
        """Give ``row`` the blocks of ``positions`` positions: ``shared`` blocks first (a prefix-cache
        hit: referenced, not copied), fresh ones for the rest. The caller checked :attr:`free`."""
        need = self.blocks_for(positions)
        if self.allocated[row]:
            raise GenerationError(f"KV blocks: row {row} is allocated already (its last request was not released)")
        if len(shared) > need or need > self.table.shape[1]:
            raise GenerationError(
                f"KV blocks: {positions} positions do not fit a table row of {self.table.shape[1]} blocks"
            )
        if need - len(shared) > self.free:
            raise GenerationError(
                f"KV blocks: row {row} needs {need - len(shared)} free blocks, {self.free} are free"
            )  # the engine admits by free blocks, so this is a bookkeeping error
        for j, blk in enumerate(shared):
            self.refs[blk] += 1
            self.table[row, j] = blk
        for j in range(len(shared), need):
            blk = self._free.pop()
            self.refs[blk] = 1
            self.table[row, j] = blk
        self.allocated[row], self.shared[row] = need, len(shared)

    def release(self, row: int) -> None:
        """Drop ``row``'s references; blocks nobody references any more are free again."""
        for j in range(self.allocated[row]):
            self.unref(int(self.table[row, j]))
        self.table[row].zero_()
        self.allocated[row] = self.shared[row] = 0

    def move(self, dst: int, src: int, rows: int) -> None:
        """Rows ``[src, src + rows)`` become rows ``[dst, dst + rows)`` (the engine packs rows down:
        ``dst < src``); their blocks stay where they are, only the table rows move."""
        if dst == src or rows == 0:
            return
        self.table[dst : dst + rows] = self.table[src : src + rows].clone()
        for i in range(rows):
            self.allocated[dst + i], self.shared[dst + i] = self.allocated[src + i], self.shared[src + i]
        for r in range(max(src, dst + rows), src + rows):  # the rows left behind hold nothing
            self.table[r].zero_()
            self.allocated[r] = self.shared[r] = 0

    def take(self) -> int:
        """A free block, referenced once (the caller's; :meth:`unref` gives it back)."""
        if not self._free:
            raise GenerationError("KV blocks: no free block")
        blk = self._free.pop()
        self.refs[blk] = 1
        return blk

    def row_blocks(self, row: int, count: int) -> list[int]:
        """The first ``count`` blocks of ``row``."""
        return [int(b) for b in self.table[row, :count]]

    # ---------------------------------------------------------------- references
    def ref(self, block: int) -> None:
        self.refs[block] += 1

    def unref(self, block: int) -> None:
        if block == TRASH:
            return
        if self.refs[block] <= 0:
            raise RuntimeError(f"KV blocks: block {block} released more often than it was referenced")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free.append(block)

    def mark_shared(self, row: int, count: int) -> None:
        """The first ``count`` blocks of ``row`` may now be referenced elsewhere (the prefix cache took them)."""
        self.shared[row] = max(self.shared[row], min(count, self.allocated[row]))

    def writable(self, row: int, first_position: int) -> list[tuple[int, int]]:
        """Copy-on-write before a forward writes ``row`` from ``first_position`` on: every block of
        the row at or after it that someone else references gets replaced by a fresh private one.
        Returns ``(src, dst)`` block pairs whose K/V the caller copies on the device first."""
        first = first_position // self.block_size
        if first >= self.shared[row]:
            return []
        pairs = []
        for j in range(first, self.shared[row]):
            blk = int(self.table[row, j])
            if self.refs[blk] > 1:
                if not self._free:
                    raise GenerationError(
                        "KV blocks: no free block for a copy-on-write (a shared prefix block about to be "
                        "written); raise --kv-cache-memory"
                    )
                new = self._free.pop()
                self.refs[new] = 1
                self.refs[blk] -= 1
                self.table[row, j] = new
                pairs.append((blk, new))
        self.shared[row] = first
        self.copied_blocks += len(pairs)
        return pairs
