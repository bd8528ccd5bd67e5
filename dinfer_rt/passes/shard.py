"""The tensor-parallel sharding pass: a lowered graph rewritten for rank r of N.

Megatron-style, as vLLM does it: Q/K/V and gate/up are column-parallel (each rank computes its
heads and its slice of the intermediate size), O and down are row-parallel, each followed by an
``all_reduce`` (sum): two all-reduces of [tokens x hidden] per layer. When there are fewer KV
heads than ranks, every rank holds one KV head (replicated), the one its query heads read.
LLaDA2's fused query_key_value weight is split into each rank's Q, K and V rows (three ranges
of one tensor). Mixture-of-experts layers split their routed experts one of two ways, as vLLM
does: by default **tensor-parallel experts** (every rank holds every expert's 1/N slice of the
intermediate size: gate/up rows, down columns), or with ``expert_parallel`` **expert
parallelism** (each rank holds E/N whole experts and the MoE op computes only its own experts'
contributions). Either way the router runs on every rank (replicated, so every rank routes
identically) and one ``all_reduce`` sums the ranks' partial outputs; shared experts and dense
layers are tensor-parallel. (All-reduce rather than an all-to-all dispatch: measured in
``benchmarks/moe_dispatch_bench.py`` against an all-to-all dispatch and combine; with every rank
holding every token the all-to-all moves fewer bytes only past 2 x top-k ranks.) An untied LM head
is **vocabulary-parallel**: each rank holds ceil(V/N) rows; the confidence head reduces each
rank's logits to a few statistics and all-reduces them (``vocab_parallel_confidence``: the full
logits are never gathered), and the logits head all-gathers the shards. Embedding and norms
(and a tied LM head, which is the embedding) stay replicated. The pass runs before the backend's fusion passes, so fused
kernels see the local shapes; the loader reads each rank's weight slices (``shard_ranges``,
``TensorParallel.expert_range``) straight from the safetensors files.
"""

from __future__ import annotations

from dataclasses import dataclass

from dinfer_rt.errors import ConfigError
from dinfer_rt.ir import Graph, Node, TensorType, Value
from dinfer_rt.ir.ops import op_def, vocab_shard
from dinfer_rt.model_spec import ModelSpec

COLUMN = ("q", "k", "v", "qkv", "gate", "up", "shared_gate", "shared_up")  # weight rows split; their biases too
ROW = ("o", "down", "shared_down")  # weight columns split; the output is summed over ranks
EXPERT = ("experts_gate_up", "experts_down")  # stacked experts split along dim 0 (expert parallelism)
MOE_OPS = ("moe_experts", "moe_routed")


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``world`` ranks; the sizes each rank holds. ``expert_parallel``: routed
    experts split whole (E/N per rank) rather than each expert's intermediate size."""

    rank: int
    world: int
    expert_parallel: bool = False

    def kv_heads(self, spec: ModelSpec) -> int:
        return spec.n_kv_heads // self.world if spec.n_kv_heads >= self.world else 1

    def kv_head_range(self, spec: ModelSpec) -> tuple[int, int]:
        """The KV heads this rank holds: its share, or the one head its query heads read."""
        if spec.n_kv_heads >= self.world:
            n = spec.n_kv_heads // self.world
            return self.rank * n, (self.rank + 1) * n
        h = self.rank * spec.n_kv_heads // self.world
        return h, h + 1

    def expert_range(self, spec: ModelSpec) -> tuple[int, int]:
        """The routed experts this rank holds: a contiguous E/N block under expert parallelism,
        all of them (each sliced) otherwise."""
        if not self.expert_parallel:
            return 0, spec.moe.n_experts
        n = spec.moe.n_experts // self.world
        return self.rank * n, (self.rank + 1) * n

    def expert_intermediate_range(self, spec: ModelSpec) -> tuple[int, int]:
        """Tensor-parallel experts: the rows of each expert's gate / up (columns of its down) held."""
        if self.expert_parallel:
            return 0, spec.moe.expert_intermediate
        n = spec.moe.expert_intermediate // self.world
        return self.rank * n, (self.rank + 1) * n


