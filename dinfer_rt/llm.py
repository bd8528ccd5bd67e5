"""The vLLM-like entry point: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from dinfer_rt.engine import run_batch
from dinfer_rt.errors import GenerationError
from dinfer_rt.loader import load_model
from dinfer_rt.model import Model
from dinfer_rt.sampling import SamplingParams


@dataclass
class GenerationStats:
    nfe: int  # forwards of the batch this prompt ran in
    tokens: int  # tokens the model committed for this prompt
    tokens_per_forward: float
    wall_s: float  # wall time of its batch
    tokens_per_s: float
    precision_forwards: dict[str, int] = field(default_factory=dict)  # its batch's forwards per precision


@dataclass
class GenerationOutput:
    prompt: str | list[int]
    text: str
    token_ids: list[int]  # generated ids up to (not including) the first EOS
    stats: GenerationStats


class LLM:
    def __init__(
        self,
        model: str | Path | Model | None = None,
        backend: str | None = None,
        dtype: str | torch.dtype | None = None,
        check_weights: bool = True,
        quantization: str | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        expert_parallel: bool = False,
    ) -> None:
        """``tensor_parallel_size`` / ``data_parallel_size`` > 1: ``generate`` runs on that many
        worker processes (``dinfer_rt.parallel``; started for each call, each loading only its
        shard), and this process holds no weights (``self.model`` is None). ``expert_parallel``:
        MoE layers split whole experts over the ranks instead of each expert's intermediate size."""
        self.parallel = None
        if tensor_parallel_size > 1 or data_parallel_size > 1:
            from dinfer_rt import parallel
            from dinfer_rt.loader import default_model_path
            from dinfer_rt.spec import parse_spec

            if isinstance(model, Model) or quantization is not None:
                raise GenerationError(
                    "tensor_parallel_size > 1 takes a model path (each rank loads its shard), unquantised"
                )
            spec = parse_spec(Path(model) if model else default_model_path())
            parallel.check_split(spec, tensor_parallel_size, expert_parallel)
            sizes = {
                "tensor_parallel_size": tensor_parallel_size,
                "data_parallel_size": data_parallel_size,
                "expert_parallel": expert_parallel,
            }
            self.parallel = {"path": model, "backend": backend, "dtype": dtype, **sizes}
            self.model = None
        elif isinstance(model, Model):
            self.model = model
        else:
            self.model = load_model(
                model, backend=backend, dtype=dtype, check_weights=check_weights, quantization=quantization
            )

    def encode(self, prompt: str | list[int], chat: bool) -> list[int]:
        if self.model is None:
            raise GenerationError("a tensor-parallel LLM holds no tokenizer here: pass prompts to generate")
        if isinstance(prompt, list):
            return prompt  # ids: checked against the vocabulary by the engine
        if not isinstance(prompt, str):
            raise GenerationError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        tok = self.model.tokenizer
        if tok is None:
            raise GenerationError("this model was loaded without a tokenizer; pass token ids")
        if not prompt.strip():
            raise GenerationError("empty prompt")
        if chat and tok.chat_template:
            prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
        return tok.encode(prompt)

    def generate(
        self, prompts: str | list[str] | list[list[int]], params: SamplingParams | None = None, progress: bool = False
    ) -> list[GenerationOutput]:
        params = (params or SamplingParams()).validate()
        if not isinstance(prompts, (str, list, tuple)) or not prompts:
            raise GenerationError(f"prompts must be a string or a non-empty list, got {prompts!r}")
        prompts = list(prompts) if isinstance(prompts, tuple) else prompts
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if self.parallel is not None:
            p = dict(self.parallel)
            return generate_parallel(p.pop("path"), prompts, params, **p)
        encoded = [self.encode(p, params.chat) for p in prompts]
        if params.stop and self.model.tokenizer is None:
            raise GenerationError("stop strings need the model's tokenizer (loaded without one)")
        outputs: list[GenerationOutput] = []
        with tqdm(total=len(encoded), desc="generate", disable=not progress, unit="prompt") as bar:
            for i in range(0, len(encoded), params.batch_size):
                chunk = encoded[i : i + params.batch_size]
                res = run_batch(self.model, chunk, params)  # one cohort of the engine
                for r, req in enumerate(res.requests):
                    toks = int(res.committed[r])
                    tps = toks / res.wall_s if res.wall_s > 0 else 0.0
                    stats = GenerationStats(
                        res.nfe, toks, toks / max(res.nfe, 1), res.wall_s, tps, res.precision_forwards
                    )
                    outputs.append(GenerationOutput(prompts[i + r], req.text, req.output_ids, stats))
                bar.update(len(chunk))
        return outputs


# ---------------------------------------------------------------- on worker ranks (module level: spawnable)


def generate_on_rank(
    rank: int, world: int, path, prompts: list, params, backend=None, dtype=None, expert_parallel: bool = False
):
    """``LLM.generate`` on rank ``rank``'s shard: its ``GenerationOutput`` per prompt (every rank
    runs the same steps; rank 0's are returned by ``parallel.launch``)."""
    from dinfer_rt.parallel import load_sharded

    return LLM(load_sharded(path, rank, world, backend, dtype, expert_parallel)).generate(prompts, params)


def replica_on_rank(
    rank: int,
    world: int,
    tp_size: int,
    path,
    prompts: list,
    params,
    backend=None,
    dtype=None,
    expert_parallel: bool = False,
):
    """Data parallelism: replica ``rank // tp_size`` generates every ``replicas``-th prompt on its
    own tensor-parallel group; its first rank returns ``(prompt index, output)`` rows."""
    replicas, replica, tp_rank = world // tp_size, rank // tp_size, rank % tp_size
    mine = list(range(replica, len(prompts), replicas))
    if not mine:
        return []
    outs = generate_on_rank(tp_rank, tp_size, path, [prompts[i] for i in mine], params, backend, dtype, expert_parallel)
    return list(zip(mine, outs)) if tp_rank == 0 else []


def generate_parallel(
    path,
    prompts: list,
    params,
    *,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    expert_parallel: bool = False,
    backend=None,
    dtype=None,
) -> list[GenerationOutput]:
    """``LLM.generate`` over ``data_parallel_size`` replicas of ``tensor_parallel_size`` ranks
    each (spawned on this machine for this call): one ``GenerationOutput`` per prompt, in order."""
    from dinfer_rt import parallel
    from dinfer_rt.loader import default_model_path
    from dinfer_rt.spec import parse_spec

    spec = parse_spec(Path(path) if path else default_model_path())
    parallel.check_split(spec, tensor_parallel_size, expert_parallel)
    if data_parallel_size < 1:
        raise parallel.ParallelError(f"data parallel size must be >= 1, got {data_parallel_size}")
    world = tensor_parallel_size * data_parallel_size
    if world == 1:
        return generate_on_rank(0, 1, path, prompts, params, backend, dtype)
    args = (path, prompts, params, backend, dtype, expert_parallel)
    if data_parallel_size == 1:
        return parallel.launch(world, generate_on_rank, *args, backend=backend)
    rows = parallel.launch(
        world, replica_on_rank, tensor_parallel_size, *args,
        backend=backend, tp_size=tensor_parallel_size, all_ranks=True,
    )  # fmt: skip
    by_prompt = dict(row for rank_rows in rows for row in rank_rows)
    return [by_prompt[i] for i in range(len(prompts))]
