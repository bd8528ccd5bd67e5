"""dinfer-rt as an lm-evaluation-harness model: ``--model dinfer_rt``.

    python -m dinfer_rt.lm_eval_model --model dinfer_rt \\
        --model_args pretrained=PATH,strategy=threshold,threshold=0.9,block_length=32 \\
        --tasks gsm8k --apply_chat_template

Importing this module registers the model with lm-eval's registry; ``python -m
dinfer_rt.lm_eval_model`` (or the ``dinfer-rt-lm-eval`` script) registers it and then runs
lm-eval's own command line, with every lm-eval flag. The ``lm_eval.models`` entry point in
pyproject.toml names the class too, for lm-eval releases that discover models through entry
points (0.4.13, installed here, does not: it resolves ``--model`` against its own table only).

- ``generate_until``: ``until`` are stop strings honoured during decoding (a row stops at the
  block in which one becomes final, and the text is cut before it), ``max_gen_toks`` becomes
  ``gen_length`` rounded up to whole blocks (the text is cut back to it), requests with the same
  generation arguments are decoded in batches of ``batch_size``.
- ``loglikelihood`` / ``loglikelihood_rolling``: the masked-diffusion bound by Monte Carlo
  (``dinfer_rt.likelihood``), ``mc_num`` samples, optional ``cfg_scale``, seeded.
- ``--apply_chat_template`` renders with the model's own chat template.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import DinferError, GenerationError
from dinfer_rt.likelihood import MAX_MC_NUM, loglikelihood
from dinfer_rt.llm import LLM
from dinfer_rt.loader import model_folder
from dinfer_rt.plugins import select_backend
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.tokenizer import _short

_SAMPLING_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_ENGINE_FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]
# gen_kwargs honoured by generate_until; sampler knobs dinfer-rt lacks are accepted at their neutral values only
# (lm-eval tasks often send top_p 1.0, top_k 0 / -1, num_beams 1), anything else would be dropped silently
_GEN_KEYS = ("until", "max_gen_toks", "max_new_tokens", "do_sample", "temperature")
_NEUTRAL = {"top_p": (None, 1.0), "top_k": (None, 0, -1), "num_beams": (None, 1)}


def _int_arg(label: str, value: object, low: int = 1, high: int | None = None, alt: str = "") -> int:
    """An int, typed or as text ("2": lm-eval may pass model_args as strings); a float or bool is
    refused, not truncated (mc_num=2.7 would silently run 2 samples)."""
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise GenerationError(f"{label} must be an int {bound}{alt}, got {_short(value)}")
    return value


def _batch_size(value: object) -> int:
    """lm-eval's batch_size: an int, or "auto" / "auto:N" (no memory probe here: 16)."""
    if isinstance(value, str) and re.fullmatch(r"auto(:\d+)?", value.strip()):
        return 16
    return _int_arg("--model_args: batch_size", value, alt=" or 'auto' / 'auto:N'")


def _check_gen_kwargs(gen_kwargs: object) -> None:
    """Refuse a generation argument this adapter cannot honour rather than decode without it."""
    if not isinstance(gen_kwargs, dict):
        raise GenerationError(f"generate_until: gen_kwargs must be a dict, got {_short(gen_kwargs)}")
    for key, value in gen_kwargs.items():
        if key in _NEUTRAL and value not in _NEUTRAL[key]:
            raise GenerationError(
                f"generate_until: gen_kwargs {key} {_short(value)} is not supported: dinfer-rt does not sample "
                f"with {key} (accepted: {', '.join(map(str, _NEUTRAL[key][1:]))}, the neutral value)"
            )
        if key not in _NEUTRAL and key not in _GEN_KEYS:
            raise GenerationError(
                f"generate_until: unknown gen_kwargs key {_short(key)}; supported: {', '.join(_GEN_KEYS)}, "
                f"and {', '.join(_NEUTRAL)} at their neutral values"
            )
    if not isinstance(gen_kwargs.get("do_sample", False), bool):
        raise GenerationError(
            f"generate_until: gen_kwargs do_sample must be true or false, got {_short(gen_kwargs['do_sample'])}"
        )
    t = gen_kwargs.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf):
        raise GenerationError(f"generate_until: gen_kwargs temperature must be a finite number >= 0, got {_short(t)}")


