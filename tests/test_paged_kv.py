"""Paged KV storage: ``kv_gather`` / ``kv_scatter`` against a per-element float64 loop, and cached
forwards over a :class:`PagedKV` (a shuffled block table, trash block 0 past the length) equal to
the same forwards over a contiguous :class:`KVCache`. Tolerances: float64 (reference backend)
1e-12, float32 (cpu backend) 1e-5; the pools read back through the table equal the contiguous
cache exactly (both hold the same computed K/V)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dinfer_rt
from dinfer_rt import plugins
from dinfer_rt.errors import GenerationError
from dinfer_rt.ir import IRError, ops
from dinfer_rt.lowering import lower
from dinfer_rt.model import KVCache, PagedKV
from dinfer_rt.passes import reorder

ROOT = Path(__file__).resolve().parents[1]
P = 5  # pool block size: not a multiple of the models' block size 4


def _loop_gather(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    b, p = table.shape[0], pool.shape[1]
    out = torch.empty((b, length, *pool.shape[2:]), dtype=torch.float64)
    for r in range(b):
        for s in range(length):
            out[r, s] = pool[int(table[r, s // p]), s % p].double()
    return out


def _table(gen: torch.Generator, rows: int, length: int, spare: int = 1) -> tuple[torch.Tensor, int]:
    """A random non-identity block table (rows never contiguous in the pool) with ``spare`` trash
    entries past the length; returns (table int32, number of pool blocks)."""
    need = -(-length // P)
    nb = 1 + rows * need
    perm = torch.randperm(nb - 1, generator=gen) + 1
    used = perm.view(rows, need)
    return torch.cat((used, torch.zeros(rows, spare, dtype=torch.long)), 1).int(), nb


# ---------------------------------------------------------------- op semantics


def test_gather_and_scatter_match_a_per_element_loop():
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = torch.randn(9, 3, 2, 4, generator=g), torch.randn(9, 3, 2, 4, generator=g)
    table = torch.tensor([[4, 2, 7, 1, 0], [3, 0, 8, 6, 0]], dtype=torch.int32)  # row 1 reads trash at 3..5
    key_valid = torch.ones(2, 11, dtype=torch.bool)
    kc, vc = ops.kv_gather(k_pool, v_pool, table, key_valid)
    assert kc.is_contiguous() and kc.shape == (2, 11, 2, 4)
    assert torch.equal(kc.double(), _loop_gather(k_pool, table, 11))
    assert torch.equal(vc.double(), _loop_gather(v_pool, table, 11))

    new_k, new_v = torch.randn(2, 11, 2, 4, generator=g), torch.randn(2, 11, 2, 4, generator=g)
    shared = torch.tensor([1, 5, 5, 10])  # [T], with a duplicate slot
    per_row = torch.tensor([[0, 2, 9, 9], [4, 7, 8, 3]])  # [B, T]
    for token_index in (shared, per_row):
        want_k, want_v = k_pool.double().clone(), v_pool.double().clone()
        rows = token_index.expand(2, -1) if token_index.dim() == 1 else token_index
        for r in range(2):
            for s in rows[r].tolist():
                want_k[int(table[r, s // 3]), s % 3] = new_k[r, s].double()
                want_v[int(table[r, s // 3]), s % 3] = new_v[r, s].double()
        kp, vp = k_pool.clone(), v_pool.clone()
        out = ops.kv_scatter(kp, vp, table, token_index, new_k, new_v)
        assert out[0] is kp and out[1] is vp  # in place: the outputs alias the pools
        assert torch.equal(kp.double(), want_k) and torch.equal(vp.double(), want_v)


def test_paged_ops_type_errors_name_the_problem():
    from dinfer_rt.ir import Graph, TensorType

    g = Graph("t")
    pool = g.input("k", TensorType(("NB", "P", 2, 4), torch.float32))
    pool_v = g.input("v", TensorType(("NB", "P", 2, 4), torch.float32))
    bad_table = g.input("table", TensorType(("B", "NBT"), torch.float32))
    valid = g.input("valid", TensorType(("B", "S"), torch.bool))
    with pytest.raises(IRError, match="block_table must be int32"):
        g.op("kv_gather", pool, pool_v, bad_table, valid)
    table = g.input("table2", TensorType(("B", "NBT"), torch.int32))
    other = g.input("v2", TensorType(("NB", "P", 3, 4), torch.float32))
    with pytest.raises(IRError, match="shape mismatch"):
        g.op("kv_gather", pool, other, table, valid)
    kc, vc = g.op("kv_gather", pool, pool_v, table, valid)
    tok = g.input("tok", TensorType(("T",), torch.float32))
    with pytest.raises(IRError, match="token_index must be integer"):
        g.op("kv_scatter", pool, pool_v, table, tok, kc, vc)


# ---------------------------------------------------------------- the graph and the passes


def _gathers_adjacent(graph) -> bool:
    """Every kv_gather runs right before the one op reading its scratch."""
    nodes = graph.nodes
    for i, n in enumerate(nodes):
        if n.op == "kv_gather":
            readers = [j for j, m in enumerate(nodes) if any(v is o for v in m.inputs for o in n.outputs)]
            if readers != [i + 1]:
                return False
    return True


def test_lowering_needs_cached_and_passes_keep_each_gather_next_to_its_attention(ckpt_dir):
    model = dinfer_rt.load_model(ckpt_dir("llada2"), backend="cpu")
    with pytest.raises(ValueError, match="paged=True needs cached=True"):
        lower(model.spec, torch.float32, paged=True)
    graph = model.executable(True, paged=True).graph  # fused and reordered by the cpu backend's passes
    counts = graph.op_counts()
    assert counts["kv_gather"] == counts["kv_scatter"] == model.spec.n_layers
    assert _gathers_adjacent(graph)
    table = next(v for v in graph.inputs if v.name == "block_table")
    assert table.type.dtype == torch.int32


def test_reorder_does_not_hoist_the_gathers(ckpt_dir):
    """Even from an order that hoists every gather to the top, under a priority that would run
    gathers first (a backend's copy-early priority), the schedule puts each back beside its
    attention: one layer's scratch is live at a time."""
    spec = dinfer_rt.load_model(ckpt_dir("llada"), backend="cpu").spec
    graph = lower(spec, torch.float32, cached=True, paged=True)
    assert _gathers_adjacent(graph)
    gathers = [n for n in graph.nodes if n.op == "kv_gather"]
    hoisted = gathers + [n for n in graph.nodes if n.op != "kv_gather"]
    graph.nodes = hoisted

    def eager(node, uses, bindings):
        return 1e12 if node.op == "kv_gather" else reorder.memory_min(node, uses, bindings)

    order = reorder.list_schedule(graph, eager)
    graph.nodes = [hoisted[i] for i in order]
    assert _gathers_adjacent(graph)
    scratch = sum(reorder.nbytes(o, reorder.DEFAULT_BINDINGS) for o in gathers[0].outputs)
    identity = list(range(len(graph.nodes)))
    graph.nodes = hoisted
    assert reorder.peak_bytes(graph, identity) >= reorder.peak_bytes(graph, order) + scratch


def test_tensor_parallel_shards_the_pools_kv_heads(ckpt_dir):
    from dinfer_rt.passes.shard import TensorParallel, shard_graph

    spec = dinfer_rt.load_model(ckpt_dir("llada_gqa_sharded"), backend="cpu").spec
    tp = TensorParallel(1, 2)
    graph = shard_graph(lower(spec, torch.float32, cached=True, paged=True), spec, tp)
    pools = [v for v in graph.inputs if v.name.startswith(("k_cache.", "v_cache."))]
    assert {v.type.shape for v in pools} == {("NB", "P", tp.kv_heads(spec), spec.head_dim)}
    scratch = [o.type.shape[2] for n in graph.nodes if n.op == "kv_gather" for o in n.outputs]
    assert set(scratch) == {tp.kv_heads(spec)}


# ---------------------------------------------------------------- model equivalence

CASES = [  # (checkpoint, backend, dtype, tolerance)
    ("llada", "reference", "float64", 1e-12),
    ("dream", "reference", "float64", 1e-12),
    ("llada2", "reference", "float64", 1e-12),
    ("llada", "cpu", "float32", 1e-5),
    ("dream", "cpu", "float32", 1e-5),
    ("llada2", "cpu", "float32", 1e-5),
]


def _paged_twin(model, cache: KVCache, gen: torch.Generator) -> PagedKV:
    b, n = cache.k[0].shape[:2]
    table, nb = _table(gen, b, n)
    k, v = model.new_paged_pool(nb, P)
    return PagedKV(k, v, table, n)


def _same_storage(paged: PagedKV, cache: KVCache, tol: float = 0.0) -> None:
    """The pools read back through the table hold the contiguous cache (exactly, or within ``tol``)."""
    for pool, buf in ((paged.k, cache.k), (paged.v, cache.v)):
        for p, c in zip(pool, buf):
            got = ops.gather_pages(p, paged.table, paged.length)
            assert torch.equal(got, c) if tol == 0 else (got - c).abs().max().item() <= tol


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert ((got.double() - want.double()).abs().max() / want.double().abs().max()).item() <= tol


@pytest.mark.parametrize(("name", "backend", "dtype", "tol"), CASES)
def test_paged_forward_and_confidence_equal_the_contiguous_cache(ckpt_dir, name, backend, dtype, tol):
    model = dinfer_rt.load_model(ckpt_dir(name), backend=backend, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 60, (2, 12), generator=gen)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0  # left padding (Dream's positions come from it)
    cache = model.new_cache(2, 12)
    paged = _paged_twin(model, cache, gen)
    steps = [None, torch.arange(4, 8), torch.arange(8, 12), torch.tensor([1, 5, 9])]
    for compute in steps:
        want = model.forward(ids, mask, cache=cache, compute=compute, block_size=4)
        got = model.forward(ids, mask, cache=paged, compute=compute, block_size=4)
        _close(got, want, tol)
        _same_storage(paged, cache)
        ids[:, 8:] = torch.randint(0, 60, (2, 4), generator=gen)  # the next window sees new tokens
    compute, select = torch.arange(8, 12), torch.tensor([9, 11])
    want = model.confidence(ids, mask, select=select, cache=cache, compute=compute, block_size=4)
    got = model.confidence(ids, mask, select=select, cache=paged, compute=compute, block_size=4)
    _close(got[0], want[0], tol)
    assert torch.equal(got[1], want[1])
    _same_storage(paged, cache)
    # rows of a paged cache: the same pools under a slice of the table
    part = model.forward(ids[1:], mask[1:], cache=paged.rows(1, 2), compute=torch.arange(4, 8), block_size=4)
    _close(
        part, model.forward(ids[1:], mask[1:], cache=cache.rows(1, 2), compute=torch.arange(4, 8), block_size=4), tol
    )


@pytest.mark.parametrize(("name", "backend", "dtype", "tol"), CASES)
def test_paged_forward_rows_equal_the_contiguous_cache(ckpt_dir, name, backend, dtype, tol):
    """Per-row windows; row 1 has padding queries that all write one scratch slot (11)."""
    model = dinfer_rt.load_model(ckpt_dir(name), backend=backend, dtype=dtype)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 60, (2, 12), generator=gen)
    cache = model.new_cache(2, 12)
    paged = _paged_twin(model, cache, gen)
    model.forward(ids, cache=cache, block_size=4)
    model.forward(ids, cache=paged, block_size=4)
    slots = torch.tensor([[4, 5, 6, 7], [8, 9, 11, 11]])
    key_valid = torch.ones(2, 12, dtype=torch.bool)
    key_valid[1, 10] = False
    tokens = ids.gather(1, slots)
    positions = slots.clone()
    want = model.forward_rows(tokens, slots, positions, key_valid, cache, block_size=4)
    got = model.forward_rows(tokens, slots, positions, key_valid, paged, block_size=4)
    _close(got, want, tol)
    _same_storage(paged, cache)
    select = torch.tensor([0, 2])
    want = model.forward_rows(tokens, slots, positions, key_valid, cache, select=select, block_size=4)
    got = model.forward_rows(tokens, slots, positions, key_valid, paged, select=select, block_size=4)
    _close(got[0], want[0], tol)
    assert torch.equal(got[1], want[1])


