"""SamplingParams: every knob of the shared diffusion scheduler, validated before any compute."""

from __future__ import annotations

from dataclasses import dataclass

from dinfer_rt.errors import GenerationError

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
)
CACHES = ("none", "prefix", "dual", "vicinity")


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
    confidence_head: bool = True  # greedy threshold-style rules use the model's fused confidence head
    early_stop: bool = True
    sync_every: int = 1  # check completion every k steps (loop unrolling; wasted forwards count in NFE)
    batch_size: int = 16
    seed: int = 0
    chat: bool = True

    def validate(self) -> SamplingParams:
        def bad(msg: str) -> GenerationError:
            return GenerationError(f"SamplingParams: {msg}")

        if self.strategy not in STRATEGIES:
            raise bad(f"unknown strategy {self.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
        if self.cache not in CACHES:
            raise bad(f"unknown cache {self.cache!r}; choose one of: {', '.join(CACHES)}")
        if self.gen_length <= 0 or self.block_length <= 0:
            raise bad(f"gen_length ({self.gen_length}) and block_length ({self.block_length}) must be positive")
        if self.gen_length % self.block_length:
            raise bad(f"gen_length {self.gen_length} is not a multiple of block_length {self.block_length}")
        blocks = self.gen_length // self.block_length
        if self.steps is not None and (self.steps <= 0 or self.steps % blocks):
            raise bad(f"steps {self.steps} must be a positive multiple of the {blocks} blocks")
        for name in ("threshold", "low_threshold"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise bad(f"{name} {v} must be in (0, 1]")
        if self.factor <= 0:
            raise bad(f"factor {self.factor} must be > 0")
        if self.temperature < 0:
            raise bad(f"temperature {self.temperature} must be >= 0")
        if self.cfg_scale < 0:
            raise bad(f"cfg_scale {self.cfg_scale} must be >= 0")
        if self.cfg_scale > 0 and self.cache != "none":
            raise bad(f"cfg_scale > 0 runs two rows per prompt and supports cache='none' only, not {self.cache!r}")
        if self.batch_size <= 0 or self.sync_every <= 0:
            raise bad("batch_size and sync_every must be positive")
        if min(self.vicinity_before, self.vicinity_after, self.vicinity_warmup) < 0:
            raise bad("vicinity window and warm-up must be >= 0")
        return self

    def steps_per_block(self) -> int:
        blocks = self.gen_length // self.block_length
        return (self.steps or self.gen_length) // blocks