def check_split(spec: ModelSpec, world: int, expert_parallel: bool = False) -> None:
    """Whether ``spec`` splits over ``world`` ranks; a one-line error naming the field if not
    (before any weight is read)."""
    where = f"tensor parallel size {world}"
    if world < 1:
        raise ConfigError(f"{where}: must be >= 1")
    if world == 1:
        if expert_parallel:  # one rank holds every expert: it would be ignored
            raise ConfigError(f"expert parallelism splits MoE experts over tensor-parallel ranks; {where} has one")
        return
    if spec.n_heads % world:
        raise ConfigError(f"{where} does not divide the {spec.n_heads} attention heads (n_heads)")
    if spec.n_kv_heads >= world and spec.n_kv_heads % world:
        raise ConfigError(f"{where} does not divide the {spec.n_kv_heads} KV heads (n_kv_heads)")
    if spec.n_kv_heads < world and world % spec.n_kv_heads:
        raise ConfigError(f"{where} is not a multiple of the {spec.n_kv_heads} KV heads (replicated KV heads)")
    moe = spec.moe
    if moe is None:
        if expert_parallel:  # nothing to split by expert: it would be plain tensor parallelism
            raise ConfigError(
                f"expert parallelism splits MoE experts over the ranks; this model ({spec.family}) has none"
            )
        if spec.intermediate % world:
            raise ConfigError(f"{where} does not divide the MLP intermediate size {spec.intermediate}")
        return
    if expert_parallel and world > moe.n_experts:
        raise ConfigError(f"{where}: more ranks than the {moe.n_experts} experts (expert parallelism)")
    if expert_parallel and moe.n_experts % world:
        raise ConfigError(f"{where} does not divide the {moe.n_experts} experts (expert parallelism)")
    if not expert_parallel and moe.expert_intermediate % world:
        raise ConfigError(
            f"{where} does not divide the experts' intermediate size {moe.expert_intermediate} "
            "(tensor-parallel experts; --expert-parallel splits whole experts instead)"
        )
    if moe.n_shared and (moe.expert_intermediate * moe.n_shared) % world:
        raise ConfigError(f"{where} does not divide the shared experts' size {moe.expert_intermediate * moe.n_shared}")
    dense = any(not spec.is_moe_layer(i) for i in range(spec.n_layers))
    if dense and moe.dense_intermediate % world:
        raise ConfigError(f"{where} does not divide the dense layers' intermediate size {moe.dense_intermediate}")


def role(param: str) -> str | None:
    """``layers.3.q_bias`` -> "q"; None for replicated parameters."""
    parts = param.split(".")
    if len(parts) != 3 or parts[0] != "layers":
        return None
    name = parts[2].removesuffix("_bias")
    return name if name in COLUMN + ROW + EXPERT else None


def vocab_parallel(spec: ModelSpec) -> bool:
    """Whether the LM head is split over the vocabulary (untied: a tied head is the embedding)."""
    return not spec.tie_embeddings


