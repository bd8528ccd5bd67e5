"""The tensor-parallel sharding pass: a lowered dense graph rewritten for rank r of N.

Megatron-style, as vLLM does it: Q/K/V and gate/up are column-parallel (each rank computes its
heads and its slice of the intermediate size), O and down are row-parallel, each followed by an
``all_reduce`` (sum): two all-reduces of [tokens x hidden] per layer. When there are fewer KV
heads than ranks, every rank holds one KV head (replicated), the one its query heads read.
Embedding, norms and the LM head stay replicated. The pass runs before the backend's fusion
passes, so fused kernels see the local shapes; the loader reads each rank's weight slices
(``shard_range``) straight from the safetensors files.
"""

from __future__ import annotations

from dataclasses import dataclass

from dinfer_rt.errors import ConfigError
from dinfer_rt.ir import Graph, Node, TensorType, Value
from dinfer_rt.ir.ops import op_def
from dinfer_rt.spec import ModelSpec

COLUMN = ("q", "k", "v", "gate", "up")  # weight rows split; their biases too
ROW = ("o", "down")  # weight columns split; the output is summed over ranks


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``world`` ranks; the sizes each rank holds."""

    rank: int
    world: int

    def kv_heads(self, spec: ModelSpec) -> int:
        return spec.n_kv_heads // self.world if spec.n_kv_heads >= self.world else 1

    def kv_head_range(self, spec: ModelSpec) -> tuple[int, int]:
        """The KV heads this rank holds: its share, or the one head its query heads read."""
        if spec.n_kv_heads >= self.world:
            n = spec.n_kv_heads // self.world
            return self.rank * n, (self.rank + 1) * n
        h = self.rank * spec.n_kv_heads // self.world
        return h, h + 1


def check_split(spec: ModelSpec, world: int) -> None:
    """Whether ``spec`` splits over ``world`` ranks; a one-line error naming the field if not
    (before any weight is read)."""
    where = f"tensor parallel size {world}"
    if world < 1:
        raise ConfigError(f"{where}: must be >= 1")
    if world == 1:
        return
    if spec.moe is not None:
        raise ConfigError(f"{where}: {spec.family} has mixture-of-experts layers; expert parallelism is not built yet")
    if spec.fused_qkv:
        raise ConfigError(f"{where}: {spec.family}'s fused query_key_value weight is not split yet")
    if spec.n_heads % world:
        raise ConfigError(f"{where} does not divide the {spec.n_heads} attention heads (n_heads)")
    if spec.n_kv_heads >= world and spec.n_kv_heads % world:
        raise ConfigError(f"{where} does not divide the {spec.n_kv_heads} KV heads (n_kv_heads)")
    if spec.n_kv_heads < world and world % spec.n_kv_heads:
        raise ConfigError(f"{where} is not a multiple of the {spec.n_kv_heads} KV heads (replicated KV heads)")
    if spec.intermediate % world:
        raise ConfigError(f"{where} does not divide the MLP intermediate size {spec.intermediate}")


def role(param: str) -> str | None:
    """``layers.3.q_bias`` -> "q"; None for replicated parameters."""
    parts = param.split(".")
    if len(parts) != 3 or parts[0] != "layers":
        return None
    name = parts[2].removesuffix("_bias")
    return name if name in COLUMN + ROW else None


def local_shape(param: str, shape: tuple, spec: ModelSpec, tp: TensorParallel) -> tuple:
    """The shape rank ``tp.rank`` holds of parameter ``param``."""
    r, d = role(param), spec.head_dim
    if r is None:
        return shape
    rows = {
        "q": spec.n_heads // tp.world * d,
        "k": tp.kv_heads(spec) * d,
        "v": tp.kv_heads(spec) * d,
        "gate": spec.intermediate // tp.world,
        "up": spec.intermediate // tp.world,
    }
    if r in rows:
        return (rows[r], *shape[1:])
    cols = spec.n_heads // tp.world * d if r == "o" else spec.intermediate // tp.world
    return (shape[0], cols)


def shard_range(param: str, spec: ModelSpec, tp: TensorParallel) -> tuple[int, int, int] | None:
    """``(dim, lo, hi)``: the slice of parameter ``param`` rank ``tp.rank`` holds (rows of a
    column-parallel weight and its bias, columns of a row-parallel one); None if replicated."""
    r, d = role(param), spec.head_dim
    if r is None or tp.world == 1:
        return None
    if r in ("q", "o"):
        n = spec.n_heads // tp.world * d
        lo, hi = tp.rank * n, (tp.rank + 1) * n
    elif r in ("k", "v"):
        h0, h1 = tp.kv_head_range(spec)
        lo, hi = h0 * d, h1 * d
    else:
        n = spec.intermediate // tp.world
        lo, hi = tp.rank * n, (tp.rank + 1) * n
    return (1 if r in ROW and not param.endswith("_bias") else 0), lo, hi


def shard_graph(graph: Graph, spec: ModelSpec, tp: TensorParallel) -> Graph:
    """Rewrite ``graph`` (lowered for the whole model) in place for rank ``tp.rank``."""
    check_split(spec, tp.world)
    if tp.world == 1:
        return graph
    for p in graph.params:
        p.type = TensorType(local_shape(p.name, p.type.shape, spec, tp), p.type.dtype)
    kv_local = tp.kv_heads(spec)
    for v in graph.inputs:
        if v.name.startswith(("k_cache.", "v_cache.")):
            b, s, _, d = v.type.shape
            v.type = TensorType((b, s, kv_local, d), v.type.dtype)
    made_by: dict[int, str] = {}  # id(value) -> role of the linear that produced it
    replace: dict[int, Value] = {}
    nodes: list[Node] = []
    for node in graph.nodes:
        node.inputs = [None if v is None else replace.get(id(v), v) for v in node.inputs]
        if node.op == "linear" and node.inputs[1].kind == "param":
            r = role(node.inputs[1].name)
            if r in ROW and len(node.inputs) > 2 and node.inputs[2] is not None:
                raise ConfigError(f"tensor parallel: row-parallel {node.inputs[1].name} has a bias (not supported)")
            made_by[id(node.outputs[0])] = r
        if node.op == "view_heads":
            r = made_by.get(id(node.inputs[0]))
            if r == "q":
                node.attrs["heads"] = spec.n_heads // tp.world
            elif r in ("k", "v"):
                node.attrs["heads"] = kv_local
        _reinfer(node)
        nodes.append(node)
        if node.op == "linear" and made_by.get(id(node.outputs[0])) in ROW:
            partial = node.outputs[0]
            summed = Value(f"{partial.name}.allreduce", partial.type)
            nodes.append(Node("all_reduce", [partial], {"op": "sum", "group": "tp"}, [summed]))
            replace[id(partial)] = summed
    graph.nodes = nodes
    graph.outputs = {k: replace.get(id(v), v) for k, v in graph.outputs.items()}
    graph.name = f"{graph.name}_tp{tp.rank}of{tp.world}"
    return graph.verify()


def _reinfer(node: Node) -> None:
    types = op_def(node.op).infer([None if v is None else v.type for v in node.inputs], node.attrs)
    for out, t in zip(node.outputs, types):
        out.type = t
