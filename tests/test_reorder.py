"""The list scheduler: valid topological orders, effect edges respected, peak never above the
original order's (hypothesis over random graphs), and the buffer plan."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dinfer_rt.ir import Graph, TensorType
from dinfer_rt.lowering import lower
from dinfer_rt.model_spec import parse_spec
from dinfer_rt.passes import PassContext, reorder


def random_graph(draw_ops: list[tuple[int, int, int]]) -> Graph:
    g = Graph("rand")
    values = [g.input("x", TensorType(("B", 16), torch.float32))]
    for kind, a, b in draw_ops:
        v = values[a % len(values)]
        if kind == 0:
            values.append(g.op("silu", v))
        elif kind == 1:
            n = 4 + 12 * (b % 5)
            values.append(
                g.op("linear", v, g.param(f"w{len(g.params)}", TensorType((n, v.type.shape[1]), torch.float32)))
            )
        else:
            w = values[b % len(values)]
            values.append(g.op("add", v, w) if w.type == v.type else g.op("silu", v))
    g.output("y", values[-1])
    g.output("z", values[len(values) // 2])
    return g.verify()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=30))
def test_list_schedule_is_topological_and_never_worse(ops):
    g = random_graph(ops)
    order = reorder.list_schedule(g)
    assert sorted(order) == list(range(len(g.nodes)))
    pos = {i: p for p, i in enumerate(order)}
    for i, preds in enumerate(reorder.dependencies(g)):
        assert all(pos[p] < pos[i] for p in preds)
    before = reorder.peak_bytes(g, list(range(len(g.nodes))))
    n = len(g.nodes)
    assert reorder.reorder(g, PassContext({})) >= 0
    g.verify()
    assert reorder.peak_bytes(g, list(range(n))) <= before


def test_effect_edge_keeps_cache_reads_before_the_splice(ckpt_dir):
    g = lower(parse_spec(ckpt_dir("llada")), torch.float32, cached=True)
    cache = next(v for v in g.inputs if v.name == "k_cache.1")
    g.output("peek", g.op("cast", cache, dtype=torch.float64))  # reads the cache: must precede the write
    reader = len(g.nodes) - 1
    writer = next(i for i, n in enumerate(g.nodes) if n.op == "attention" and n.inputs[5] is cache)
    assert reader in reorder.dependencies(g)[writer]
    order = reorder.list_schedule(g)
    assert order.index(reader) < order.index(writer)


def test_reorder_lowers_peak_when_the_original_order_is_bad():
    g = Graph("bad")
    x = g.input("x", TensorType(("B", 16), torch.float32))
    big = [g.op("linear", x, g.param(f"w{i}", TensorType((256, 16), torch.float32))) for i in range(4)]
    small = [g.op("linear", b, g.param(f"v{i}", TensorType((4, 256), torch.float32))) for i, b in enumerate(big)]
    acc = small[0]
    for s in small[1:]:
        acc = g.op("add", acc, s)
    g.output("y", acc)
    ctx = PassContext({})
    before = reorder.peak_bytes(g, list(range(len(g.nodes))))
    assert reorder.reorder(g, ctx) > 0
    after = reorder.peak_bytes(g.verify(), list(range(len(g.nodes))))
    assert after < before and ctx.reports["peak_bytes"] == {"before": before, "after": after}


def test_buffer_plan_reuses_memory_and_never_overlaps_live_values(ckpt_dir):
    g = lower(parse_spec(ckpt_dir("llada")), torch.float32)
    offsets, arena = reorder.buffer_plan(g)
    total = sum(reorder.nbytes(o, reorder.DEFAULT_BINDINGS) for n in g.nodes for o in n.outputs)
    assert arena < total / 4
    life: dict[int, tuple[int, int]] = {}
    for i, n in enumerate(g.nodes):
        for o in n.outputs:
            life[id(o)] = (i, i)
        for v in n.inputs:
            if v is not None and id(v) in life:
                life[id(v)] = (life[id(v)][0], i)
    sizes = {id(o): reorder.nbytes(o, reorder.DEFAULT_BINDINGS) for n in g.nodes for o in n.outputs}
    items = list(offsets.items())
    for a, (va, oa) in enumerate(items):
        for vb, ob in items[a + 1 :]:
            (sa, ea), (sb, eb) = life[va], life[vb]
            if not (ea < sb or eb < sa):  # both live at once: their byte ranges must not overlap
                assert oa + sizes[va] <= ob or ob + sizes[vb] <= oa
