"""The validation oracle as a backend of its own.

Every IR op runs its reference semantics (``ir/ops.py``) in plain torch, unfused (it declares no
kernels, so the fusion passes have nothing to fuse into), with no native code and no device
decision kernel: what ``dinfer-rt validate`` compares every backend against, ``cpu`` included.
Used in float64. Auto-detection never picks it (lowest priority); choose it by name.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dinfer_rt.backend import Availability, Backend, Capabilities
from dinfer_rt.executor import Kernel


class ReferenceBackend(Backend):
    name = "reference"
    flavour = "torch"
    priority = -100  # never the automatic choice: the oracle is slow on purpose

    def is_available(self) -> Availability:
        return Availability(True, f"torch {torch.__version__}: every op's reference semantics, unfused")

    def validate_choice(self) -> str | None:
        """One flavour and no arch: the oracle is plain torch wherever it runs."""
        return self.choice_problem((type(self).flavour,))

    def capabilities(self) -> Capabilities:
        dtypes = (torch.float64, torch.float32)
        return Capabilities(dtypes=dtypes, collectives="gloo", weight_formats=("int8", "fp8", "gptq4"))

    def kernels(self) -> Mapping[str, Kernel]:
        return {}  # every op from the shared references (kernel_table's fallback)


def commit_edit(
    conf: torch.Tensor,
    token: torch.Tensor,
    masked: torch.Tensor,
    editable: torch.Tensor,
    x_block: torch.Tensor,
    *,
    threshold: float,
    edit_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics of a backend's ``edit_kernel``: one step of the editing rule joint_threshold
    (greedy, ``penalty_lambda`` 0) from the confidence head's top-1 probability ``conf`` and
    argmax ``token`` [B, L] (mask token banned), in torch at ``conf``'s precision (float64 when
    validating), on ``conf``'s device with no host sync:

    - mask-to-token ``commit``: slots of ``masked`` with ``conf`` > ``threshold``; a row with a
      masked slot and none above commits its best masked slot (ties: the lower index);
    - token-to-token ``edit``: slots of ``editable`` (and not ``masked``) whose ``token`` differs
      from the current one in ``x_block`` with ``conf`` > ``edit_threshold``.

    Both write ``token`` into ``x_block`` (a [B, L] view of the sequence) in place; returns
    (commit, edit) [B, L] bool."""
    masked, editable = masked.bool(), editable.bool() & ~masked.bool()
    token = token.to(x_block.dtype)
    best = conf.masked_fill(~masked, float("-inf")).argmax(-1, keepdim=True)
    forced = torch.zeros_like(masked).scatter_(-1, best, True)
    commit = masked & ((conf > threshold) | forced)
    edit = editable & (token != x_block) & (conf > edit_threshold)
    x_block.copy_(torch.where(commit | edit, token, x_block))
    return commit, edit
