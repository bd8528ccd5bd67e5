"""Precision schedules: cheap forwards while a block is mostly masks, full precision at the end.

A schedule is a comma-separated list of stages, tried in order at every forward of a block;
the first whose condition holds picks the forward's weight format, and the last stage names the
model's own precision (its dtype, spelt as ``--dtype`` accepts it: ``fp32`` / ``float32``, ``bf16`` /
``bfloat16``, ``fp16`` / ``float16``, ``fp64`` / ``float64``, any case; or ``full``):

  ``int8@0.5,fp32``          int8 weights while more than half of the block is still masked
  ``fp8@0.75,int8@0.25,bf16`` fp8 above 75% masked, int8 above 25%, then the model's bf16
  ``int8:3,fp32``            the first 3 forwards of every block in int8

The masked fraction of a batch is that of its least-masked running row, so no row is decided
more cheaply than its own state allows. The scheduler adds one guarantee on top
(``generate.py``): a low-precision forward whose commits would finish a block is redone in full
precision, so every block's final tokens are decided by the full-precision model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dinfer_rt.errors import GenerationError
from dinfer_rt.quant import WEIGHT_FORMATS

FULL_NAMES = {"full": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
# the long spellings ``--dtype`` also takes (dtypes.DTYPES) -> the short name a schedule reports
_SPELLINGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def full_name(name: str) -> str | None:
    """The canonical last-stage name for ``name`` (``float32`` -> ``fp32``, any case), or None."""
    key = name.strip().lower()
    key = _SPELLINGS.get(key, key)
    return key if key in FULL_NAMES else None


@dataclass(frozen=True)
class Stage:
    fmt: str  # a quantised weight format (int8, fp8)
    kind: str  # "fraction": while the masked fraction > bound; "steps": the block's first `bound` forwards
    bound: float


def _covers(earlier: Stage, later: Stage) -> bool:
    """Whether ``earlier``'s condition holds whenever ``later``'s does (so ``later`` never fires)."""
    if earlier.kind != later.kind:
        return False
    if earlier.kind == "fraction":  # masked > later.bound >= earlier.bound
        return earlier.bound <= later.bound
    return earlier.bound >= later.bound  # step < later.bound <= earlier.bound


@dataclass(frozen=True)
class PrecisionSchedule:
    stages: tuple[Stage, ...]
    full: str  # the last stage's name

    @classmethod
    def parse(cls, text: str) -> PrecisionSchedule:
        """Parse a schedule string; a malformed one is a one-line error naming the stage."""

        def bad(msg: str) -> GenerationError:
            return GenerationError(f"SamplingParams: precision_schedule {text!r}: {msg}")

        if not isinstance(text, str) or not text.strip():
            raise bad("must be a non-empty string such as 'int8@0.5,fp32'")
        parts = [p.strip() for p in text.split(",")]
        *low, last = parts
        full = full_name(last)
        if full is None:
            spelt = {short: [short, *(k for k, v in _SPELLINGS.items() if v == short)] for short in FULL_NAMES}
            names = ", ".join(n for names in spelt.values() for n in names)
            raise bad(f"the last stage {last!r} must name the model's precision: {names}")
        if not low:
            raise bad("needs at least one low-precision stage before the last, e.g. 'int8@0.5,fp32'")
        stages = []
        for part in low:
            sep = "@" if "@" in part else ":" if ":" in part else None
            if sep is None:
                raise bad(f"stage {part!r} must be FORMAT@FRACTION or FORMAT:STEPS")
            fmt, _, num = part.partition(sep)
            if fmt not in WEIGHT_FORMATS:
                raise bad(f"stage {part!r}: unknown precision {fmt!r}; low precisions are {', '.join(WEIGHT_FORMATS)}")
            try:
                bound = float(num) if sep == "@" else int(num)
            except ValueError:
                raise bad(f"stage {part!r}: {num!r} is not a {'fraction' if sep == '@' else 'step count'}") from None
            if sep == "@" and not 0 <= bound < 1:
                raise bad(f"stage {part!r}: the masked fraction must be in [0, 1)")
            if sep == ":" and bound < 1:
                raise bad(f"stage {part!r}: the step count must be >= 1")
            stage = Stage(fmt, "fraction" if sep == "@" else "steps", bound)
            shadow = next((p for p, st in zip(low, stages) if _covers(st, stage)), None)
            if shadow is not None:  # stages are tried in order: this one could never pick a forward
                order = "fractions must decrease" if sep == "@" else "step counts must increase"
                raise bad(f"stage {part!r} is unreachable: {shadow!r} before it holds whenever it would ({order})")
            stages.append(stage)
        return cls(tuple(stages), full)

    def check_model(self, dtype: torch.dtype, weight_format: str | None) -> None:
        """The last stage must be the model's own precision, and the model must hold float weights."""
        want = FULL_NAMES[self.full]
        if want is not None and want != dtype:
            raise GenerationError(
                f"precision_schedule: the last stage {self.full!r} is not the model's dtype {dtype}; "
                f"load the model in {self.full} or end the schedule with 'full'"
            )
        if weight_format is not None:
            raise GenerationError(
                f"precision_schedule: the model holds {weight_format} weights only; a schedule needs the float "
                "weights (load without quantization)"
            )

    def choose(self, masked_fraction: float, step: int) -> str | None:
        """The weight format for a forward (None: the model's own precision)."""
        for st in self.stages:
            if (st.kind == "fraction" and masked_fraction > st.bound) or (st.kind == "steps" and step < st.bound):
                return st.fmt
        return None

    def formats(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(st.fmt for st in self.stages))
