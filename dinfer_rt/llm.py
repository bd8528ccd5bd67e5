"""The vLLM-like entry point: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from dinfer_rt.engine import run_batch
from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import GenerationError, TokenizerError
from dinfer_rt.loader import load_model
from dinfer_rt.model import Model
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.tokenizer import refuse_mask_token


@dataclass
class GenerationStats:
    nfe: int  # forwards of the batch this prompt ran in
    tokens: int  # tokens the model committed for this prompt
    tokens_per_forward: float
    wall_s: float  # wall time of its batch
    tokens_per_s: float
    precision_forwards: dict[str, int] = field(default_factory=dict)  # its batch's forwards per precision
    edits: int = 0  # token-to-token rewrites of this prompt (editing rules: joint_threshold)
    post_steps: int = 0  # forwards after its block's last mask (editing rules), summed over blocks
    edits_per_forward: float = 0.0


@dataclass
class GenerationOutput:
    prompt: str | list[int]
    text: str
    token_ids: list[int]  # generated ids up to (not including) the first EOS
    stats: GenerationStats
    # ``SamplingParams.logprobs`` set: per token id, its log-probability under the forward that
    # made it final, and its top alternatives [(id, log-probability)], most likely first
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


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
        **engine_args,
    ) -> None:
        """``engine_args``: :class:`~dinfer_rt.engine_args.EngineArgs` fields (``sync_every``,
        ``max_forward_tokens``, ``confidence_head``, ...): how the engine runs every ``generate``.
        ``tensor_parallel_size`` / ``data_parallel_size`` > 1: ``generate`` runs on worker
        processes started here and kept for the LLM's life (``data_parallel_size`` engine replicas,
        each a tensor-parallel group of ``tensor_parallel_size`` ranks that load their shards once;
        ``close()`` stops them), and this process holds no weights (``self.model`` is None).
        ``expert_parallel``: MoE layers split whole experts over the ranks instead of each
        expert's intermediate size."""
        self.pool = None
        self.runner = None  # runs the forwards (None: in this process; generate_on_rank: the group's lead)
        self.engine_args = EngineArgs.build(**engine_args)
        if self.engine_args.prefix_cache == "approximate":  # it would change answers in replicas only
            raise GenerationError(
                "LLM: prefix_cache='approximate' is for served engines (dinfer-rt serve --prefix-cache "
                "approximate), where requests arrive apart; LLM.generate decodes each batch without it"
            )
        _check_arguments(model, backend, dtype, check_weights, quantization, expert_parallel)
        for name, size in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise GenerationError(f"LLM: {name} must be an int >= 1, got {size!r}")
        if expert_parallel and tensor_parallel_size == 1:  # it would be ignored
            raise GenerationError(
                "LLM: expert_parallel=True splits MoE experts over tensor-parallel ranks; it needs "
                "tensor_parallel_size > 1 (--tensor-parallel-size)"
            )
        if tensor_parallel_size > 1 or data_parallel_size > 1:
            from dinfer_rt.loader import model_folder
            from dinfer_rt.workers import ReplicaPool

            if isinstance(model, Model) or quantization is not None:
                sizes = f"tensor_parallel_size={tensor_parallel_size}, data_parallel_size={data_parallel_size}"
                raise GenerationError(
                    f"{sizes}: worker processes load the model themselves, so pass its path (not a loaded "
                    "Model) and no quantization"
                )
            load = {"path": model_folder(model), "backend": backend, "dtype": dtype}
            load["check_weights"] = check_weights
            engine = {"max_num_seqs": 64, "max_num_batched_tokens": 1 << 20, **engine_args}
            self.pool = ReplicaPool(
                data_parallel_size, load, engine, max_queue=1 << 30, tp_size=tensor_parallel_size,
                expert_parallel=expert_parallel,
            )  # fmt: skip
            self.model = None
        elif isinstance(model, Model):
            _refuse_load_arguments(model, backend, dtype, check_weights, quantization)
            self.model = model
        else:
            self.model = load_model(
                model, backend=backend, dtype=dtype, check_weights=check_weights, quantization=quantization
            )

    @property
    def tokenizer(self):
        return self.pool.tokenizer if self.pool is not None else self.model.tokenizer

    def close(self) -> None:
        """Stop the worker processes of a parallel LLM (also at interpreter exit), or release the
        follower ranks of a group this LLM leads (``generate_on_rank``); idempotent."""
        if self.runner is not None and hasattr(self.runner, "stop"):
            self.runner.stop()
        if self.pool is not None:
            self.pool.close()
            self.pool.shutdown()
            self.pool = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(
        self, prompt: str | list[int], chat: bool, allow_mask_in_prompt: bool = False, where: str = "prompt"
    ) -> list[int]:
        mask_id = (self.pool if self.pool is not None else self.model).mask_id
        if isinstance(prompt, list):
            if not prompt:
                raise GenerationError(f"{where} is an empty list of token ids: at least one token is needed")
            refuse_mask_token(prompt, mask_id, where, allow_mask_in_prompt)
            return prompt  # ids: checked against the vocabulary by the engine
        if not isinstance(prompt, str):
            raise GenerationError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        tok = self.tokenizer
        if tok is None:
            raise GenerationError("this model was loaded without a tokenizer; pass token ids")
        if not prompt.strip():
            raise GenerationError(f"{where} is an empty prompt (empty or only whitespace)")
        if chat and tok.chat_template:
            rendered = tok.apply_chat_template([{"role": "user", "content": prompt}])
            try:
                ids = tok.encode(rendered)
            except TokenizerError as e:
                tok.encode(prompt)  # the user's text is at fault: its own error, naming what is unknown
                raise TokenizerError(  # else the template's own text is
                    f"{tok.chat_template_source}: the chat template writes text the tokenizer does not know "
                    f"({where} alone encodes): {e}"
                ) from None
        else:
            ids = tok.encode(prompt)
        refuse_mask_token(ids, mask_id, where, allow_mask_in_prompt)
        return ids

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | None = None,
        progress: bool = False,
        allow_mask_in_prompt: bool = False,
    ) -> list[GenerationOutput]:
        for name, flag in (("progress", progress), ("allow_mask_in_prompt", allow_mask_in_prompt)):
            if not isinstance(flag, bool):  # "no" is truthy: a silent yes
                raise GenerationError(f"generate: {name} must be True or False, got {type(flag).__name__} {flag!r}")
        if params is not None and not isinstance(params, SamplingParams):
            hint = " (SamplingParams(**that_dict) builds one)" if isinstance(params, dict) else ""
            raise GenerationError(f"generate: params must be a SamplingParams, got {type(params).__name__}{hint}")
        if self.pool is None and self.model is None:
            raise GenerationError("this LLM was closed: its worker processes are gone")
        spec = self.pool.spec if self.pool is not None else self.model.spec
        params = (params or SamplingParams()).validate(block_causal=spec.block_causal)  # its blocks align to 0
        if not isinstance(prompts, (str, list, tuple)) or not prompts:
            raise GenerationError(f"prompts must be a string or a non-empty list, got {prompts!r}")
        prompts = list(prompts) if isinstance(prompts, tuple) else prompts
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if self.pool is not None:
            return self._generate_on_workers(prompts, params, progress, allow_mask_in_prompt)
        encoded = [self.encode(p, params.chat, allow_mask_in_prompt, f"prompt {i}") for i, p in enumerate(prompts)]
        if params.stop and self.model.tokenizer is None:
            raise GenerationError("stop strings need the model's tokenizer (loaded without one)")
        outputs: list[GenerationOutput] = []
        with tqdm(total=len(encoded), desc="generate", disable=not progress, unit="prompt") as bar:
            for i in range(0, len(encoded), params.batch_size):
                chunk = encoded[i : i + params.batch_size]
                res = run_batch(self.model, chunk, params, runner=self.runner, args=self.engine_args)
                for r, req in enumerate(res.requests):
                    toks = int(res.committed[r])
                    tps = toks / res.wall_s if res.wall_s > 0 else 0.0
                    stats = GenerationStats(
                        res.nfe, toks, toks / max(res.nfe, 1), res.wall_s, tps, res.precision_forwards,
                        req.edits, req.post_steps, req.edits / max(res.nfe, 1),
                    )  # fmt: skip
                    outputs.append(GenerationOutput(prompts[i + r], req.text, req.output_ids, stats, *_logprobs(req)))
                bar.update(len(chunk))
        return outputs

    def _generate_on_workers(
        self, prompts: list, params: SamplingParams, progress: bool, allow_mask_in_prompt: bool = False
    ) -> list[GenerationOutput]:
        """Every prompt a request to the worker engines (which keep running between calls); the
        outputs in prompt order. Each prompt decodes as it would alone (batch invariance)."""
        encoded = [self.encode(p, params.chat, allow_mask_in_prompt, f"prompt {i}") for i, p in enumerate(prompts)]
        start = time.perf_counter()
        reqs = [self.pool.submit(ids, params) for ids in encoded]
        with tqdm(total=len(reqs), desc="generate", disable=not progress, unit="prompt") as bar:
            while not all(r.done for r in reqs):
                bar.update(len(self.pool.step()))
        wall = time.perf_counter() - start
        outputs = []
        for prompt, req in zip(prompts, reqs):
            if req.error is not None:
                raise GenerationError(f"generate on the worker processes failed: {req.error}")
            toks = len(req.final_ids)
            stats = GenerationStats(
                req.forwards, toks, toks / max(req.forwards, 1), wall, toks / wall if wall else 0.0,
                edits=req.edits, post_steps=req.post_steps, edits_per_forward=req.edits / max(req.forwards, 1),
            )  # fmt: skip
            outputs.append(GenerationOutput(prompt, req.text, req.output_ids, stats, *_logprobs(req)))
        return outputs


