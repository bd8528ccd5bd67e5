"""Train the embedded default model: a small LLaDA-architecture masked-diffusion LM.

Run: ``python -m dinfer_rt.demo.train --out dinfer_rt/demo/model`` (reproducible from
``--seed``; ~4000 steps took 46.5 minutes on 2 CPU cores, ``training.json``).

The model is a plain torch module (bidirectional attention, RMSNorm, half-split RoPE,
SwiGLU) trained with LLaDA's SFT objective: per sequence a mask ratio t ~ U(eps, 1),
each response token masked with probability t, cross-entropy on masked positions
weighted by 1/t. It is saved in the exact LLaDA-8B checkpoint layout (config field
names, ``model.transformer.*`` tensor names, tokenizer.json, tokenizer_config.json), so
the runtime loads it through the same generic loader as a real LLaDA checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dinfer_rt.config_writers import llada_config
from dinfer_rt.demo import task

SPECIALS = ["<|endoftext|>", "<|startoftext|>", "<|mdm_mask|>", "<|unk|>"]
EOS_ID, BOS_ID, MASK_ID, UNK_ID = range(4)
CHARS = "=|#" + task.LETTERS
VOCAB = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
PROMPT_LEN = 1 + task.N_LETTERS + 1  # BOS, letters, '='
GEN_LENGTH = 40  # slots generated at inference: the 32-character answer, then EOS padding
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] | trim }}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


def model_config(d_model: int = 192, n_layers: int = 6, n_heads: int = 6, mlp: int = 512) -> dict:
    """config.json with LLaDA-8B's real field names, at a small scale."""
    return llada_config(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        mlp=mlp,
        vocab=len(VOCAB),
        rope_theta=10000.0,
        max_len=64,
        mask_id=MASK_ID,
        eos_id=EOS_ID,
        bos_id=BOS_ID,
        precision="fp32",
    )