def local_shape(param: str, shape: tuple, spec: ModelSpec, tp: TensorParallel) -> tuple:
    """The shape rank ``tp.rank`` holds of parameter ``param`` (whole shape ``shape``)."""
    r, d = role(param), spec.head_dim
    if param == "lm_head" and vocab_parallel(spec) and tp.world > 1:
        lo, hi = vocab_shard(shape[0], tp.rank, tp.world)
        return (hi - lo, *shape[1:])
    if r is None:
        return shape
    if r in EXPERT and tp.expert_parallel:
        return (spec.moe.n_experts // tp.world, *shape[1:])
    if r == "experts_gate_up":  # tensor-parallel experts: [E, 2I, H] -> [E, 2I/N, H]
        return (shape[0], shape[1] // tp.world, shape[2])
    if r == "experts_down":  # [E, H, I] -> [E, H, I/N]
        return (*shape[:2], shape[2] // tp.world)
    heads = {"q": spec.n_heads // tp.world, "k": tp.kv_heads(spec), "v": tp.kv_heads(spec)}
    heads["qkv"] = heads["q"] + 2 * heads["k"]
    if r in heads:
        return (heads[r] * d, *shape[1:])
    if r in COLUMN:
        return (shape[0] // tp.world, *shape[1:])
    if r == "o":
        return (shape[0], spec.n_heads // tp.world * d)
    return (shape[0], shape[1] // tp.world)


def shard_ranges(param: str, shape: tuple, spec: ModelSpec, tp: TensorParallel) -> tuple[int, list] | None:
    """``(dim, [(lo, hi), ...])``: the ranges of ``param`` rank ``tp.rank`` holds, concatenated in
    order (rows of a column-parallel weight and its bias, columns of a row-parallel one; Q, K and
    V rows of a fused QKV weight); None if replicated. For stacked experts the ranges apply to
    each expert's own source tensor (tensor-parallel experts: gate / up rows, down columns);
    which experts a rank reads is ``expert_range``."""
    r, d = role(param), spec.head_dim
    if param == "lm_head" and vocab_parallel(spec) and tp.world > 1:
        return 0, [vocab_shard(shape[0], tp.rank, tp.world)]
    if r is None or tp.world == 1 or (r in EXPERT and tp.expert_parallel):
        return None
    if r in EXPERT:
        return (0 if r == "experts_gate_up" else 1), [tp.expert_intermediate_range(spec)]
    q = spec.n_heads // tp.world * d
    q_rng = (tp.rank * q, (tp.rank + 1) * q)
    h0, h1 = tp.kv_head_range(spec)
    kv_rng = (h0 * d, h1 * d)
    if r in ("q", "o"):
        ranges = [q_rng]
    elif r in ("k", "v"):
        ranges = [kv_rng]
    elif r == "qkv":  # rows [q | k | v] of the fused weight
        dq, dkv = spec.n_heads * d, spec.n_kv_heads * d
        ranges = [q_rng, (dq + kv_rng[0], dq + kv_rng[1]), (dq + dkv + kv_rng[0], dq + dkv + kv_rng[1])]
    else:
        row = r in ROW and not param.endswith("_bias")
        n = (shape[1] if row else shape[0]) // tp.world
        ranges = [(tp.rank * n, (tp.rank + 1) * n)]
    return (1 if r in ROW and not param.endswith("_bias") else 0), ranges


def shard_graph(graph: Graph, spec: ModelSpec, tp: TensorParallel) -> Graph:
    """Rewrite ``graph`` (lowered for the whole model) in place for rank ``tp.rank``."""
    check_split(spec, tp.world, tp.expert_parallel)
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
    head_linear: dict[int, Node] = {}  # id(logits) -> the vocabulary-parallel LM head linear
    lo, _ = vocab_shard(spec.vocab, tp.rank, tp.world)
    sizes = tuple(b - a for a, b in (vocab_shard(spec.vocab, r, tp.world) for r in range(tp.world)))
    for node in graph.nodes:
        node.inputs = [None if v is None else replace.get(id(v), v) for v in node.inputs]
        if vocab_parallel(spec) and node.op == "confidence" and id(node.inputs[0]) in head_linear:
            lin = head_linear.pop(id(node.inputs[0]))
            nodes.remove(lin)  # the per-rank statistics replace the [positions x vocab] logits
            node.op, node.inputs = "vocab_parallel_confidence", lin.inputs[:2]
            node.attrs = {**node.attrs, "vocab_offset": lo, "group": "tp"}
            _reinfer(node)
            nodes.append(node)
            continue
        if node.op == "linear" and node.inputs[1].kind == "param":
            r = role(node.inputs[1].name)
            if r in ROW and len(node.inputs) > 2 and node.inputs[2] is not None:
                raise ConfigError(f"tensor parallel: row-parallel {node.inputs[1].name} has a bias (not supported)")
            made_by[id(node.outputs[0])] = r
        if node.op == "split" and made_by.get(id(node.inputs[0])) == "qkv":
            d = spec.head_dim
            node.attrs["sizes"] = (spec.n_heads // tp.world * d, kv_local * d, kv_local * d)
            for out, r in zip(node.outputs, ("q", "k", "v")):
                made_by[id(out)] = r
        if node.op == "view_heads":
            r = made_by.get(id(node.inputs[0]))
            if r == "q":
                node.attrs["heads"] = spec.n_heads // tp.world
            elif r in ("k", "v"):
                node.attrs["heads"] = kv_local
        if node.op in MOE_OPS and tp.expert_parallel:
            node.attrs["first_expert"] = tp.expert_range(spec)[0]
        _reinfer(node)
        nodes.append(node)
        if vocab_parallel(spec) and node.op == "linear" and node.inputs[1].name == "lm_head":
            head_linear[id(node.outputs[0])] = node
        if (node.op == "linear" and made_by.get(id(node.outputs[0])) in ROW) or node.op in MOE_OPS:
            partial = node.outputs[0]
            summed = Value(f"{partial.name}.allreduce", partial.type)
            nodes.append(Node("all_reduce", [partial], {"op": "sum", "group": "tp"}, [summed]))
            replace[id(partial)] = summed
    for lin in head_linear.values():  # the logits head: gather the vocabulary shards (once, at the output)
        local = lin.outputs[0]
        full = Value(f"{local.name}.allgather", local.type.with_shape(*local.type.shape[:-1], spec.vocab))
        nodes.insert(nodes.index(lin) + 1, Node("all_gather", [local], {"sizes": sizes, "group": "tp"}, [full]))
        replace[id(local)] = full
    graph.nodes = nodes
    graph.outputs = {k: replace.get(id(v), v) for k, v in graph.outputs.items()}
    graph.name = f"{graph.name}_tp{tp.rank}of{tp.world}"
    return graph.verify()


def _reinfer(node: Node) -> None:
    types = op_def(node.op).infer([None if v is None else v.type for v in node.inputs], node.attrs)
    for out, t in zip(node.outputs, types):
        out.type = t