def test_new_paged_pool_shapes(ckpt_dir):
    model = dinfer_rt.load_model(ckpt_dir("llada_gqa_sharded"), backend="cpu", dtype="float32")
    k, v = model.new_paged_pool(6, P)
    s = model.spec
    assert len(k) == len(v) == s.n_layers
    assert k[0].shape == (6, P, s.n_kv_heads, s.head_dim) and k[0].dtype == torch.float32
    assert not any(t.any() for t in (*k, *v))
    paged = PagedKV(k, v, torch.zeros(3, 2, dtype=torch.int32), 8)
    assert (paged.block_size, paged.batch, paged.rows(1, 3).batch) == (P, 3, 2)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t, n: (t.float(), n), "int32"),
        (lambda t, n: (t[0], n), "int32"),
        (lambda t, n: (t[:1], n), "block table has 1 rows, the batch is 2"),
        (lambda t, n: (t[:, :2], n), "covers 10 < 12 positions"),
        (lambda t, n: (torch.where(t == t.max(), 99, t).int(), n), r"block ids outside \[0, 6\)"),
        (lambda t, n: (t, n - 1), "length 11 differs from the sequence length 12"),
    ],
)
def test_bad_paged_input_is_a_clear_error(ckpt_dir, edit, message):
    model = dinfer_rt.load_model(ckpt_dir("llada"), backend="cpu")
    table = torch.tensor([[3, 1, 5, 0], [2, 4, 0, 0]], dtype=torch.int32)
    k, v = model.new_paged_pool(6, P)
    bad_table, length = edit(table, 12)
    paged = PagedKV(k, v, bad_table, length)
    ids = torch.randint(0, 60, (2, 12))
    with pytest.raises(GenerationError, match=message):
        model.forward(ids, cache=paged)
    if length == 12:
        slots = torch.arange(4).expand(2, 4)
        with pytest.raises(GenerationError, match=message):
            model.forward_rows(ids[:, :4], slots, slots, torch.ones(2, 12, dtype=torch.bool), paged)


