"""SamplingParams: every knob of the shared diffusion scheduler, validated before any compute."""

from __future__ import annotations

import dataclasses
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
    "joint_threshold",
)
MAX_STOP = 16
MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI chat's top_logprobs bound)
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
    "edit_threshold": (float, 0, 1, False),
    "max_post_steps": (int, 0, 1024, False),
    "penalty_lambda": (float, 0, 100, False),
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
    "early_stop": (bool, None, None, False),
    "batch_size": (int, 1, None, False),
    "seed": (int, 0, 2**63 - 1, False),
    "chat": (bool, None, None, False),
    "precision_refresh": (bool, None, None, False),
    "logprobs": (int, 0, MAX_LOGPROBS, False),
}
_OPTIONAL = {"steps", "refresh_bound", "refresh_window", "block_length", "logprobs"}
DEFAULT_BLOCK_LENGTH = 40  # a bidirectional family's block when a request sets none


@dataclass
class SamplingParams:
    """Decoding configuration (defaults: LLaDA's one-token-per-step low-confidence rule).

    ``steps`` is the total step budget of the schedule-driven rules (low_confidence,
    random, maskgit_plus, topk_margin, entropy); ``None`` means one token per step.
    Threshold-style rules (threshold, factor, hierarchical, credit) run each block until
    it has no masks, committing at least one token per step.
    """

    gen_length: int = 40
    # None: the checkpoint's block size for block-causal families (LLaDA2, SDAR: their mask is
    # trained on it), else DEFAULT_BLOCK_LENGTH (``for_model`` resolves it)
    block_length: int | None = None
    steps: int | None = None
    strategy: str = "low_confidence"
    threshold: float = 0.9
    factor: float = 1.0
    low_threshold: float = 0.6  # hierarchical: one representative per masked run above this
    # joint_threshold (LLaDA2.1 token-to-token editing): an unmasked slot of the current block is
    # rewritten when its argmax differs with probability > edit_threshold (0: every disagreeing
    # slot); a block ends after a no-mask step with no edit, or past max_post_steps such steps;
    # penalty_lambda is subtracted from the logit of the previous slot's token (0: off)
    edit_threshold: float = 0.5
    max_post_steps: int = 16
    penalty_lambda: float = 0.0
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
    early_stop: bool = True
    batch_size: int = 16
    seed: int = 0
    chat: bool = True
    stop: tuple[str, ...] = ()  # stop strings: a row ends at the block in which one is final; text cut there
    precision_schedule: str | None = None  # e.g. "int8@0.5,fp32": cheap forwards while the block is mostly masked
    precision_refresh: bool = False  # recompute cached K/V at the first full-precision forward after cheap ones
    # record each final token's log-probability under the forward that made it final (the forward
    # that committed it; an editing rule: of its last write), with this many top alternatives
    # (0: the token's own only); None: off. Takes the logits path (no fused confidence head)
    logprobs: int | None = None

    def validate(self, block_causal: bool = False) -> SamplingParams:
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
        if self.steps is not None and self.steps > self.gen_length:  # also bounds the schedule's [B, steps] plan
            raise bad(f"steps {self.steps} must be <= gen_length {self.gen_length}: every step commits a token")
        lb = self.block()
        if self.block_length is not None:  # None: the model decides (``for_model`` checks again)
            if self.gen_length % lb and not block_causal:  # block-causal blocks align to position 0
                raise bad(f"gen_length {self.gen_length} is not a multiple of block_length {lb}")
            blocks = max(1, self.gen_length // lb)
            if self.steps is not None and self.steps % blocks:
                raise bad(f"steps {self.steps} must be a positive multiple of the {blocks} blocks")
        if self.precision_schedule is not None:
            PrecisionSchedule.parse(self.precision_schedule)
        if self.cfg_scale > 0 and self.cache != "none":
            raise bad(f"cfg_scale > 0 runs two rows per prompt and supports cache='none' only, not {self.cache!r}")
        return self

    def block(self) -> int:
        """The block length these params decode with when no model resolves it (``for_model``)."""
        return self.block_length or DEFAULT_BLOCK_LENGTH

    def for_model(self, spec) -> SamplingParams:
        """A validated copy for a model (its ``ModelSpec``): ``block_length`` None becomes the
        checkpoint's block size for a block-causal family (LLaDA2's 32, SDAR's 4), else
        ``DEFAULT_BLOCK_LENGTH``; a block-causal family's ``gen_length`` need not be a multiple of
        it (its blocks align to position 0, so the first one holds the prompt's tail anyway)."""
        block = self.block_length
        if block is None:
            block = (spec.default_block_size if spec.block_causal else None) or DEFAULT_BLOCK_LENGTH
            if self.gen_length % block and not spec.block_causal:  # say where the block length came from
                raise GenerationError(
                    f"SamplingParams: gen_length {self.gen_length} is not a multiple of block_length {block} "
                    "(the default: no block_length was set); set block_length to a divisor of gen_length"
                )
        return dataclasses.replace(self, block_length=block).validate(block_causal=spec.block_causal)

    def refresh_limit(self) -> float:
        """Commits since the last full refresh at which the adaptive / anchored / delayed caches
        refresh every position (``refresh_bound``; by default 16 for adaptive, else never)."""
        if self.refresh_bound is not None:
            return self.refresh_bound
        return 16 if self.cache == "adaptive" else math.inf

    def max_block_steps(self) -> int:
        """The steps the scheduler lets one block take before it calls the block stuck (every rule
        commits at least one token per step): 4 x block_length + steps per block (an editing rule:
        plus its post steps and the forward that ends the block)."""
        post = self.max_post_steps + 1 if self.strategy == "joint_threshold" else 0
        return 4 * self.block() + self.steps_per_block() + post

    def steps_per_block(self) -> int:
        blocks = max(1, self.gen_length // self.block())
        return (self.steps or self.gen_length) // blocks
