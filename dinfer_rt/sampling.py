"""SamplingParams: every knob of the shared diffusion scheduler, validated before any compute."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dinfer_rt.errors import GenerationError
from dinfer_rt.precision import PrecisionSchedule

STRATEGIES = (
    "low_confidence",
    "random",
    "threshold",
    "factor",
    "hierarchical",
    "credit",
    "maskgit_plus",
    "topk_margin",
    "entropy",
    "low_confidence_dynamic",
)
MAX_STOP = 16
CACHES = ("none", "prefix", "dual", "vicinity", "adaptive", "anchored", "delayed")

# field -> (type, lower bound, upper bound, lower bound exclusive); None: unbounded. Floats that
# scale logits (temperature, cfg_scale, credit_alpha) or enter a power (credit_boost) are bounded
# well inside float16's range, so a finite value never overflows inside the computation (1e39
# is finite in Python and inf in float32); factor compares against (n + 1) * (1 - c) < block + 1.
_FIELD_RULES: dict[str, tuple[type, float | None, float | None, bool]] = {
    "gen_length": (int, 1, None, False),
    "block_length": (int, 1, None, False),
    "steps": (int, 1, None, False),
    "strategy": (str, None, None, False),
    "threshold": (float, 0, 1, True),
    "factor": (float, 0, 1_000_000, True),
    "low_threshold": (float, 0, 1, True),
    "credit_decay": (float, 0, 1, False),
    "credit_boost": (float, 0, 100, False),
    "credit_alpha": (float, 0, 100, False),
    "temperature": (float, 0, 100, False),
    "cfg_scale": (float, 0, 100, False),
    "cache": (str, None, None, False),
    "vicinity_before": (int, 0, None, False),
    "vicinity_after": (int, 0, None, False),
    "vicinity_warmup": (int, 0, None, False),
    "refresh_bound": (int, 0, None, False),
    "refresh_window": (int, 0, None, False),
    "confidence_head": (bool, None, None, False),
    "early_stop": (bool, None, None, False),
    "sync_every": (int, 1, None, False),
    "max_forward_tokens": (int, 1, None, False),
    "batch_size": (int, 1, None, False),
    "seed": (int, 0, 2**63 - 1, False),
    "chat": (bool, None, None, False),
    "precision_refresh": (bool, None, None, False),
}
_OPTIONAL = {"steps", "refresh_bound", "refresh_window", "max_forward_tokens"}


@dataclass
class SamplingParams:
    """Decoding configuration (defaults: LLaDA's one-token-per-step low-confidence rule).

    ``steps`` is the total step budget of the schedule-driven rules (low_confidence,
    random, maskgit_plus, topk_margin, entropy); ``None`` means one token per step.
    Threshold-style rules (threshold, factor, hierarchical, credit) run each block until
    it has no masks, committing at least one token per step.
    """

    gen_length: int = 40
    block_length: int = 40
    steps: int | None = None
    strategy: str = "low_confidence"
    threshold: float = 0.9
    factor: float = 1.0
    low_threshold: float = 0.6  # hierarchical: one representative per masked run above this
    credit_decay: float = 0.8
    credit_boost: float = 0.2
    credit_alpha: float = 0.7
    temperature: float = 0.0
    cfg_scale: float = 0.0  # classifier-free guidance; 0 disables it
    cache: str = "none"
    vicinity_before: int = 16
    vicinity_after: int = 16
    vicinity_warmup: int = 4
    # adaptive/anchored/delayed cache: full refresh once a row committed this many tokens since the last
    # (None: adaptive 16, anchored and delayed never)
    refresh_bound: int | None = None
    # adaptive/anchored/delayed cache: positions before the block recomputed each step (None: adaptive all,
    # anchored and delayed 0)
    refresh_window: int | None = None
    confidence_head: bool = True  # greedy threshold-style rules use the model's fused confidence head
    early_stop: bool = True
    sync_every: int = 1  # check completion every k steps (loop unrolling; wasted forwards count in NFE)
    max_forward_tokens: int | None = 4096  # rows x computed positions per forward; bigger batches run in row slices
    batch_size: int = 16
    seed: int = 0
    chat: bool = True
    stop: tuple[str, ...] = ()  # stop strings: a row ends at the block in which one is final; text cut there
    precision_schedule: str | None = None  # e.g. "int8@0.5,fp32": cheap forwards while the block is mostly masked
    precision_refresh: bool = False  # recompute cached K/V at the first full-precision forward after cheap ones

    def validate(self) -> SamplingParams:
        """Every field's type and range, then the rules between fields; the first problem is
        raised naming the field. Returns ``self``."""

        def bad(msg: str) -> GenerationError:
            return GenerationError(f"SamplingParams: {msg}")

        for name, (kind, low, high, low_open) in _FIELD_RULES.items():
            v = getattr(self, name)
            if v is None and name in _OPTIONAL:
                continue
            if kind is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
                setattr(self, name, v)
            if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
                raise bad(f"{name} must be {kind.__name__}, got {type(v).__name__} {v!r}")
            if kind is float and not math.isfinite(v):
                raise bad(f"{name} must be a finite number, got {v!r}")
            too_low = low is not None and (v <= low if low_open else v < low)
            if too_low or (high is not None and v > high):
                if high is None:
                    raise bad(f"{name} {v!r} must be {'>' if low_open else '>='} {low}")
                raise bad(f"{name} {v!r} must be in {'(' if low_open else '['}{low}, {high}]")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not isinstance(self.stop, (tuple, list)) or not all(isinstance(x, str) and x for x in self.stop):
            raise bad(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP:
            raise bad(f"stop holds {len(self.stop)} strings; at most {MAX_STOP}")
        self.stop = tuple(self.stop)
        if self.strategy not in STRATEGIES:
            raise bad(f"unknown strategy {self.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
        if self.cache not in CACHES:
            raise bad(f"unknown cache {self.cache!r}; choose one of: {', '.join(CACHES)}")
        if self.gen_length % self.block_length:
            raise bad(f"gen_length {self.gen_length} is not a multiple of block_length {self.block_length}")
        blocks = self.gen_length // self.block_length
        if self.steps is not None and self.steps > self.gen_length:  # also bounds the schedule's [B, steps] plan
            raise bad(f"steps {self.steps} must be <= gen_length {self.gen_length}: every step commits a token")
        if self.steps is not None and self.steps % blocks:
            raise bad(f"steps {self.steps} must be a positive multiple of the {blocks} blocks")
        if self.sync_every > (limit := self.max_block_steps()):
            raise bad(
                f"sync_every {self.sync_every} must be <= {limit}: a block runs at most {limit} steps "
                f"(4 x block_length {self.block_length} + {self.steps_per_block()} steps per block), so its "
                "completion would never be checked"
            )
        if self.precision_schedule is not None:
            PrecisionSchedule.parse(self.precision_schedule)
        if self.cfg_scale > 0 and self.cache != "none":
            raise bad(f"cfg_scale > 0 runs two rows per prompt and supports cache='none' only, not {self.cache!r}")
        return self

    def refresh_limit(self) -> float:
        """Commits since the last full refresh at which the adaptive / anchored / delayed caches
        refresh every position (``refresh_bound``; by default 16 for adaptive, else never)."""
        if self.refresh_bound is not None:
            return self.refresh_bound
        return 16 if self.cache == "adaptive" else math.inf

    def max_block_steps(self) -> int:
        """The steps the scheduler lets one block take before it calls the block stuck (every rule
        commits at least one token per step): 4 x block_length + steps per block."""
        return 4 * self.block_length + self.steps_per_block()

    def steps_per_block(self) -> int:
        blocks = self.gen_length // self.block_length
        return (self.steps or self.gen_length) // blocks
