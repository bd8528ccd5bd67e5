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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dinfer_rt.errors import GenerationError
from dinfer_rt.model import Model


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
    """The masked-diffusion bound of ``log p(continuation | context)``, deterministic under ``seed``."""
    if not continuation:
        raise GenerationError("loglikelihood: the continuation is empty")
    if mc_num < 1 or batch_size < 1:
        raise GenerationError(f"loglikelihood: mc_num ({mc_num}) and batch_size ({batch_size}) must be >= 1")
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
