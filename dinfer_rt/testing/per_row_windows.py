"""A per-row query-window case for any backend: rows of different lengths, each computing its own
slots in its own order with padding, checked against full single-row forwards.

Used by the engine tests on every backend: the in-tree ones (cpu, cuda / rocm_dcu under the
Triton interpreter, ascend with the simulated torch_npu) and the out-of-tree example plugin."""

from __future__ import annotations

import torch

from dinfer_rt.model import Model

LENGTHS = (10, 14, 12)


def _windows(lengths: tuple[int, ...]) -> list[list[torch.Tensor]]:
    """Two forwards: every slot in a shuffled order (fills the cache), then partial windows
    (a block, everything, a block with the slot before it) whose shorter rows are padded."""
    g = torch.Generator().manual_seed(1)
    fill = [torch.randperm(n, generator=g) for n in lengths]
    part = [torch.arange(4, 8), torch.arange(lengths[1]), torch.cat((torch.arange(6, 10), torch.arange(5, 6)))]
    return [fill, part[: len(lengths)]]


def per_row_logits(model: Model, ids: list[torch.Tensor], block_size: int | None = None) -> list[list[torch.Tensor]]:
    """For each of the two forwards, each row's logits [len(window), V] at its window's slots."""
    b, s_len = len(ids), max(len(x) for x in ids) + 1
    cache = model.new_cache(b, s_len)
    outs = []
    for windows in _windows(tuple(len(x) for x in ids)):
        t = max(len(w) for w in windows)
        token_index = torch.full((b, t), s_len - 1)
        input_ids = torch.zeros((b, t), dtype=torch.long)
        positions = torch.zeros((b, t), dtype=torch.long)
        key_valid = torch.zeros((b, s_len), dtype=torch.bool)
        for r, (x, w) in enumerate(zip(ids, windows)):
            token_index[r, : len(w)], input_ids[r, : len(w)], positions[r, : len(w)] = w, x[w], w
            key_valid[r, : len(x)] = True
        logits = model.forward_rows(input_ids, token_index, positions, key_valid, cache, block_size=block_size)
        outs.append([logits[r, : len(w)].cpu().double() for r, w in enumerate(windows)])
    return outs


def per_row_error(model: Model, reference: Model, block_size: int | None = 4, seed: int = 3) -> float:
    """Max relative error of ``model``'s per-row forwards against ``reference``'s full forward of
    each row alone (uncached), over both forwards and every row."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, model.spec.vocab, (n,), generator=g) for n in LENGTHS]
    bs = block_size if model.spec.block_causal else None
    got = per_row_logits(model, ids, bs)
    worst = 0.0
    for forward, windows in zip(got, _windows(LENGTHS)):
        for x, w, logits in zip(ids, windows, forward):
            want = reference.forward(x[None], block_size=bs)[0].double()
            if model.spec.shift_logits:  # Model.forward re-aligns: its position i is raw output i - 1
                keep = w < len(x) - 1
                w, logits = w[keep], logits[keep]
                want = want[1:]
            worst = max(worst, ((logits - want[w]).abs().max() / want.abs().max()).item())
    return worst
