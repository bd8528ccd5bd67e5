"""Instruction reordering: a list scheduler with explicit ordering edges and a memory-min
priority, a simulator of peak live activation bytes, and a liveness-based buffer plan.

When the memory-min order helps: the lowering already emits each decoder layer so its values
die before the next layer's, so on every benchmarked model graph the pass finds no lower peak
(``benchmarks/results/passes.md``: 4.2 -> 4.2 MB). It pays when wide values are produced long
before they are consumed -- several wide projections computed up front and reduced later
(``tests/test_reorder.py::test_reorder_lowers_peak_when_the_original_order_is_bad``), graphs a
plugin pass rewrote that way -- and it is where a backend's own priority (copy/compute overlap)
plugs in. It never adopts an order with a higher simulated peak.

Effects are explicit: an op that writes an input in place (``attention`` splicing the KV
cache) gets an edge from every other reader of that input, so no read moves past the write.
A paged layer's ``kv_gather`` reads only graph inputs, so it is ready from the start: it waits
for its consumers' other inputs instead (``LATE_OPS``), else memory-min would run every layer's
gather before a wide projection and keep all layers' scratch alive at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dinfer_rt.ir import Graph, Node, Value, op_def

DEFAULT_BINDINGS = {"B": 1, "T": 64, "S": 64}
LATE_OPS = ("kv_gather",)
"""Ops that only copy graph inputs into fresh scratch: scheduled no earlier than the other inputs
of the ops that read them, so the scratch lives from just before its use."""


def nbytes(v: Value, bindings: dict[str, int]) -> int:
    n = 1
    for d in v.type.shape:
        n *= d if isinstance(d, int) else bindings.get(d, 1)
    return n * torch.empty((), dtype=v.type.dtype).element_size()


def dependencies(graph: Graph) -> list[set[int]]:
    """preds[i] = indices of nodes that must run before node i (data and effect edges)."""
    producer = {id(o): i for i, n in enumerate(graph.nodes) for o in n.outputs}
    readers: dict[int, list[int]] = {}
    preds: list[set[int]] = [set() for _ in graph.nodes]
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            if v is not None:
                readers.setdefault(id(v), []).append(i)
                if id(v) in producer:
                    preds[i].add(producer[id(v)])
    for i, n in enumerate(graph.nodes):
        for slot in op_def(n.op).mutates:
            if slot < len(n.inputs) and n.inputs[slot] is not None:
                preds[i] |= {r for r in readers[id(n.inputs[slot])] if r != i}  # read before write
    for i, n in enumerate(graph.nodes):
        if n.op in LATE_OPS:
            preds[i] |= _late_edges(graph, i, preds, readers)
    return preds


def _late_edges(graph: Graph, i: int, preds: list[set[int]], readers: dict[int, list[int]]) -> set[int]:
    """What node ``i``'s consumers wait for besides ``i``, less anything downstream of ``i`` (an
    edge from there would be a cycle)."""
    succs: dict[int, list[int]] = {}
    for j, ps in enumerate(preds):
        for p in ps:
            succs.setdefault(p, []).append(j)
    after, todo = {i}, [i]
    while todo:
        for j in succs.get(todo.pop(), ()):
            if j not in after:
                after.add(j)
                todo.append(j)
    consumers = {c for o in graph.nodes[i].outputs for c in readers.get(id(o), ())}
    return {p for c in consumers for p in preds[c] if p not in after}


def workspace_bytes(node: Node, bindings: dict[str, int]) -> int:
    """Temporary memory an op needs while it runs, beyond its outputs: ``confidence`` builds the
    fp32 probabilities of its whole input; the fused ``lm_head_confidence`` one vocabulary chunk."""
    if node.op == "confidence":
        return nbytes(node.inputs[0], bindings) // node.inputs[0].type.dtype.itemsize * 4
    if node.op == "lm_head_confidence":
        rows = nbytes(node.outputs[0], bindings) // node.outputs[0].type.dtype.itemsize
        return rows * min(node.attrs.get("chunk", 8192), node.inputs[1].type.shape[0]) * 4
    return 0


def fresh_outputs(node: Node) -> list[Value]:
    """Outputs that need new memory: an op's trailing outputs alias the inputs it mutates
    (the KV caches returned by ``attention``)."""
    mutated = sum(1 for s in op_def(node.op).mutates if s < len(node.inputs) and node.inputs[s] is not None)
    return node.outputs[: len(node.outputs) - mutated]


def peak_bytes(graph: Graph, order: list[int], bindings: dict[str, int] = DEFAULT_BINDINGS) -> int:
    """Peak bytes of live node outputs, plus each op's workspace while it runs, when running
    ``order`` (inputs and weights not counted; graph outputs stay live to the end)."""
    nodes = graph.nodes
    last: dict[int, int] = {}
    for pos, i in enumerate(order):
        for v in nodes[i].inputs:
            if v is not None:
                last[id(v)] = pos
    keep = {id(v) for v in graph.outputs.values()}
    live = peak = 0
    freeing: dict[int, int] = {}
    for pos, i in enumerate(order):
        for o in fresh_outputs(nodes[i]):
            size = nbytes(o, bindings)
            live += size
            if id(o) not in keep:
                end = last.get(id(o), pos)
                freeing[end] = freeing.get(end, 0) + size
        peak = max(peak, live + workspace_bytes(nodes[i], bindings))  # outputs and workspace coexist
        live -= freeing.pop(pos, 0)
    return peak


Priority = Callable[[Node, dict[int, int], dict[str, int]], float]


def memory_min(node: Node, remaining_uses: dict[int, int], bindings: dict[str, int]) -> float:
    """Prefer nodes that free the most bytes (inputs at their last use) and allocate the least."""
    freed = sum(
        nbytes(v, bindings)
        for v in node.inputs
        if v is not None and v.kind == "node" and remaining_uses.get(id(v)) == 1
    )
    alloc = sum(nbytes(o, bindings) for o in node.outputs)
    return freed - alloc


def list_schedule(
    graph: Graph, priority: Priority = memory_min, bindings: dict[str, int] = DEFAULT_BINDINGS
) -> list[int]:
    """A topological order chosen greedily by ``priority`` (ties: original order)."""
    preds = dependencies(graph)
    succs: list[list[int]] = [[] for _ in graph.nodes]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    waiting = [len(ps) for ps in preds]
    uses: dict[int, int] = {}
    for n in graph.nodes:
        for v in n.inputs:
            if v is not None:
                uses[id(v)] = uses.get(id(v), 0) + 1
    ready = [i for i, w in enumerate(waiting) if w == 0]
    order = []
    while ready:
        best = max(ready, key=lambda i: (priority(graph.nodes[i], uses, bindings), -i))
        ready.remove(best)
        order.append(best)
        for v in graph.nodes[best].inputs:
            if v is not None:
                uses[id(v)] -= 1
        for s in succs[best]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    if len(order) != len(graph.nodes):
        raise ValueError(f"graph {graph.name} has a cycle through its ordering edges")
    return order


def reorder(graph: Graph, ctx, priority: Priority | None = None) -> int:
    """Pass: adopt the list schedule when its simulated peak is lower; report both peaks. The
    priority is the argument, else the backend's (``ctx.priority``), else memory-min."""
    priority = priority or getattr(ctx, "priority", None) or memory_min
    identity = list(range(len(graph.nodes)))
    order = list_schedule(graph, priority)
    before, after = peak_bytes(graph, identity), peak_bytes(graph, order)
    if ctx is not None:
        ctx.reports["peak_bytes"] = {"before": before, "after": min(before, after)}
    if after >= before or order == identity:
        return 0
    graph.nodes = [graph.nodes[i] for i in order]
    return sum(1 for a, b in zip(order, identity) if a != b)


def buffer_plan(graph: Graph, bindings: dict[str, int] = DEFAULT_BINDINGS) -> tuple[dict[int, int], int]:
    """First-fit offsets for node outputs by lifetime: returns (offset per value id, arena bytes)."""
    last: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            if v is not None:
                last[id(v)] = i
    end = len(graph.nodes)
    for v in graph.outputs.values():
        last[id(v)] = end
    placed: list[tuple[int, int, int, int]] = []  # (start, stop, offset, size)
    offsets: dict[int, int] = {}
    arena = 0
    for i, n in enumerate(graph.nodes):
        for o in fresh_outputs(n):
            size, stop = nbytes(o, bindings), last.get(id(o), i)
            busy = sorted((off, off + sz) for s, e, off, sz in placed if not (e < i or s > stop))
            offset = 0
            for lo, hi in busy:
                if offset + size <= lo:
                    break
                offset = max(offset, hi)
            placed.append((i, stop, offset, size))
            offsets[id(o)] = offset
            arena = max(arena, offset + size)
    return offsets, arena