class Block(nn.Module):
    def __init__(self, d: int, heads: int, mlp: int, eps: float) -> None:
        super().__init__()
        self.heads, self.eps = heads, eps
        self.attn_norm = nn.RMSNorm(d, eps=eps)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_norm = nn.RMSNorm(d, eps=eps)
        self.ff_proj = nn.Linear(d, mlp, bias=False)
        self.up_proj = nn.Linear(d, mlp, bias=False)
        self.ff_out = nn.Linear(mlp, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        n = self.attn_norm(x)
        q, k, v = (p(n).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v)  # bidirectional: no mask
        x = x + self.attn_out(a.transpose(1, 2).reshape(b, t, d))
        m = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(m)) * self.up_proj(m))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class TinyLLaDA(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        d, h = cfg["d_model"], cfg["n_heads"]
        self.cfg = cfg
        self.wte = nn.Embedding(cfg["embedding_size"], d)
        self.blocks = nn.ModuleList(
            Block(d, h, cfg["mlp_hidden_size"], cfg["rms_norm_eps"]) for _ in range(cfg["n_layers"])
        )
        self.ln_f = nn.RMSNorm(d, eps=cfg["rms_norm_eps"])
        self.ff_out = nn.Linear(d, cfg["embedding_size"], bias=False)
        hd = d // h
        inv = cfg["rope_theta"] ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.outer(torch.arange(cfg["max_sequence_length"], dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.wte(ids)
        for blk in self.blocks:
            x = blk(x, self.cos[:t], self.sin[:t])
        return self.ff_out(self.ln_f(x))

    def llada_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under LLaDA-8B's real names (``model.transformer.*``)."""
        return {f"model.transformer.{k}": v.detach().contiguous() for k, v in self.state_dict().items()}


def encode(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def make_batch(rng: random.Random, batch: int, exclude: set[str]) -> torch.Tensor:
    rows = []
    while len(rows) < batch:
        item = task.random_item(rng)
        if item.letters in exclude:
            continue
        # EOS padding as LLaDA's SFT pads answers: 32 characters + 7 EOS = 39 slots, one short of the
        # 40 generated at inference (an off-by-one kept so the shipped model stays reproducible).
        ans = encode(item.answer(rng)) + [EOS_ID] * (GEN_LENGTH - task.ANSWER_TOKENS)
        rows.append([BOS_ID] + encode(item.prompt) + ans)
    return torch.tensor(rows)


def diffusion_loss(model: TinyLLaDA, x0: torch.Tensor, gen: torch.Generator, eps: float = 1e-3) -> torch.Tensor:
    b, n = x0.shape
    t = (1 - eps) * torch.rand(b, 1, generator=gen) + eps
    response = torch.zeros_like(x0, dtype=torch.bool)
    response[:, PROMPT_LEN:] = True
    masked = (torch.rand(b, n, generator=gen) < t) & response
    xt = torch.where(masked, torch.full_like(x0, MASK_ID), x0)
    logits = model(xt)
    ce = F.cross_entropy(logits[masked], x0[masked], reduction="none")
    return (ce / t.expand(b, n)[masked]).sum() / (b * GEN_LENGTH)


@torch.no_grad()
def greedy_accuracy(model: TinyLLaDA, items: list[task.Item]) -> float:
    """One token per step, highest confidence first (the quality bar of the shipped model)."""
    model.eval()
    x = torch.tensor([[BOS_ID] + encode(it.prompt) + [MASK_ID] * GEN_LENGTH for it in items])
    for _ in range(GEN_LENGTH):
        masked = x == MASK_ID
        probs = model(x).softmax(-1)
        probs[..., MASK_ID] = 0
        conf, pred = probs.max(-1)
        conf = torch.where(masked, conf, -1.0)
        pos = conf.argmax(-1)
        rows = torch.arange(len(items))
        x[rows, pos] = torch.where(masked[rows, pos], pred[rows, pos], x[rows, pos])
    inv = {i: c for c, i in VOCAB.items()}
    ok = 0
    for it, row in zip(items, x[:, PROMPT_LEN:].tolist()):
        text = "".join(inv[i] for i in row).split(SPECIALS[EOS_ID])[0]
        ok += task.check(it.letters, text)
    model.train()
    return ok / len(items)


def save_checkpoint(model: TinyLLaDA, out: Path, meta: dict) -> None:
    from safetensors.torch import save_file
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.cfg, indent=2) + "\n")
    save_file(model.llada_state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[BOS_ID],
        "eos_token": SPECIALS[EOS_ID],
        "pad_token": SPECIALS[EOS_ID],
        "mask_token": SPECIALS[MASK_ID],
        "unk_token": SPECIALS[UNK_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": model.cfg["max_sequence_length"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=500)
    args = ap.parse_args(argv)

    from tqdm import tqdm

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    held = task.heldout()
    exclude = {it.letters for it in held}
    model = TinyLLaDA(model_config())
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.0, 1 - max(0, s - warm) / (args.steps - warm))
    )
    start = time.time()
    history = []
    bar = tqdm(range(args.steps), desc=f"train ({n_params / 1e6:.2f}M params)")
    for step in bar:
        loss = diffusion_loss(model, make_batch(rng, args.batch, exclude), gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            acc = greedy_accuracy(model, held[:100])
            history.append(
                {
                    "step": step + 1,
                    "loss": round(loss.item(), 4),
                    "greedy_acc_100": acc,
                    "elapsed_s": round(time.time() - start, 1),
                }
            )
            tqdm.write(json.dumps(history[-1]))
            meta = {
                "seed": args.seed,
                "steps": args.steps,
                "batch": args.batch,
                "lr": args.lr,
                "params": n_params,
                "history": history,
                "torch": torch.__version__,
            }
            save_checkpoint(model, args.out, meta)
    if not math.isfinite(loss.item()):
        raise SystemExit("training diverged (non-finite loss)")


if __name__ == "__main__":
    main()
