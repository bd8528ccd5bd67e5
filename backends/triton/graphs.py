"""Device graphs for fixed-shape forwards (``DINFER_GRAPHS=1``; CUDA graphs, ACL graphs on
Ascend): the first call with a given
input signature warms the executable up, captures it into a graph with static input buffers,
and every later call with that signature copies its inputs in and replays the graph: one launch
instead of one per op, no Python dispatch in between. The KV caches, which the graph mutates in
place, are bound by address (a new cache means a new capture); everything else is copied.

A call may run eagerly instead (``eager=True``, or inside ``model_runner.eager_forwards``): the
engine runs every forward whose shape is outside its batch-size buckets that way (per-row
windows, a batch above the largest bucket), so captures stay bounded by buckets x window
shapes. Each cache counts its captures (per batch rows), replays, eager calls and the device
memory its graphs hold (the allocator's growth over each capture; 0 with a stand-in API).

The device API sits behind ``GraphAPI`` so the bookkeeping is tested on the CPU with a stand-in
that replays by re-running; the real capture needs a GPU (``benchmarks/gpu_check.py`` compares
graphed and eager forwards there).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from dinfer_rt.executor import Executable
from dinfer_rt.ir import OPS
from dinfer_rt.model_runner import graphs_allowed

Run = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


class GraphAPI:
    """Device graphs through torch's CUDA-style API: ``torch.cuda`` (CUDAGraph) or, with
    torch_npu imported, ``torch.npu`` (NPUGraph, ACL graphs; the same API shape). Warm up on a
    side stream, then capture one call."""

    def __init__(self, device: str = "cuda") -> None:
        self.mod = getattr(torch, device)
        self.graph_cls = self.mod.CUDAGraph if device == "cuda" else self.mod.NPUGraph

    def capture(self, fn: Callable[[], dict[str, torch.Tensor]], warmup: int):
        stream = self.mod.Stream()
        stream.wait_stream(self.mod.current_stream())
        with self.mod.stream(stream):
            for _ in range(warmup):  # Triton JIT compiles and allocator growth happen here
                fn()
        self.mod.current_stream().wait_stream(stream)
        graph = self.graph_cls()
        with self.mod.graph(graph):
            outputs = fn()
        return graph, outputs

    def memory(self) -> int:
        """Bytes the device allocator holds (a capture's growth: its graph's private pool)."""
        return int(self.mod.memory_reserved())


@dataclass
class _Entry:
    graph: object
    static: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    nbytes: int = 0  # device memory the capture added (its pool, static inputs and outputs)


def mutated_inputs(exe: Executable) -> set[str]:
    """Graph inputs some op writes in place (the KV caches): bound by address, not copied."""
    names = set()
    for node in exe.graph.nodes:
        for i in OPS[node.op].mutates:
            if i < len(node.inputs) and node.inputs[i] is not None and node.inputs[i].kind == "input":
                names.add(node.inputs[i].name)
    return names


class GraphCache:
    """Captured graphs per input signature (shapes, dtypes, and the addresses of in-place
    inputs), least recently used dropped beyond ``capacity`` (each graph holds a memory pool).
    Outputs are the graph's static buffers: valid until the next call. A call with ``eager``
    runs ``run`` directly and captures nothing.

    ``capacity``: the engine's lockstep forwards need (batch-size buckets) x (window shapes:
    the refresh and the block step per sequence length) graphs per executable, so the default
    holds 5 buckets x 2 windows with room to spare."""

    def __init__(self, run: Run, pinned: set[str], api, warmup: int = 2, capacity: int = 16) -> None:
        self.run, self.pinned, self.api, self.warmup, self.capacity = run, pinned, api, warmup, capacity
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.captures = 0
        self.replays = 0
        self.eager = 0  # calls run eagerly on request (shapes outside the engine's buckets)
        self.evictions = 0
        self.nbytes = 0  # device memory the live graphs hold
        self.captures_by_rows: Counter[int] = Counter()  # captures per batch rows (input_ids' first dim)

    def signature(self, inputs: Mapping[str, torch.Tensor]) -> tuple:
        return tuple(
            (n, tuple(t.shape), t.dtype, t.data_ptr() if n in self.pinned else None) for n, t in sorted(inputs.items())
        )

    def _memory(self) -> int:
        memory = getattr(self.api, "memory", None)  # a stand-in API may have none: 0
        return memory() if memory is not None else 0

    def __call__(self, inputs: Mapping[str, torch.Tensor], eager: bool = False) -> dict[str, torch.Tensor]:
        if eager:
            self.eager += 1
            return self.run(inputs)
        key = self.signature(inputs)
        entry = self.entries.get(key)
        if entry is None:
            before = self._memory()
            static = {n: t.clone() for n, t in inputs.items() if n not in self.pinned}
            args = {**inputs, **static}
            graph, outputs = self.api.capture(lambda: self.run(args), self.warmup)
            entry = self.entries[key] = _Entry(graph, static, outputs, max(0, self._memory() - before))
            self.captures += 1
            self.nbytes += entry.nbytes
            ids = inputs.get("input_ids")
            self.captures_by_rows[ids.shape[0] if ids is not None and ids.dim() else 0] += 1
            if len(self.entries) > self.capacity:
                _, dropped = self.entries.popitem(last=False)
                self.nbytes -= dropped.nbytes
                self.evictions += 1
        else:
            self.entries.move_to_end(key)
            for n, buf in entry.static.items():
                buf.copy_(inputs[n])
            self.replays += 1
        entry.graph.replay()
        return entry.outputs


class GraphedExecutable(Executable):
    """An Executable whose calls go through a GraphCache (same graph, kernels and metadata)."""

    def __init__(self, exe: Executable, api=None) -> None:
        self.__dict__.update(exe.__dict__)
        self.graphs = GraphCache(
            lambda inputs: Executable.__call__(self, inputs), mutated_inputs(exe), api or GraphAPI()
        )

    def __call__(self, inputs: Mapping[str, torch.Tensor], eager: bool | None = None) -> dict[str, torch.Tensor]:
        """``eager`` None: eager where the caller's runner says so (``model_runner.eager_forwards``)."""
        self.check_inputs(inputs)
        return self.graphs(inputs, eager=not graphs_allowed() if eager is None else eager)