def test_forward_rows_slots_must_lie_in_the_paged_length(ckpt_dir):
    model = dinfer_rt.load_model(ckpt_dir("llada"), backend="cpu")
    k, v = model.new_paged_pool(6, P)
    paged = PagedKV(k, v, torch.tensor([[3, 1, 5], [2, 4, 0]], dtype=torch.int32), 12)
    slots = torch.tensor([[0, 12], [1, 2]])
    with pytest.raises(GenerationError, match=r"token_index must lie in \[0, 12\)"):
        model.forward_rows(
            torch.zeros(2, 2, dtype=torch.long), slots, slots, torch.ones(2, 12, dtype=torch.bool), paged
        )


# ---------------------------------------------------------------- other backends


def test_triton_backend_runs_paged_forwards_interpreted(ckpt_dir, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    assert {"kv_gather", "kv_scatter"} <= set(plugins.select_backend("cuda").kernels())
    model = dinfer_rt.load_model(ckpt_dir("llada"), backend="cuda", dtype="float32")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 60, (2, 12), generator=gen)
    cache = model.new_cache(2, 12)
    paged = _paged_twin(model, cache, gen)
    for compute in (None, torch.arange(4, 8)):
        want = model.forward(ids, cache=cache, compute=compute)
        _close(model.forward(ids, cache=paged, compute=compute), want, 1e-5)
        _same_storage(paged, cache)
    exe = model.executable(True, paged=True)
    assert exe.fallbacks.get("kv_gather", 0) == exe.fallbacks.get("kv_scatter", 0) == 0


