"""A Fast-dLLM-style baseline written from the paper's description (arXiv 2505.22618, §3).

Plain torch module of the same LLaDA weights (no dinfer-rt IR, executor or scheduler):
semi-autoregressive blocks; at each block start a full forward that also returns every
layer's K/V (the dual cache: prefix and suffix); then forwards of the block's tokens only,
attending to [cached prefix | fresh block | cached suffix]; confidence-threshold commits
(tau = 0.9, at least one per step). It exists to be measured against dinfer-rt in the same run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class PlainLLaDA:
    def __init__(self, path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        """``dtype``: of the weights and every activation (bfloat16: how the peers run on GPUs);
        ``device``: where they live (token ids and the decoding loop follow them there)."""
        self.cfg, self.dtype, self.device = json.loads((path / "config.json").read_text()), dtype, torch.device(device)
        self.w = {k: v.to(device, dtype) for k, v in load_file(str(path / "model.safetensors")).items()}
        c = self.cfg
        self.heads, self.hd = c["n_heads"], c["d_model"] // c["n_heads"]
        inv = c["rope_theta"] ** (-torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd)
        ang = torch.outer(torch.arange(c["max_sequence_length"], dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), -1)
        self.cos, self.sin = ang.cos().to(device, dtype), ang.sin().to(device, dtype)

    def _norm(self, x, name):
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]))

    def _rope(self, x, pos):
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        h = self.hd // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin

    @torch.no_grad()
    def forward(self, ids, pos, past=None, replace=None):
        """ids [B, T] at positions ``pos``; with ``past`` (list of (k, v) [B, H, N, d]) the fresh K/V
        replace positions ``replace`` of a copy of the cache and attention spans all N positions."""
        p = "model.transformer."
        x = self.w[p + "wte.weight"][ids]
        b, t, _ = x.shape
        kv = []
        for i in range(self.cfg["n_layers"]):
            q_ = f"{p}blocks.{i}."
            n = self._norm(x, q_ + "attn_norm.weight")
            q, k, v = (
                F.linear(n, self.w[q_ + f"{m}_proj.weight"]).view(b, t, self.heads, self.hd).transpose(1, 2)
                for m in "qkv"
            )
            q, k = self._rope(q, pos), self._rope(k, pos)
            if past is not None:
                pk, pv = past[i]
                k = torch.cat((pk[:, :, : replace[0]], k, pk[:, :, replace[1] :]), 2)
                v = torch.cat((pv[:, :, : replace[0]], v, pv[:, :, replace[1] :]), 2)
            kv.append((k, v))
            a = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(self.hd))
            x = x + F.linear(a.transpose(1, 2).reshape(b, t, -1), self.w[q_ + "attn_out.weight"])
            m = self._norm(x, q_ + "ff_norm.weight")
            x = x + F.linear(
                F.silu(F.linear(m, self.w[q_ + "ff_proj.weight"])) * F.linear(m, self.w[q_ + "up_proj.weight"]),
                self.w[q_ + "ff_out.weight"],
            )
        return F.linear(self._norm(x, p + "ln_f.weight"), self.w[p + "ff_out.weight"]), kv


@torch.no_grad()
def generate(
    model: PlainLLaDA, prompt: torch.Tensor, gen_length: int, block_length: int, tau: float = 0.9, cache: bool = True
):
    """Returns (tokens [B, gen_length], forwards). Prompts in one batch share a length (no padding).
    ``cache=False``: every step is a full forward (Fast-dLLM's parallel decoding without cache)."""
    mask_id = model.cfg["mask_token_id"]
    prompt = prompt.to(model.device)
    b, p = prompt.shape
    x = torch.cat((prompt, torch.full((b, gen_length), mask_id, device=model.device)), 1)
    rows = torch.arange(b, device=model.device)
    nfe = 0
    for s in range(p, p + gen_length, block_length):
        e = s + block_length
        first = True
        while (x[:, s:e] == mask_id).any():
            if first or not cache:
                logits, past = model.forward(x, torch.arange(x.shape[1], device=model.device))
                logits = logits[:, s:e]
                first = False
            else:
                logits, _ = model.forward(x[:, s:e], torch.arange(s, e, device=model.device), past=past, replace=(s, e))
            nfe += 1
            logits[..., mask_id] = float("-inf")
            probs = logits.double().softmax(-1)
            conf, x0 = probs.max(-1)
            masked = x[:, s:e] == mask_id
            conf = torch.where(masked, conf, torch.tensor(-1.0, dtype=conf.dtype))
            commit = masked & (conf >= tau)
            best = conf.argmax(-1)
            commit[rows, best] |= masked[rows, best]
            x[:, s:e] = torch.where(commit, x0, x[:, s:e])
    return x[:, p:].cpu(), nfe