def _flag(value) -> bool:
    """A boolean model argument (lm-eval passes ``true`` / ``True`` / ``1`` as typed or as text)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise DinferError(f"--model_args: expert_parallel must be true or false, got {value!r}")


@register_model("dinfer_rt")
class DinferLM(LM):
    def __init__(
        self,
        pretrained: str | None = None,
        backend: str | None = None,
        dtype: str | None = None,
        mc_num: int = 128,
        mc_batch_size: int = 32,
        batch_size: int | str = 16,
        tensor_parallel_size: int = 1,
        expert_parallel: bool = False,
        **sampling,
    ) -> None:
        """``tensor_parallel_size`` > 1: generation runs on a tensor-parallel group of worker
        processes that stay up for the evaluation (likelihood tasks need the model here)."""
        super().__init__()
        unknown = sorted(set(sampling) - set(_SAMPLING_FIELDS) - set(_ENGINE_FIELDS) - {"device", "max_batch_size"})
        if unknown:
            raise DinferError(
                f"--model_args: unknown argument(s) {', '.join(unknown)} for dinfer_rt; "
                "known: pretrained, backend, dtype, mc_num, mc_batch_size, batch_size, tensor_parallel_size, "
                f"expert_parallel, {', '.join(_SAMPLING_FIELDS)}, {', '.join(_ENGINE_FIELDS)}"
            )
        sampling.pop("device", None)  # lm-eval passes its --device; the backend decides the device here
        sampling.pop("max_batch_size", None)
        engine = {name: sampling.pop(name) for name in _ENGINE_FIELDS if name in sampling}
        tp, ep = _int_arg("--model_args: tensor_parallel_size", tensor_parallel_size), _flag(expert_parallel)
        self.mc_num = _int_arg("--model_args: mc_num", mc_num, 1, MAX_MC_NUM)
        self.mc_batch_size = _int_arg("--model_args: mc_batch_size", mc_batch_size)
        if self.mc_num % self.mc_batch_size and self.mc_num > self.mc_batch_size:
            raise GenerationError(
                f"--model_args: mc_num {self.mc_num} must be a multiple of mc_batch_size {self.mc_batch_size}"
            )
        self.batch_size = _batch_size(batch_size)
        self.llm = LLM(
            pretrained or None, backend=backend, dtype=dtype, tensor_parallel_size=tp, expert_parallel=ep, **engine
        )
        self.path = model_folder(pretrained or None)
        defaults = SamplingParams(**sampling, batch_size=self.batch_size, chat=False)
        spec = self.llm.model.spec if self.llm.model is not None else self.llm.pool.spec
        self.defaults = defaults.for_model(spec)  # the checkpoint's block where none is set
        chosen = self.llm.model.backend if self.llm.model is not None else select_backend(backend)
        if tp > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise DinferError("tensor_parallel_size > 1 under a launcher's data parallelism is not supported")
        self._rank, self._world_size = _join_data_parallel(chosen)
        self._device = chosen.device()

    # ---------------------------------------------------------------- data parallel (lm-eval splits requests by rank)
    def all_gather(self, tensor):
        if self._world_size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts)

    def gather_object(self, obj, dst: int = 0):
        if self._world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    # ---------------------------------------------------------------- chat
    @property
    def tokenizer_name(self) -> str:
        return str(self.path)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.llm.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.llm.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    # ---------------------------------------------------------------- generation
    def _params_for(self, gen_kwargs: dict) -> tuple[SamplingParams, int]:
        until = gen_kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(u for u in until if u)
        key = "max_gen_toks" if "max_gen_toks" in gen_kwargs else "max_new_tokens"  # HF's name, some tasks send it
        max_toks = _int_arg(f"generate_until: gen_kwargs {key}", gen_kwargs.get(key, self.defaults.gen_length))
        block = self.defaults.block_length
        gen = max(block, math.ceil(max_toks / block) * block)
        fields = dataclasses.asdict(self.defaults)
        fields.update(gen_length=gen, stop=until)
        if self.defaults.steps is not None:  # keep the steps-per-block ratio of the configured budget
            per_block = self.defaults.steps_per_block()
            fields["steps"] = per_block * (gen // block)
        temperature = gen_kwargs.get("temperature")
        if temperature is not None and gen_kwargs.get("do_sample", temperature > 0):
            fields["temperature"] = float(temperature)
        return SamplingParams(**fields).validate(), max_toks

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            _check_gen_kwargs(req.args[1])
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        tok = self.llm.tokenizer
        with tqdm(total=len(requests), desc="dinfer_rt generate_until", disable=disable_tqdm) as bar:
            for idx in groups.values():
                params, max_toks = self._params_for(requests[idx[0]].args[1])
                for lo in range(0, len(idx), params.batch_size):
                    chunk = idx[lo : lo + params.batch_size]
                    outs = self.llm.generate([requests[i].args[0] for i in chunk], params)
                    for i, o in zip(chunk, outs):
                        text = o.text if len(o.token_ids) <= max_toks else tok.decode(o.token_ids[:max_toks])
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(chunk))
        return out  # type: ignore[return-value]

    # ---------------------------------------------------------------- likelihoods
    def _score(self, context: list[int], continuation: list[int], greedy: bool):
        if self.llm.model is None:
            raise DinferError(
                "likelihood tasks need the model in this process: tensor_parallel_size > 1 serves "
                "generate_until tasks only"
            )
        return loglikelihood(
            self.llm.model,
            context,
            continuation,
            mc_num=self.mc_num,
            batch_size=min(self.mc_batch_size, self.mc_num),
            cfg_scale=self.defaults.cfg_scale,
            seed=self.defaults.seed,
            greedy_check=greedy,
        )

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        tok = self.llm.tokenizer
        results = []
        for req in tqdm(requests, desc="dinfer_rt loglikelihood", disable=disable_tqdm):
            context, continuation = req.args
            r = self._score(tok.encode(context), tok.encode(continuation), greedy=True)
            results.append((r.logprob, r.is_greedy))
            self.cache_hook.add_partial("loglikelihood", req.args, results[-1])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        tok = self.llm.tokenizer
        bos = tok.special_id("bos_token")
        results = []
        for req in tqdm(requests, desc="dinfer_rt loglikelihood_rolling", disable=disable_tqdm):
            ids = tok.encode(req.args[0])
            if not ids:
                raise GenerationError(
                    f"loglikelihood_rolling: the text is empty ({_short(req.args[0])} has no tokens to score)"
                )
            r = self._score([] if bos is None else [bos], ids, greedy=False)
            results.append(r.logprob)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, r.logprob)
        return results


def _join_data_parallel(backend) -> tuple[int, int]:
    """(rank, world size). Under ``torchrun`` (WORLD_SIZE > 1) every rank holds a whole replica and
    lm-eval hands each its share of the requests; the process group uses the backend's collective
    library (gloo on the cpu backend), rendezvous env://."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        library = (backend.capabilities().collectives or "gloo").split()[0]  # "nccl (RCCL)" -> "nccl"
        dist.init_process_group(library, init_method="env://")
        import atexit

        from dinfer_rt.parallel import leave_group

        atexit.register(leave_group, wait=False)  # join gloo's threads before interpreter shutdown
    return dist.get_rank(), dist.get_world_size()


def main() -> None:
    """lm-eval's own command line, with ``dinfer_rt`` registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