@pytest.fixture(scope="module")
def onnx_plugin():
    pytest.importorskip("onnxruntime")
    plugin = ROOT / "examples" / "onnxruntime_backend"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", "--no-build-isolation"]
    r = subprocess.run([*cmd, str(plugin)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    for mod in [m for m in sys.modules if m.startswith("dinfer_rt_onnxruntime")]:
        del sys.modules[mod]  # an earlier test may have imported the copy installed before
    plugins.registry.cache_clear()


@pytest.mark.parametrize("name", ["dream", "llada2"])
def test_onnxruntime_paged_graph_equals_the_reference(ckpt_dir, onnx_plugin, name):
    ref = dinfer_rt.load_model(ckpt_dir(name), backend="reference", dtype="float32")
    ort = dinfer_rt.load_model(ckpt_dir(name), backend="onnxruntime")
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 60, (2, 12), generator=gen)
    cache = ref.new_cache(2, 12)
    paged = _paged_twin(ort, cache, gen)
    for compute in (None, torch.arange(4, 8)):
        _close(
            ort.forward(ids, cache=paged, compute=compute, block_size=4),
            ref.forward(ids, cache=cache, compute=compute, block_size=4),
            1e-5,
        )
        _same_storage(paged, cache, 1e-5)
    slots = torch.tensor([[8, 9, 10, 10], [8, 9, 10, 11]])
    key_valid = torch.ones(2, 12, dtype=torch.bool)
    args = (ids.gather(1, slots), slots, slots.clone(), key_valid)
    _close(ort.forward_rows(*args, paged, block_size=4), ref.forward_rows(*args, cache, block_size=4), 1e-5)
    _same_storage(paged, cache, 1e-5)
