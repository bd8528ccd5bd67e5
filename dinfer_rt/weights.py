"""Assemble IR parameters from checkpoint tensors under a dtype policy."""

from __future__ import annotations

import torch

from dinfer_rt import quant
from dinfer_rt.checkpoint import Checkpoint
from dinfer_rt.dtypes import accumulate_dtype
from dinfer_rt.errors import CheckpointError
from dinfer_rt.model_spec import IGNORED_TENSOR_SUFFIXES, ModelSpec, ParamPlan, param_plan


def gptq_sources(spec: ModelSpec, plan: list[ParamPlan], gptq: dict) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """GPTQ checkpoint tensor -> (IR parameter, GPTQ tensor kind, expected shape) for every
    quantised projection (``X.weight`` is stored as ``X.qweight`` / ``qzeros`` / ``scales`` / ``g_idx``)."""
    out = {}
    for p in plan:
        if quant.is_quantizable(p.name):
            stem = p.sources[0].removesuffix(".weight")
            shapes = quant.gptq_shapes(*p.shape, gptq["group_size"], f"tensor {stem!r}")
            for kind in quant.GPTQ_SUFFIXES:
                out[f"{stem}.{kind}"] = (p.name, kind, shapes[kind])
    return out


def check_layer_count(ckpt: Checkpoint, spec: ModelSpec) -> None:
    """A config.json layer count the checkpoint cannot hold, refused before the per-layer plan is
    built: every decoder layer has several tensors, so more layers than tensors is a wrong field
    (a count of 10**30 would otherwise build its plan until memory runs out)."""
    held = len(ckpt.names())
    if spec.n_layers > held:
        raise CheckpointError(
            f"{ckpt.dir / 'config.json'}: the model has {spec.n_layers} layers by config.json, but the checkpoint "
            f"holds only {held} tensor(s) in all and every layer needs several; is the layer count right?"
        )


def check_tensors(ckpt: Checkpoint, spec: ModelSpec, plan: list[ParamPlan], gptq: dict | None = None) -> None:
    """Missing, unexpected or mis-shaped tensors: one error naming the tensor and file."""
    expected: dict[str, tuple[int, ...]] = {}
    for p in plan:
        if gptq is None or not quant.is_quantizable(p.name):
            expected.update(zip(p.sources, p.source_shapes))
    if gptq is not None:
        expected.update({src: shape for src, (_, _, shape) in gptq_sources(spec, plan, gptq).items()})
    present = ckpt.names()
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{ckpt.dir}: missing tensor {missing[0]!r}{more}; a {spec.family} model with this config.json "
            f"needs shape {list(expected[missing[0]])}"
        )
    unexpected = sorted(n for n in present - expected.keys() if not n.endswith(IGNORED_TENSOR_SUFFIXES))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(
            f"{ckpt.files[unexpected[0]]}: unexpected tensor {unexpected[0]!r}{more}: not part of a {spec.family} "
            f"model with {spec.n_layers} layers as config.json describes"
        )
    for name, want in expected.items():
        got = ckpt.shapes[name]
        if got != want:
            raise CheckpointError(
                f"{ckpt.files[name]}: tensor {name!r} has shape {list(got)}, expected {list(want)} from config.json"
            )


def check_values(ckpt: Checkpoint, name: str, tensor: torch.Tensor, converted: torch.Tensor | None) -> None:
    """A float weight that is not a float, or holds NaN / infinity (before or after the dtype
    conversion): one error naming the tensor and file."""
    where = f"{ckpt.files[name]}: tensor {name!r}"
    if not tensor.dtype.is_floating_point:
        raise CheckpointError(f"{where} has integer dtype {tensor.dtype}; a float weight belongs here")
    if converted is None:
        return
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(
            f"{where} holds {bad} NaN/infinite value(s) (pass check_weights=False / --no-check-weights to skip)"
        )
    if not bool(torch.isfinite(converted).all()):
        raise CheckpointError(f"{where} overflows {converted.dtype}: its values exceed the dtype's range")