def _logprobs(req) -> tuple[list | None, list | None]:
    """A finished request's log-probabilities of its output ids (None: not asked)."""
    if req.params.logprobs is None:
        return None, None
    n = len(req.output_ids)
    return req.logprobs[:n], req.top_logprobs[:n]


def _check_arguments(model, backend, dtype, check_weights, quantization, expert_parallel) -> None:
    """The constructor's arguments have the types it documents (a slip such as ``LLM(5)`` is one
    error naming the argument, not a failure deep inside loading)."""
    kinds = (
        ("model", model, (str, Path, Model, type(None)), "a path, a hub id, a loaded Model or None"),
        ("backend", backend, (str, type(None)), "a backend name or None"),
        ("dtype", dtype, (str, torch.dtype, type(None)), "a dtype name, a torch.dtype or None"),
        ("quantization", quantization, (str, type(None)), "'int8', 'fp8' or None"),
        ("check_weights", check_weights, (bool,), "True or False"),
        ("expert_parallel", expert_parallel, (bool,), "True or False"),
    )
    for name, value, types, expected in kinds:
        if not isinstance(value, types):
            raise GenerationError(f"LLM: {name} must be {expected}, got {type(value).__name__} {value!r}")


def _refuse_load_arguments(model: Model, backend, dtype, check_weights, quantization) -> None:
    """The loading arguments of a model that is already loaded: they would be ignored, and the
    answers silently those of the model as it was loaded (``LLM(m, quantization="fp8")`` ran fp32)."""
    given = [
        f"{name}={value!r}"
        for name, value, unset in (
            ("backend", backend, None),
            ("dtype", dtype, None),
            ("quantization", quantization, None),
            ("check_weights", check_weights, True),
        )  # fmt: skip
        if value != unset
    ]
    if given:
        loaded = f"{model.backend.name}, {str(model.dtype).removeprefix('torch.')}"
        if model.weight_format is not None:
            loaded += f", {model.weight_format} weights"
        what, them = ("a loading argument", "it") if len(given) == 1 else ("loading arguments", "them")
        raise GenerationError(
            f"LLM: {', '.join(given)}: {what}, and this Model is already loaded ({loaded}): pass its "
            f"path instead, or give {them} to load_model"
        )


# ---------------------------------------------------------------- under an external launcher (torchrun)


def generate_on_rank(
    rank: int,
    world: int,
    path,
    prompts: list,
    params,
    backend=None,
    dtype=None,
    expert_parallel: bool = False,
    allow_mask_in_prompt: bool = False,
    **engine_args,
):
    """``LLM.generate`` over a tensor-parallel process group someone else started (torchrun, or
    ``parallel.launch``), one shard per rank. Rank 0 owns the scheduler and sends every forward's
    inputs to the others (``model_runner``); it returns the outputs, the other ranks None.
    ``allow_mask_in_prompt`` as ``LLM.generate`` takes it; ``engine_args`` as ``LLM`` takes them."""
    from dinfer_rt.model_runner import on_rank
    from dinfer_rt.parallel import load_sharded

    model = load_sharded(path, rank, world, backend, dtype, expert_parallel)
    runner = on_rank(model)
    if runner is None:  # a follower: it ran the lead's forwards until the lead stopped
        return None
    llm = LLM(model, **engine_args)
    llm.runner = runner
    try:
        return llm.generate(prompts, params, allow_mask_in_prompt=allow_mask_in_prompt)
    finally:
        llm.close()
