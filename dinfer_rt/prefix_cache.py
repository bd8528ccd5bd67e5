"""A block prefix cache across requests: the K/V of whole, aligned blocks, keyed by token ids.

Block-causal models (LLaDA2.x, SDAR) align blocks to absolute position 0 and let a block see
only itself and the blocks before it, so the K/V of block ``b`` depend on the tokens of blocks
``0..b`` and nothing else: a request whose prompt starts with the same blocks as an earlier
sequence can copy those K/V instead of computing them, and decodes exactly as it would cold.

Each cached block is keyed by a chain hash: the hash of its predecessor's key, the block length
and its own token ids, so equal blocks after different prefixes are different entries. A
lookup walks the chain from position 0 and stops at the first miss (the longest cached prefix).
An entry also keeps its tokens and its parent, compared on every hit, so a hash collision can
never hand back another sequence's K/V.

Entries are shared by reference count: a running request holds the blocks it copied (and the
ones it inserted) until it ends, and a held block is never evicted. Under the byte budget the
least recently used block that nothing holds and that has no cached successor is evicted first
(a parent outlives its children: evicting it would leave them unreachable but still counted).

Bidirectional models (LLaDA, LLaDA-MoE, Dream) get a cache only when asked
(``EngineArgs.prefix_cache = "approximate"``, ``serve --prefix-cache approximate``): every prompt
K/V there depends on the whole sequence, generated tokens included, so a cached block is only an
approximation of what the new request would compute. What is approximated: a hit copies the
prompt blocks' K/V of an earlier request's *first forward* (its prompt and an all-masked answer)
and the new request never recomputes them (``Cohort.cached_prefix``), not even at the block-start
refreshes of ``prefix`` / ``dual``; that is where the saving comes from, and why the answer may
differ from a cold run. ``PrefixCache.approximate`` says which kind an engine holds.

Storage. With the engine's paged KV pool (``kv_blocks.py``, the default) an entry is one pool
block of ``unit`` positions, referenced rather than copied: a hit points the new row's block
table at it, an insert takes a reference to the row's own block, eviction drops the reference
(the block is free once no row holds it either), and the pool's copy-on-write keeps a shared
block from ever being written. Entries then cover ``unit`` positions each while the block length
(``block_length``, part of every key: the block-causal mask differs with it) sets where a hit may
end; the engine cuts a hit to whole blocks. With contiguous pool rows an entry holds its own
copy of the K/V of one whole block.

The engine (``engine.py``) decides which requests may use the cache and which of a request's
blocks hold exact (or, approximate mode, first-forward) K/V; this module only stores, finds and
evicts them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dinfer_rt.errors import GenerationError
from dinfer_rt.kv_blocks import KVBlocks
from dinfer_rt.model import KVCache

_ROOT = b"dinfer-rt prefix cache"


def block_key(parent: bytes, block_length: int, tokens: Sequence[int]) -> bytes:
    """The chain hash of one block: its predecessor's key, the block length (the block mask
    differs with it) and its token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(block_length.to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    return h.digest()


def entry_ids(tokens: Sequence[int], index: int, unit: int, block_length: int) -> tuple[int, ...] | None:
    """The ids entry ``index`` (positions ``[index * unit, (index + 1) * unit)``) is keyed by: its
    own, and on to the end of the block of ``block_length`` its last position lies in. Within a
    block attention runs both ways, so a paged entry's K/V depend on the whole block, not only on
    the positions it holds (with ``unit`` == ``block_length``: its own ids). None past ``tokens``."""
    start = index * unit
    stop = -(-(start + unit) // block_length) * block_length
    ids = tuple(int(t) for t in tokens[start:stop])
    return ids if len(ids) == stop - start else None


@dataclass(eq=False)
class CachedBlock:
    """One block's K/V (per layer, [block_length, kv_heads, head_dim]; paged: ``pool_block``, the
    pool block holding them) and its place in the chain."""

    key: bytes
    parent: CachedBlock | None
    tokens: tuple[int, ...]  # the ids it is keyed by (``entry_ids``: paged, on to its block's end)
    start: int  # its first position (blocks align to position 0)
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    nbytes: int
    refs: int = 0  # running requests that hold it
    children: int = 0  # cached blocks whose parent it is
    alive: bool = field(default=True, repr=False)  # False once evicted
    pool_block: int = -1  # paged: the pool block it references (-1: ``k`` / ``v`` are its own copies)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # lookups (one per admitted request that may use the cache)
    query_tokens: int = 0  # tokens those lookups could have hit (whole prompt blocks before the tail's block)
    hit_tokens: int = 0  # tokens whose K/V were copied from the cache
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    blocks: int = 0  # blocks held now
    bytes: int = 0  # bytes held now


class PrefixCache:
    """Cached blocks under a byte budget (``budget_bytes`` > 0); used by one engine thread.
    ``approximate``: the blocks are a bidirectional model's (a hit may change the answer), so
    whoever reports the cache (start-up line, ``/metrics``) can say so."""

    def __init__(
        self, budget_bytes: int, *, approximate: bool = False, blocks: KVBlocks | None = None, block_bytes: int = 0
    ) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise GenerationError(
                f"prefix_cache_bytes must be an int >= 1 for a prefix cache (0 turns it off), got {budget_bytes!r}"
            )
        self.budget = budget_bytes
        self.approximate = bool(approximate)
        # paged: entries are blocks of the engine's pool, ``block_bytes`` each (``kv_blocks.py``)
        self.blocks, self.block_bytes = blocks, block_bytes
        self.stats = PrefixCacheStats()
        self._blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()  # least recently used first

    @property
    def mode(self) -> str:
        """The mode: "exact" (a hit decodes as cold) or "approximate" (a bidirectional model's blocks)."""
        return "approximate" if self.approximate else "exact"

    def __len__(self) -> int:
        return len(self._blocks)

    def held(self) -> int:
        """Blocks some running request holds (never evicted)."""
        return sum(1 for n in self._blocks.values() if n.refs > 0)

    # ---------------------------------------------------------------- lookup
    @property
    def unit(self) -> int | None:
        """Positions per entry: the pool's block size when paged (None: one entry per block)."""
        return None if self.blocks is None else self.blocks.block_size

    def match(self, tokens: Sequence[int], block_length: int, max_blocks: int) -> list[CachedBlock]:
        """The cached chain for the longest prefix of ``tokens`` in whole entries (at most
        ``max_blocks``; an entry is a block, or paged a pool block of :attr:`unit` positions),
        without touching counts or recency."""
        chain: list[CachedBlock] = []
        parent_key, parent = _ROOT, None
        unit = self.unit or block_length
        for b in range(max_blocks):
            ids = entry_ids(tokens, b, unit, block_length)
            if ids is None:
                break
            node = self._blocks.get(block_key(parent_key, block_length, ids))
            if node is None or node.tokens != ids or node.parent is not parent or node.start != b * unit:
                break
            chain.append(node)
            parent_key, parent = node.key, node
        return chain

    def lookup(self, tokens: Sequence[int], block_length: int, max_blocks: int) -> tuple[list[CachedBlock], int]:
        """:meth:`match` of the prompt's first ``max_blocks`` whole blocks, cut to whole blocks
        (paged entries may end inside one), counted in the stats, its entries held (``release``
        them when the request ends) and made most recently used. Returns the entries covering the
        hit (paged: the last one may reach past it) and the positions hit."""
        unit = self.unit or block_length
        chain, hit = self.cut(self.match(tokens, block_length, max_blocks * block_length // unit), block_length)
        return self.take(chain, hit, max_blocks * block_length), hit

    def cut(self, chain: list[CachedBlock], block_length: int, upto: int | None = None) -> tuple[list, int]:
        """A matched chain cut to whole blocks (at most ``upto`` positions): the entries covering
        the hit (paged: the last may reach past it) and the positions hit."""
        unit = self.unit or block_length
        hit = len(chain) * unit // block_length * block_length
        if upto is not None:
            hit = min(hit, upto // block_length * block_length)
        return chain[: -(-hit // unit)], hit

    def take(self, chain: list[CachedBlock], hit: int, query_tokens: int) -> list[CachedBlock]:
        """Count a lookup of ``query_tokens`` positions that hit ``hit`` through ``chain`` and hold
        its entries (``release`` them when the request ends), most recently used now."""
        self.stats.queries += 1
        self.stats.query_tokens += query_tokens
        self.stats.hit_tokens += hit
        self.acquire(chain)
        return chain

    def acquire(self, chain: list[CachedBlock]) -> None:
        for node in chain:
            node.refs += 1
            if node.alive:
                self._blocks.move_to_end(node.key)

    def release(self, chain: list[CachedBlock]) -> None:
        for node in chain:
            if node.refs <= 0:
                raise RuntimeError("prefix cache: a block was released more often than it was held")
            node.refs -= 1

    @staticmethod
    def copy_into(chain: list[CachedBlock], pool: KVCache, row: int) -> int:
        """Write the chain's K/V into row ``row`` of ``pool`` at their positions; returns the
        positions written (the cached prefix length)."""
        for node in chain:
            a, b = node.start, node.start + len(node.tokens)
            for dst, src in zip((*pool.k, *pool.v), (*node.k, *node.v)):
                dst[row, a:b].copy_(src)
        return sum(len(n.tokens) for n in chain)

    # ---------------------------------------------------------------- insert
    def insert_blocks(self, tokens: Sequence[int], block_length: int, row_blocks: list[int]) -> list[CachedBlock]:
        """Paged: cache the leading entries of ``tokens`` whose K/V are the pool blocks
        ``row_blocks`` (a row's first blocks, :attr:`unit` positions each; the caller vouches for
        their K/V as :meth:`insert` says) by reference. An entry cached already keeps its own block
        (the row keeps its). Returns the chain held for the caller, as :meth:`insert`."""
        assert self.blocks is not None, "insert_blocks needs a paged cache"

        def store(b: int) -> tuple[list, list, int, int] | None:
            if not self._make_room(self.block_bytes):
                return None
            self.blocks.ref(row_blocks[b])
            return [], [], self.block_bytes, row_blocks[b]

        return self._insert(tokens, block_length, len(row_blocks), self.blocks.block_size, store)

    def _new(self, key, parent, ids, start, k, v, nbytes, pool_block=-1) -> CachedBlock:
        node = CachedBlock(key, parent, ids, start, k, v, nbytes, pool_block=pool_block)
        self._blocks[key] = node
        if parent is not None:
            parent.children += 1
        self.stats.inserted_blocks += 1
        self.stats.blocks += 1
        self.stats.bytes += nbytes
        return node

    def evict_for(self, free_blocks: int) -> bool:
        """Paged: evict least recently used entries nothing holds (leaves first) whose pool block
        only the cache references, until ``free_blocks`` blocks of the pool are free; False if
        they cannot be (the rest is held by running rows)."""
        pool = self.blocks
        if pool is None:
            return False
        while pool.free < free_blocks:
            victim = next(
                (n for n in self._blocks.values() if n.refs == 0 and n.children == 0 and pool.refs[n.pool_block] == 1),
                None,
            )
            if victim is None:
                return False
            self._evict(victim)
        return True

    def insert(
        self, tokens: Sequence[int], block_length: int, num_blocks: int, pool: KVCache, row: int
    ) -> list[CachedBlock]:
        """Cache the first ``num_blocks`` whole blocks of ``tokens`` from row ``row`` of ``pool``
        (the caller vouches that their K/V there are exact: computed over these very tokens).
        Blocks already cached are only made recent. Stops early when the budget cannot make
        room (every other block held or a parent). Returns the chain now cached for them, held
        for the caller (``release`` it)."""

        def store(b: int) -> tuple[list, list, int, int] | None:
            a = b * block_length
            k = [t[row, a : a + block_length].clone() for t in pool.k]
            v = [t[row, a : a + block_length].clone() for t in pool.v]
            nbytes = sum(t.numel() * t.element_size() for t in (*k, *v))
            return (k, v, nbytes, -1) if self._make_room(nbytes) else None

        return self._insert(tokens, block_length, num_blocks, block_length, store)

    def _insert(self, tokens: Sequence[int], block_length: int, count: int, unit: int, store) -> list[CachedBlock]:
        """The walk both inserts share: entries ``0..count-1`` of ``unit`` positions, each found or
        made (``store(index)``: its K/V, bytes and pool block, or None when no room is left: the
        walk stops). A hash collision stops it too, and so does a missing entry inside a block
        whose leading entries another request cached (its K/V would be spliced from two
        forwards). Each entry is held while the rest is inserted (room is never made from it)."""
        chain: list[CachedBlock] = []
        parent_key, parent = _ROOT, None
        made = False  # the previous entry is this call's
        try:
            for b in range(count):
                ids = entry_ids(tokens, b, unit, block_length)
                if ids is None:
                    break
                key = block_key(parent_key, block_length, ids)
                node = self._blocks.get(key)
                if node is not None and (node.tokens != ids or node.parent is not parent):
                    break  # a hash collision: keep the entry there, cache nothing past it
                if node is None and not made and b * unit % block_length:
                    break
                made = node is None
                if node is None:
                    stored = store(b)
                    if stored is None:
                        break
                    node = self._new(key, parent, ids, b * unit, *stored)
                self.acquire([node])
                chain.append(node)
                parent_key, parent = key, node
        except BaseException:
            self.release(chain)
            raise
        return chain

    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used, unheld leaf blocks until ``nbytes`` more fit the budget."""
        if nbytes > self.budget:
            return False
        while self.stats.bytes + nbytes > self.budget:
            victim = next((n for n in self._blocks.values() if n.refs == 0 and n.children == 0), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, node: CachedBlock) -> None:
        del self._blocks[node.key]
        node.alive = False
        node.k, node.v = [], []
        if node.pool_block >= 0:
            self.blocks.unref(node.pool_block)
        if node.parent is not None:
            node.parent.children -= 1
        self.stats.evicted_blocks += 1
        self.stats.blocks -= 1
        self.stats.bytes -= node.nbytes

    def clear(self) -> None:
        """Drop every block nothing holds (leaves first, so parents become leaves)."""
        while True:
            victims = [n for n in self._blocks.values() if n.refs == 0 and n.children == 0]
            if not victims:
                return
            for n in victims:
                self._evict(n)


def default_budget(device: torch.device, fraction: float = 0.1, cpu_bytes: int = 1 << 30) -> int:
    """The prefix cache's byte budget when none is given: ``fraction`` of the device's free
    memory on a CUDA / ROCm device (measured after the engine's KV-cache pool is allocated), a
    fixed ``cpu_bytes`` (1 GiB) elsewhere: on the CPU free memory is shared with everything else,
    and other devices report none through torch."""
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return max(1, int(free * fraction))
    return cpu_bytes
