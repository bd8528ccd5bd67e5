"""Log-likelihood of a continuation under a masked diffusion model (LLaDA's Monte Carlo bound).

A masked dLLM has no left-to-right factorisation, so ``log p(continuation | context)`` is
estimated by the ELBO of the masked-diffusion objective (LLaDA ``get_log_likelihood``,
``docs/decoding.md``): for each of ``mc_num`` samples draw how many of the L continuation tokens
to mask, mask that many at random positions (context kept), and score the cross-entropy of the
masked tokens divided by the masked share; the mean over samples, negated, is the bound. Mask
counts are stratified across the samples (evenly spaced from a random start), which lowers the
variance for the same ``mc_num``. ``is_greedy`` comes from greedy prediction of the whole
continuation, one most-confident token per step (LLaDA ``suffix_greedy_prediction``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dinfer_rt.errors import GenerationError
from dinfer_rt.model import Model
from dinfer_rt.sampling import _FIELD_RULES
from dinfer_rt.tokenizer import _short

# The mask plan holds mc_num x (context + continuation) ids at once; LLaDA's evaluations use 128 to 1024.
MAX_MC_NUM = 4096
_CFG_MAX, _SEED_MAX = _FIELD_RULES["cfg_scale"][2], _FIELD_RULES["seed"][2]  # SamplingParams' bounds


@dataclass
class LikelihoodResult:
    logprob: float  # the Monte Carlo estimate of the bound
    is_greedy: bool  # greedy decoding of the continuation reproduces it exactly
    stderr: float  # standard error of the estimate over the mc_num samples


def _masked_batch(seq: torch.Tensor, ctx: int, mc_num: int, mask_id: int, gen: torch.Generator):
    """``mc_num`` noisy copies of ``seq`` [N] with stratified mask counts over the continuation."""
    length = seq.shape[0] - ctx
    start = int(torch.randint(1, length + 1, (), generator=gen))
    counts = torch.round(torch.linspace(start, start + (mc_num - 1) * length / mc_num, mc_num)).long()
    counts = (counts - 1) % length + 1  # in [1, L]
    order = torch.rand(mc_num, length, generator=gen).argsort(-1)  # a random permutation per sample
    masked = torch.zeros(mc_num, seq.shape[0], dtype=torch.bool)
    masked[:, ctx:] = order < counts[:, None]
    noisy = torch.where(masked, torch.tensor(mask_id), seq[None].expand(mc_num, -1))
    return noisy, masked, counts.double() / length


def _logits(model: Model, ids: torch.Tensor, ctx: int, cfg_scale: float) -> torch.Tensor:
    logits = model.forward(ids).double()
    if cfg_scale > 0:  # unconditional: the context masked too (LLaDA)
        un = ids.clone()
        un[:, :ctx] = model.mask_id
        uncond = model.forward(un).double()
        logits = uncond + (cfg_scale + 1) * (logits - uncond)
    return logits


@torch.no_grad()
def loglikelihood(
    model: Model,
    context: list[int],
    continuation: list[int],
    *,
    mc_num: int = 128,
    batch_size: int = 32,
    cfg_scale: float = 0.0,
    seed: int = 0,
    greedy_check: bool = True,
) -> LikelihoodResult:
    """The masked-diffusion bound of ``log p(continuation | context)``, deterministic under ``seed``.

    Every argument is checked before any compute (``check_ids``, ``check_int``, ``check_cfg_scale``)."""
    context = check_ids(context, "context", model)
    continuation = check_ids(continuation, "continuation", model)
    if not continuation:
        raise GenerationError("loglikelihood: the continuation is empty")
    mc_num = check_int("mc_num", mc_num, 1, MAX_MC_NUM)
    batch_size = check_int("batch_size", batch_size, 1)
    seed = check_int("seed", seed, 0, _SEED_MAX)
    cfg_scale = check_cfg_scale(cfg_scale)
    if not isinstance(greedy_check, bool):  # "no" is truthy: a silent yes
        raise GenerationError(f"loglikelihood: greedy_check must be True or False, got {_short(greedy_check)}")
    if mc_num % batch_size and mc_num > batch_size:
        raise GenerationError(f"loglikelihood: mc_num {mc_num} must be a multiple of batch_size {batch_size}")
    seq = torch.tensor(context + continuation, dtype=torch.long)
    if seq.shape[0] > model.spec.max_length:
        raise GenerationError(
            f"loglikelihood: context + continuation = {seq.shape[0]} tokens exceeds the model's max length "
            f"{model.spec.max_length}"
        )
    ctx = len(context)
    gen = torch.Generator().manual_seed(seed)
    noisy, masked, ratio = _masked_batch(seq, ctx, mc_num, model.mask_id, gen)
    per_sample = []
    for lo in range(0, mc_num, batch_size):
        ids, m = noisy[lo : lo + batch_size], masked[lo : lo + batch_size]
        logits = _logits(model, ids, ctx, cfg_scale)
        target = seq[None].expand_as(ids)
        ce = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # [b, N]
        per_sample.append((ce * m).sum(-1) / ratio[lo : lo + batch_size])
    losses = torch.cat(per_sample)
    stderr = float(losses.std() / mc_num**0.5) if mc_num > 1 else float("nan")
    greedy = _greedy_matches(model, seq, ctx, cfg_scale) if greedy_check else False
    return LikelihoodResult(-float(losses.mean()), greedy, stderr)


def check_ids(ids: object, name: str, model: Model) -> list[int]:
    """A list (or tuple) of ints in [0, vocab) without the mask id: a float would be truncated, an id
    out of range would index past the embedding, and a mask id would be scored as a blank."""
    if not isinstance(ids, (list, tuple)):
        kind = type(ids).__name__
        raise GenerationError(f"loglikelihood: {name} must be a list of token ids, got {kind} {_short(ids)}")
    vocab = model.spec.vocab
    for pos, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise GenerationError(
                f"loglikelihood: {name} token {pos} is {_short(t)}; token ids must be ints in [0, {vocab}) "
                "(the model's vocabulary)"
            )
        if t == model.mask_id:
            raise GenerationError(
                f"loglikelihood: {name} holds the mask token (id {t}) at token {pos}: the bound would score it "
                "as a blank, not as text; remove it"
            )
    return list(ids)


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """An int (not a bool, not a float: 2.5 samples or seed 1.5 have no meaning) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise GenerationError(f"loglikelihood: {name} must be int, got {type(value).__name__} {_short(value)}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise GenerationError(f"loglikelihood: {name} {_short(value)} must be {bound}")
    return value


def check_cfg_scale(value: object) -> float:
    """A finite number in [0, 100] (SamplingParams' bound): nan and negatives would act as 0, inf gives nan."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GenerationError(f"loglikelihood: cfg_scale must be float, got {type(value).__name__} {_short(value)}")
    if not math.isfinite(value):
        raise GenerationError(f"loglikelihood: cfg_scale must be a finite number, got {value!r}")
    if not 0 <= value <= _CFG_MAX:
        raise GenerationError(f"loglikelihood: cfg_scale {value!r} must be in [0, {_CFG_MAX}]")
    return float(value)


def _greedy_matches(model: Model, seq: torch.Tensor, ctx: int, cfg_scale: float) -> bool:
    """Unmask the continuation one most-confident position per step; compare with the target."""
    x = seq.clone()
    x[ctx:] = model.mask_id
    for _ in range(seq.shape[0] - ctx):
        logits = _logits(model, x[None], ctx, cfg_scale)[0]
        logits[:, model.mask_id] = float("-inf")
        conf, token = logits.softmax(-1).max(-1)
        conf = torch.where(x == model.mask_id, conf, torch.tensor(-1.0, dtype=conf.dtype))
        at = int(conf.argmax())
        x[at] = token[at]
    return bool(torch.equal(x[ctx:], seq[ctx:]))
