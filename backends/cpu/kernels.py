"""CPU kernels that differ from the IR's reference semantics in how, not what, they compute.

The one such kernel so far is the fused LM head + confidence, whose point is memory: it never
builds the [positions x vocab] probabilities. The reference it is checked against is
``dinfer_rt.ir.ops.lm_head_confidence`` (softmax over the full logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dinfer_rt.ir.ops import OpTypeError


def lm_head_confidence_chunked(
    h: torch.Tensor, weight: torch.Tensor, *, banned: int, kind: str = "max", chunk: int = 8192
):
    """Online-softmax kernel for ``lm_head_confidence``: one vocabulary chunk of logits at a time,
    tracking the running max m, Z = sum exp(z - m), the top-2 logits with the argmax, and
    (for entropy) S = sum exp(z - m) * (z - m), since sum p log p = S / Z - log Z."""
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    shape = h.shape[:-1]
    neg = torch.full(shape, float("-inf"), dtype=acc, device=h.device)
    m, top1, top2 = neg.clone(), neg.clone(), neg.clone()
    z_sum = torch.zeros(shape, dtype=acc, device=h.device)
    s_sum = torch.zeros(shape, dtype=acc, device=h.device)
    best = torch.zeros(shape, dtype=torch.int64, device=h.device)

    def finite(t):
        return torch.where(torch.isfinite(t), t, torch.zeros_like(t))

    for lo in range(0, weight.shape[0], chunk):
        z = F.linear(h, weight[lo : lo + chunk]).to(acc)
        if lo <= banned < lo + z.shape[-1]:
            z[..., banned - lo] = float("-inf")
        c2 = z.topk(min(2, z.shape[-1]), dim=-1)
        cmax, carg = c2.values[..., 0], c2.indices[..., 0]
        csecond = c2.values[..., 1] if z.shape[-1] > 1 else torch.full_like(cmax, float("-inf"))
        new_m = torch.maximum(m, cmax)
        ref = finite(new_m)
        rescale = torch.where(torch.isfinite(m), torch.exp(m - ref), torch.zeros_like(ref))
        e = torch.exp(z - ref[..., None])
        if kind == "entropy":  # S = sum exp(z - ref) * (z - ref), carried across a change of ref
            shift = torch.where(torch.isfinite(m), m - ref, torch.zeros_like(ref))
            s_sum = rescale * (s_sum + shift * z_sum) + (e * finite(z - ref[..., None])).sum(-1)
        z_sum = z_sum * rescale + e.sum(-1)
        top2 = torch.maximum(torch.minimum(top1, cmax), torch.maximum(top2, csecond))
        best = torch.where(cmax > top1, carg + lo, best)
        top1 = torch.maximum(top1, cmax)
        m = new_m
    ref = finite(m)
    p1 = torch.exp(top1 - ref) / z_sum
    if kind == "max":
        return p1, best
    if kind == "margin":
        return p1 - torch.exp(top2 - ref) / z_sum, best
    if kind == "entropy":  # sum p log p = sum p (z - ref - log Z) = S / Z - log Z, no cancellation
        return s_sum / z_sum - torch.log(z_sum), best
    raise OpTypeError(f"lm_head_confidence: unknown kind {kind!r} (max, margin, entropy)")