def load_gptq(
    ckpt: Checkpoint, spec: ModelSpec, plan: list[ParamPlan], gptq: dict, dtype: torch.dtype, weights, device="cpu"
) -> None:
    """Read a GPTQ checkpoint's packed projections as stored (scales converted to ``dtype``)
    into ``weights`` under ``<param>@gptq4.<kind>``; a g_idx naming a group that does not exist
    or a non-finite scale is one error naming the tensor."""
    sources = gptq_sources(spec, plan, gptq)
    for src, tensor in ckpt.read(list(sources)):
        name, kind, _ = sources[src]
        where = f"{ckpt.files[src]}: tensor {src!r}"
        if kind == "scales":
            check_values(ckpt, src, tensor, tensor.to(dtype))
            tensor = tensor.to(dtype)
        elif tensor.dtype != torch.int32:
            raise CheckpointError(f"{where} has dtype {tensor.dtype}; GPTQ stores {kind} as int32")
        if kind == "g_idx":
            groups = quant.gptq_shapes(*next(p.shape for p in plan if p.name == name), gptq["group_size"], where)
            n_groups = groups["scales"][0]
            if int(tensor.min()) < 0 or int(tensor.max()) >= n_groups:
                raise CheckpointError(f"{where} names groups outside [0, {n_groups}) (group_size {gptq['group_size']})")
        weights[f"{name}@gptq4.{kind}"] = tensor.to(device)


def load_weights(
    ckpt: Checkpoint,
    spec: ModelSpec,
    dtype: torch.dtype,
    check_weights: bool = True,
    tensor_parallel=None,
    quantization: str | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Read every parameter once, converting each tensor to ``dtype`` as it is read.

    Router weights and expert bias stay in fp32 (f64 in validation mode); stacked experts
    are filled in place into one preallocated [E, ...] tensor. ``check_weights`` scans every
    tensor for NaN / infinity as it is read (one pass per tensor; skip it for trusted
    checkpoints); a non-float tensor is always refused. ``quantization`` ("int8", "fp8")
    quantises each decoder projection as it is read and keeps only the quantised copy; a GPTQ
    checkpoint (config.json ``quantization_config``) is read in its packed layout. Each tensor
    goes to ``device`` as it is read, so the host never holds the whole model. Under tensor
    parallelism a rank reads its slices (``shard_ranges``) and only its experts.
    """
    check_layer_count(ckpt, spec)
    plan = param_plan(spec)
    gptq = quant.gptq_config(spec.config, ckpt.dir / "config.json")
    if gptq is not None and tensor_parallel is not None:
        raise CheckpointError(f"{ckpt.dir}: tensor parallelism over a GPTQ checkpoint is not supported")
    check_tensors(ckpt, spec, plan, gptq)
    acc = accumulate_dtype(dtype)
    weights: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[ParamPlan, int]] = {}
    slices: dict[str, tuple[int, list]] = {}
    first = 0  # the first expert this rank holds (expert parallelism)
    for p in plan:
        shape = p.shape
        if tensor_parallel is not None:
            from dinfer_rt.passes.shard import local_shape, shard_ranges

            shape = local_shape(p.name, p.shape, spec, tensor_parallel)
            rng = shard_ranges(p.name, p.shape, spec, tensor_parallel)
            if rng is not None:  # stacked experts: the same range of every expert's tensor
                slices.update(dict.fromkeys(p.sources, rng))
        per_expert = 2 if p.transform == "stack_pairs" else 1
        if p.transform != "copy" and tensor_parallel is not None and spec.moe is not None:
            first, last = tensor_parallel.expert_range(spec)
        else:
            first, last = 0, len(p.sources) // per_expert
        for slot, src in enumerate(p.sources):
            if first <= slot // per_expert < last:
                where[src] = (p, slot - first * per_expert)
        if p.transform != "copy":
            weights[p.name] = torch.empty(shape, dtype=dtype, device=device)
    if gptq is not None:
        load_gptq(ckpt, spec, plan, gptq, dtype, weights, device)
        where = {src: v for src, v in where.items() if not quant.is_quantizable(v[0].name)}
    for src, tensor in ckpt.read(list(where), slices):
        p, slot = where[src]
        check_values(ckpt, src, tensor, None)
        if p.transform == "copy":
            weights[p.name] = part = tensor.to(device=device, dtype=acc if p.keep_fp32 else dtype)
        elif p.transform == "stack":
            part = weights[p.name][slot]
            part.copy_(tensor)
        else:  # stack_pairs: (gate, up) of expert j fill rows [0:I] and [I:2I] of slot j
            expert, half = divmod(slot, 2)
            rows = tensor.shape[0]
            part = weights[p.name][expert, half * rows : (half + 1) * rows]
            part.copy_(tensor)
        if check_weights:
            check_values(ckpt, src, tensor, part)
        del tensor  # one tensor in flight: the host copy goes as soon as the device holds it
        if quantization is not None and quant.is_quantizable(p.name):
            qname, sname = quant.quantized_names(p.name, quantization)
            weights[qname], weights[sname] = quant.quantize(weights.pop(p.name), quantization)
    if spec.tie_embeddings:
        weights["lm_head"] = weights["embed"]
    return weights
