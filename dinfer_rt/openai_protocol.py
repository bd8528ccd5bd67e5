"""OpenAI request bodies -> engine submissions, and engine results -> OpenAI response objects.

Every field is checked before any compute; a bad one is an :class:`ApiError` (HTTP 400) whose
message and ``param`` name the field and the allowed values. Diffusion knobs ride as extra body
fields with the CLI's names (``strategy``, ``threshold``, ``cache``, ``block_length``, ...) and
the server's defaults. ``max_tokens`` is rounded up to whole blocks for decoding and the output
cut to it (its range: the room the prompt leaves, in whole blocks).

Fields real clients send and this server has no use for (``user``, ``metadata``, ``store``, ...)
are ignored, as OpenAI-compatible servers ignore them, with two exceptions: another stack's name
for one of our fields (``FOREIGN_FIELDS``: ``block_size``, ``num_steps``, ``cache_policy``) and an
unknown field close to one of this server's own knobs (``treshold``, ``block_len``) are a 400
naming the field to use, since ignoring them would silently decode with the default. Fields that would change the answer
and cannot be honoured (``top_p`` below 1, ``tools``, a JSON ``response_format``) are a 400
unless they hold the neutral value clients send by default.

``logprobs`` (completions: an integer in [0, 5], the top alternatives per token; chat: a boolean
with ``top_logprobs`` in [0, 20]) reports each answer token's log-probability under the forward
that made it final (a diffusion model has no left-to-right distribution): ``SamplingParams.logprobs``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

from dinfer_rt.errors import DinferError, TokenizerError
from dinfer_rt.sampling import CACHES, MAX_LOGPROBS, MAX_STOP, STRATEGIES, SamplingParams
from dinfer_rt.strategies import preset_fields, unread
from dinfer_rt.tokenizer import refuse_mask_token

MAX_MESSAGE_CHARS = 2000  # an error message past this is cut: a client's value echoed whole, never MBs


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        if len(message) > MAX_MESSAGE_CHARS:  # a client's huge value echoed by a check: never megabytes back
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({len(message)} characters in all)"
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


# Diffusion knobs accepted as extra body fields: SamplingParams names (the CLI's, with dashes).
DIFFUSION_FIELDS = (
    "strategy threshold factor low_threshold credit_decay credit_boost credit_alpha cache block_length steps "
    "vicinity_before vicinity_after vicinity_warmup refresh_bound refresh_window "
    "edit_threshold max_post_steps penalty_lambda"
).split()
# EngineArgs fields: engine settings (``serve`` flags), refused in a request body, never ignored.
ENGINE_FIELDS = ("sync_every", "confidence_head", "max_forward_tokens")
# The other SamplingParams fields: a request cannot set them (the server's flags do, or an OpenAI
# field says it), so one in a body is refused with what to use instead, never silently ignored.
SERVER_SAMPLING_FIELDS = {
    "gen_length": "the answer's length is 'max_tokens' (or 'max_completion_tokens')",
    "batch_size": "the server batches the requests it runs (--max-num-seqs)",
    "chat": "the endpoint decides: /v1/chat/completions applies the chat template, /v1/completions does not",
    "early_stop": "the server sets it at start-up (--no-early-stop)",
    "cfg_scale": "classifier-free guidance is the server's setting (--cfg-scale)",
    "precision_schedule": "the server sets it at start-up (--precision-schedule)",
    "precision_refresh": "the server sets it at start-up (--precision-refresh)",
}
# Other diffusion stacks' names for this server's fields (LLaDA / Dream / Fast-dLLM / SDAR scripts,
# HF ``generate``): ignored like any unknown field they would decode silently with the default,
# so each is a 400 naming the field to use (``refuse_misspelt_knobs``).
FOREIGN_FIELDS = {
    "block_size": "block_length",
    "num_steps": "steps",
    "diffusion_steps": "steps",
    "denoising_steps": "steps",
    "sampling_steps": "steps",
    "cache_policy": "cache",
    "kv_cache": "cache",
    "use_cache": "cache",
    "dual_cache": "cache",
    "remasking": "strategy",
    "remasking_strategy": "strategy",
    "alg": "strategy",
    "confidence_threshold": "threshold",
    "max_new_tokens": "max_tokens",
}
# OpenAI / vLLM fields accepted only at a neutral value (anything else would be ignored silently,
# a different answer than the client asked for): null, or one of the values clients send by default.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "best_of": (1,),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # with no tools there is nothing to call either way
    "functions": ([],),  # the legacy spelling of tools
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "top_k": (-1, 0),  # vLLM's sampling extras, sent through extra_body
    "min_p": (0,),
    "repetition_penalty": (1,),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    # vLLM's output and constraint extras: honoured by none of this server's decoders
    "stop_token_ids": ([],),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "allowed_token_ids": ([],),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "truncate_prompt_tokens": (),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    # OpenAI chat outputs this text-only server cannot produce
    "modalities": (["text"],),
    "audio": (),
    "web_search_options": (),
}
# Why a non-neutral value is refused, appended to the 400's message.
_WHY_REFUSED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "tool calling is not supported",
    "function_call": "tool calling is not supported",
    "response_format": "only plain text output: structured (JSON) output is not supported",
    "echo": "'echo' is a /v1/completions field",
    "modalities": "this server answers text only",
    "audio": "this server answers text only",
    "web_search_options": "web search is not supported",
}
for _name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
    _WHY_REFUSED[_name] = "constrained (guided) decoding is not supported"
# Fields real clients send that change nothing here: accepted and ignored (listed so that the
# misspelling rule below never takes one of them for a mistyped knob).
IGNORED_FIELDS = frozenset(
    "user metadata store service_tier parallel_tool_calls prediction reasoning_effort "
    "verbosity prompt_cache_key safety_identifier".split()
)
OPENAI_FIELDS = frozenset(
    {"model", "max_tokens", "max_completion_tokens", "temperature", "seed", "stop", "stream", "stream_options"}
    | {"n", "echo", "prompt", "messages", "logprobs", "top_logprobs", *_NEUTRAL, *IGNORED_FIELDS}
)
SHOWN_CHARS = 80  # an error echoes at most this much of a client's value
MAX_PROMPTS = 256  # prompts in one /v1/completions batch
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions ``logprobs``: OpenAI's legacy bound (chat: MAX_LOGPROBS)
LOGPROB_FLOOR = -9999.0  # a log-probability of -inf is reported as this (JSON has no infinity)
_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "seed", "stop", "stream", "n"}
_COMMON |= {"stream_options", "return_canvas", *DIFFUSION_FIELDS, *_NEUTRAL, *IGNORED_FIELDS}
_COMMON |= {"logprobs", "top_logprobs"}
_COMMON |= {"allow_mask_in_prompt"}  # infilling on purpose: the prompt may hold the mask token
_COMMON |= {"preset", "stream_provisional"}  # named decoding settings; an editing rule's provisional tail
_COMMON |= {"priority"}  # vLLM's scheduling priority: lower is admitted first
COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}
CHAT_FIELDS = _COMMON | {"messages", "chat_template_kwargs", "echo"}
ROLES = ("system", "user", "assistant")


@dataclass
class Submission:
    """A validated request: what the engine needs plus how to answer. A /v1/completions batch
    (``prompt`` a list of prompts) holds several prompts, one engine request and one choice each."""

    prompts: list[list[int]]
    params: SamplingParams
    max_tokens: int
    stream: bool
    include_usage: bool
    return_canvas: bool
    chat: bool
    continuous_usage: bool = False  # every streamed chunk carries usage (vLLM's continuous_usage_stats)
    echo: list[str] | None = None  # completions ``echo``: each prompt's text, put before its answer
    stream_provisional: bool = False  # also stream the provisional tail (an editing rule's open block), marked
    priority: int = 0  # vLLM's meaning: the engine's wait queue admits lower first, FIFO within a priority

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt of a one-prompt request (chat, or completions with one prompt)."""
        return self.prompts[0]


def _type_name(v: Any) -> str:
    return type(v).__name__


def _shown(v: Any) -> str:
    """``repr(v)`` cut to SHOWN_CHARS characters (an error does not echo a huge value in full)."""
    text = repr(v)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def _only_ids(value: Any, ids: frozenset[int]) -> bool:
    """Whether ``value`` is a non-empty list of ints, each one of ``ids``."""
    return isinstance(value, list) and bool(value) and all(type(v) is int and v in ids for v in value)


def _neutral(value: Any, accepted: tuple[Any, ...]) -> bool:
    """Whether ``value`` is null or one of ``accepted`` (a bool matches only a bool: ``true`` is no ``1``)."""
    if value is None:
        return True
    for a in accepted:
        if isinstance(value, bool) or isinstance(a, bool):
            if value is a:
                return True
        elif type(value) is type(a) or (isinstance(value, (int, float)) and isinstance(a, (int, float))):
            if value == a:
                return True
    return False


def _int(body: dict, name: str, low: int, high: int | None = None, why: str = "") -> int | None:
    """``body[name]``: None, or an integer in [low, high]; ``why`` is appended to a range error."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer, got {_type_name(v)} {_shown(v)}", name)
    if v < low or (high is not None and v > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ApiError(400, f"'{name}' must be {span}, got {v}{why}", name)
    return v


def _bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {_type_name(v)} {_shown(v)}", name)
    return v


def _kv_memory(positions: int, max_len: int, per_position: int | None) -> str:
    """`` (its K/V would need ...)``: the memory side of a too-long request, as the engine says it."""
    if per_position is None:
        return ""
    from dinfer_rt.kv_pool import format_bytes

    need, row = positions * per_position, max_len * per_position
    return (
        f" (its K/V would need {format_bytes(need)}, {need} bytes: {positions} positions x {per_position} bytes; "
        f"a KV pool row holds {max_len} positions, {format_bytes(row)})"
    )


def parse(
    body: Any,
    *,
    chat: bool,
    tokenizer,
    defaults: SamplingParams,
    model_name: str,
    max_len: int,
    chars_per_token: int | None = None,
    mask_id: int | None = None,
    kv_bytes_per_position: int | None = None,
    batch_limit: tuple[int, str] | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> Submission:
    """Validate an OpenAI completions / chat-completions body (``chat``) against the served model.

    ``chars_per_token``: the most characters one token of the tokenizer covers; when given, a text
    prompt longer than ``max_len`` tokens could hold is refused before it is tokenised. ``mask_id``:
    the model's mask token, refused in the prompt unless ``allow_mask_in_prompt`` is true.
    ``kv_bytes_per_position``: one position's K/V over the layers (and ranks), so a request too long
    for the KV pool's rows is also told the memory it would need. ``batch_limit``: (the most
    requests the server holds at once, why): a completions batch of more prompts can never be
    admitted, and is refused naming ``prompt`` before any prompt is tokenised. ``stop_ids``: the
    ids that already end a generation (EOS, end of turn): a vLLM ``stop_token_ids`` of only those
    asks for nothing new and is accepted."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    other = ("messages", "chat_template_kwargs") if not chat else ("prompt",)
    for name in other:  # a field of the other endpoint would be ignored: refused instead
        if name in body:
            where = "/v1/chat/completions" if not chat else "/v1/completions"
            raise ApiError(400, f"'{name}' belongs to {where}, not this endpoint", name)
    for name in ENGINE_FIELDS:  # how the engine runs is the server's choice, not a request's
        if name in body:
            flag = "--" + name.replace("_", "-")
            if name == "confidence_head":
                flag = "--no-confidence-head"
            why = f"'{name}' is an engine setting, not a request field: the server sets it at start-up ({flag})"
            raise ApiError(400, why, name)
    for name, instead in SERVER_SAMPLING_FIELDS.items():
        if name in body:
            raise ApiError(400, f"'{name}' is not a request field: {instead}", name)
    refuse_misspelt_knobs(body, allowed)
    neutral_values = {**_NEUTRAL, "echo": (False,)} if chat else _NEUTRAL
    for name, neutral in neutral_values.items():
        if name == "stop_token_ids" and _only_ids(body.get(name), stop_ids):
            continue  # the model's own stop ids: what the engine stops on anyway
        if name in body and not _neutral(body[name], neutral):
            only = " or ".join(repr(v) for v in (None, *neutral))
            why = f": {_WHY_REFUSED[name]}" if name in _WHY_REFUSED else ""
            raise ApiError(
                400, f"'{name}' {_shown(body[name])} is not supported by this server (only {only}){why}", name
            )
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404, f"model {_shown(model)} does not exist; this server serves '{model_name}'", "model", "not_found"
        )
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise ApiError(400, f"'n' must be 1 (one choice per prompt), got {n}", "n")
    priority = _int(body, "priority", -(2**63), 2**63 - 1) or 0
    stream = bool(_bool(body, "stream"))
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)
    canvas = bool(_bool(body, "return_canvas"))
    if canvas and not stream:
        raise ApiError(400, "'return_canvas' streams the canvas each step: it needs 'stream': true", "return_canvas")
    provisional = bool(_bool(body, "stream_provisional"))
    if provisional and not stream:
        why = "'stream_provisional' streams text that may still change: it needs 'stream': true"
        raise ApiError(400, why, "stream_provisional")
    echo = bool(_bool(body, "echo"))
    logprobs = _logprobs(body, chat, echo)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"'user' must be a string, got {_type_name(user)} {_shown(user)}", "user")

    if tokenizer is None:
        raise ApiError(400, "this model was loaded without a tokenizer: text requests cannot be served")
    if chat:
        prompts, names, texts = [_chat_prompt(body, tokenizer, max_len, chars_per_token)], ["messages"], None
    else:
        prompts, names, texts = _completion_prompts(body, tokenizer, max_len, chars_per_token, batch_limit)
    for ids, where in zip(prompts, names):
        try:
            refuse_mask_token(ids, mask_id, f"'{where}'", bool(_bool(body, "allow_mask_in_prompt")))
        except DinferError as e:
            raise ApiError(400, str(e), where) from None

    fields: dict[str, Any] = {}
    for name in DIFFUSION_FIELDS:
        if body.get(name) is not None:
            fields[name] = body[name]
    if body.get("preset") is not None:  # a named preset's fields, under the ones the body sets itself
        try:
            fields = {**preset_fields(body["preset"]), **fields}
        except DinferError as e:
            why = str(e).removeprefix("preset: ")
            raise ApiError(400, f"'preset' {_shown(body['preset'])}: {why}", "preset") from None
    if body.get("temperature") is not None:
        t = body["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 or t > 2:
            why = f"'temperature' must be a number in [0, 2], got {_type_name(t)} {_shown(t)}"
            raise ApiError(400, why, "temperature")
        fields["temperature"] = float(t)
    seed = _int(body, "seed", 0, 2**63 - 1)
    if seed is not None:
        fields["seed"] = seed
    fields["stop"] = _stop(body.get("stop"))
    if logprobs is not None:
        fields["logprobs"] = logprobs
    params = dataclasses.replace(defaults, **fields, chat=False)
    block = params.block_length
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ApiError(400, f"'block_length' must be an integer >= 1, got {block!r}", "block_length")
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    size, where = len(prompts[longest]), "messages" if chat else names[longest]
    room = max_len - size  # positions the longest prompt leaves for the answer
    if room < 1:
        memory = _kv_memory(size + 1, max_len, kv_bytes_per_position)
        raise ApiError(
            400, f"the prompt is {size} tokens; the max model length is {max_len}: no room to generate{memory}", where
        )
    if block > room:  # the answer is decoded in whole blocks: not even one fits
        if "block_length" in fields:  # the request's own block (or its preset's): that is what does not fit
            raise ApiError(
                400, f"'block_length' {block} does not fit: the answer is decoded in whole blocks, and the prompt's "
                f"{size} tokens leave {room} of the max model length {max_len}; 'block_length' must be at most "
                f"{room} here", "block_length",
            )  # fmt: skip
        memory = _kv_memory(size + block, max_len, kv_bytes_per_position)
        raise ApiError(
            400, f"the prompt is {size} tokens; the max model length {max_len} leaves {room}, less than one block "
            f"of {block} (the server's block_length; the answer is decoded in whole blocks): shorten the prompt "
            f"or send a 'block_length' of at most {room}{memory}", where,
        )  # fmt: skip
    high = room // block * block  # the longest answer whose whole blocks fit
    why = (
        f" (the prompt's {size} tokens leave {room} of the max model length {max_len}, and the answer is decoded "
        f"in whole blocks of {block}, 'block_length')"
    )
    _, max_tokens = _max_tokens(body, high, why)
    if max_tokens is None:
        max_tokens = min(defaults.gen_length, high)
    gen = -(-max_tokens // block) * block  # <= room
    steps = params.steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ApiError(400, f"'steps' must be an integer >= 1, got {steps!r}", "steps")
    named = params.strategy in STRATEGIES and params.cache in CACHES  # else validate() names the bad one
    given = [name for name in DIFFUSION_FIELDS if body.get(name) is not None] if named else []
    for name, setting, values in unread(params, given):  # a knob this request's rule / cache never reads
        source = "this request's" if setting in fields else "the server's default"
        needs = f"'{setting}' {' / '.join(values)}" if values is not None else f"a '{setting}'"
        raise ApiError(
            400, f"'{name}' applies to {needs} (this request: {getattr(params, setting)!r}, {source}); set "
            f"'{setting}' or drop '{name}'", name,
        )  # fmt: skip
    asked = any(body.get(k) is not None for k in ("max_tokens", "max_completion_tokens"))
    length = f"'max_tokens' {max_tokens}" if asked else f"the default answer length {max_tokens}"
    answer = f"the answer's {gen} positions ({length} in whole blocks of {block})"
    mine = "'steps'" if body.get("steps") is not None else "the server's steps (--steps)"
    if steps is not None and steps > gen:
        raise ApiError(400, f"{mine} {steps} must be <= {answer}: every step commits a token", "steps")
    if steps is not None and steps % (gen // block):
        raise ApiError(400, f"{mine} {steps} must be a multiple of the {gen // block} blocks of {answer}", "steps")
    params = dataclasses.replace(params, gen_length=gen)
    try:
        params.validate()
    except DinferError as e:
        raise ApiError(400, str(e), _field_named(str(e))) from None
    shown = None
    if echo:  # a text prompt is echoed as sent; token ids as their text, special tokens included
        shown = [
            t if t is not None else tokenizer.decode(ids, skip_special_tokens=False) for t, ids in zip(texts, prompts)
        ]
    sub = Submission(
        prompts, params, max_tokens, stream, include_usage, canvas, chat, continuous_usage, shown, provisional
    )
    sub.priority = priority
    return sub


def refuse_misspelt_knobs(body: dict, allowed: set[str]) -> None:
    """Unknown fields are ignored, as OpenAI-compatible servers ignore them, except other stacks'
    names for our fields (``FOREIGN_FIELDS``: ``block_size``, ``num_steps``, ``cache_policy``, ...)
    and a name close to a knob of this server's own (not an OpenAI field): ``treshold`` silently
    decoding with the default threshold is a worse answer than a 400 naming ``threshold``."""
    knobs = set(allowed - OPENAI_FIELDS)
    everything = sorted(allowed)
    unknown = sorted(set(body) - allowed)
    for name in unknown[:MAX_CHECKED_UNKNOWN]:  # a body of 100k junk keys costs no 100k difflib scans
        if not isinstance(name, str) or len(name) > MAX_CHECKED_NAME:
            continue
        if name in FOREIGN_FIELDS:  # another stack's name for one of ours
            ours = FOREIGN_FIELDS[name]
            raise ApiError(
                400,
                f"unknown field '{name}': did you mean '{ours}'? ('{name}' is another inference stack's name; "
                f"this server would ignore it and decode with its default '{ours}')",
                name,
            )
        close = difflib.get_close_matches(name, everything, n=2, cutoff=MISSPELT_CUTOFF)
        if any(c in knobs for c in close):  # every close name, best first: 'stops' is 'stop' or 'steps'
            meant = " or ".join(f"'{c}'" for c in close)
            raise ApiError(
                400,
                f"unknown field {_shown(name)}: did you mean {meant}? (unknown fields are ignored, but this "
                "one looks like a misspelt diffusion knob)",
                name[:SHOWN_CHARS],
            )


MISSPELT_CUTOFF = 0.8  # difflib's similarity ratio from which an unknown field is taken for a knob
MAX_CHECKED_UNKNOWN = 64  # unknown fields checked for a misspelling (the rest are ignored unchecked)
MAX_CHECKED_NAME = 64  # longer unknown names are no misspelt knob


def _stream_options(options: Any, stream: bool) -> tuple[bool, bool]:
    """``stream_options``: (``include_usage``: a last chunk with the usage, ``continuous_usage_stats``:
    usage on every chunk, vLLM's field). Options that ask for something need ``stream``."""
    if options is None:
        return False, False
    keys = ("include_usage", "continuous_usage_stats")
    if not isinstance(options, dict) or set(options) - set(keys):
        raise ApiError(
            400, f"'stream_options' must be an object with only {' / '.join(keys)}, got {_shown(options)}",
            "stream_options",
        )  # fmt: skip
    flags = []
    for key in keys:
        v = options.get(key)
        if v is not None and not isinstance(v, bool):
            raise ApiError(400, f"'stream_options.{key}' must be a boolean, got {_shown(v)}", f"stream_options.{key}")
        flags.append(bool(v))
    if any(flags) and not stream:  # options that ask for nothing are accepted on any request
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    return flags[0], flags[1]


def _logprobs(body: dict, chat: bool, echo: bool) -> int | None:
    """The top alternatives per token a request asks log-probabilities for (None: none). Chat:
    ``logprobs`` a boolean and ``top_logprobs`` in [0, 20] (which needs ``logprobs``: true);
    completions: ``logprobs`` an integer in [0, 5] (OpenAI's legacy API; ``false`` is off) and
    not with ``echo`` (prompt tokens have no log-probability here)."""
    if chat:
        on = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top and not on:
            raise ApiError(400, f"'top_logprobs' {top} needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    if not _neutral(body.get("top_logprobs"), (0,)):
        raise ApiError(
            400, "'top_logprobs' is a /v1/chat/completions field: on /v1/completions 'logprobs' is the number of "
            f"top alternatives per token, an integer in [0, {MAX_COMPLETION_LOGPROBS}]", "top_logprobs",
        )  # fmt: skip
    v = body.get("logprobs")
    if v is None or v is False:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COMPLETION_LOGPROBS:
        raise ApiError(
            400, f"'logprobs' must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] (the top alternatives per "
            f"token) on /v1/completions, got {_shown(v)}", "logprobs",
        )  # fmt: skip
    if echo:
        raise ApiError(
            400, "'echo' with 'logprobs' is not supported: prompt tokens have no log-probability here (only the "
            "answer's tokens, under the forward that made each final)", "logprobs",
        )  # fmt: skip
    return v


def _max_tokens(body: dict, budget: int, why: str = "") -> tuple[str, int | None]:
    """``max_completion_tokens`` (OpenAI's newer name) or ``max_tokens``, on either endpoint: the
    field given and its value, in [1, ``budget``] (``why``: the reason for the bound, told with a
    range error); both given must agree."""
    given = [k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    values = [_int(body, k, 1, budget, why) for k in given]
    if len(given) == 2 and values[0] != values[1]:
        raise ApiError(
            400, f"'max_completion_tokens' {values[0]} and 'max_tokens' {values[1]} disagree: send one of them",
            "max_completion_tokens",
        )  # fmt: skip
    return (given[0], values[0]) if given else ("max_tokens", None)


def _field_named(message: str) -> str | None:
    """The SamplingParams field a validation message starts with (``SamplingParams: threshold ...``)."""
    words = message.removeprefix("SamplingParams: ").replace("unknown ", "").split()
    return words[0] if words and words[0].isidentifier() else None


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of them, got {stop!r}", "stop")
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"'stop' holds {len(stop)} strings; at most {MAX_STOP}", "stop")
    return tuple(stop)


def _too_long(field: str, chars: int, max_len: int, chars_per_token: int | None) -> None:
    """Refuse text that cannot fit ``max_len`` tokens, from its length alone (before tokenising:
    tokenising a huge prompt is the expensive part). A token covers at most ``chars_per_token``
    characters, so ``chars / chars_per_token`` tokens is a lower bound."""
    if chars_per_token and chars > max_len * chars_per_token:
        raise ApiError(
            400,
            f"'{field}' is {chars} characters: at least {-(-chars // chars_per_token)} tokens, past the max model "
            f"length {max_len}",
            field,
        )


def _encode(tokenizer, text: str, field: str) -> list[int]:
    """Tokenise ``text``; text the tokenizer cannot encode is a 400 naming ``field`` and the characters."""
    try:
        return tokenizer.encode(text)
    except TokenizerError as e:  # "prompt 'ab C' has text the tokenizer does not know: [' ', 'C']"
        raise ApiError(400, f"'{field}' {str(e).removeprefix('prompt ')}", field) from None


def _completion_prompts(
    body: dict, tokenizer, max_len: int, chars_per_token: int | None, batch_limit: tuple[int, str] | None = None
) -> tuple[list[list[int]], list[str], list[str | None]]:
    """``prompt``: a string, token ids, or a batch (a list of strings, or of token-id lists; one
    choice each). Returns each prompt's ids, the name its errors carry (``prompt``, in a batch of
    several ``prompt[i]``) and its text as sent (None for ids). ``batch_limit``: (the most
    requests the server can hold at once, why); a bigger batch could never be admitted."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request", "prompt")
        if batch_limit is not None and len(prompt) > 1 and len(prompt) > batch_limit[0]:
            limit, why = batch_limit
            raise ApiError(
                400, f"'prompt' holds {len(prompt)} prompts, but this server holds at most {limit} requests at once "
                f"({why}): the batch could never be admitted; send at most {limit} prompts per request", "prompt",
            )  # fmt: skip
        if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
            raise ApiError(400, "'prompt' mixes strings and token-id lists: send one kind per request", "prompt")
        names = ["prompt"] if len(prompt) == 1 else [f"prompt[{i}]" for i in range(len(prompt))]
        ids = [_one_prompt(p, name, tokenizer, max_len, chars_per_token) for p, name in zip(prompt, names)]
        return ids, names, [p if isinstance(p, str) else None for p in prompt]
    ids = _one_prompt(prompt, "prompt", tokenizer, max_len, chars_per_token)
    return [ids], ["prompt"], [prompt if isinstance(prompt, str) else None]


def _one_prompt(prompt: Any, name: str, tokenizer, max_len: int, chars_per_token: int | None) -> list[int]:
    """One completions prompt, a string or token ids, as ids; errors name ``name``."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ApiError(400, f"'{name}' is empty", name)
        _too_long(name, len(prompt), max_len, chars_per_token)
        return _encode(tokenizer, prompt, name)
    if isinstance(prompt, list) and len(prompt) >= max_len:
        raise ApiError(
            400, f"the prompt is {len(prompt)} tokens; the max model length is {max_len}: no room to generate", name
        )
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ApiError(400, f"'{name}' token {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})", name)
        return list(prompt)
    raise ApiError(
        400, f"'{name}' must be a non-empty string or a list of token ids (or 'prompt' a list of such prompts)", name
    )


def _chat_prompt(body: dict, tokenizer, max_len: int, chars_per_token: int | None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    turns = []
    joined: set[int] = set()  # the messages whose content was several text parts, joined with newlines
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if isinstance(m, dict):
            for key in ("tool_calls", "function_call"):  # an assistant turn that called a tool
                if m.get(key):
                    raise ApiError(
                        400, f"'{where}.{key}': tool calling is not supported by this server", f"{where}.{key}"
                    )
            if m.get("role") in ("tool", "function"):
                raise ApiError(
                    400, f"'{where}.role' {m['role']!r}: tool calling is not supported by this server", f"{where}.role"
                )
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ApiError(400, f"'{where}' must be an object with 'role' and 'content'", where)
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for system
        if role not in ROLES:
            shown = _shown(m["role"])
            raise ApiError(
                400, f"'{where}.role' {shown} must be one of {', '.join(ROLES)} (or developer)", f"{where}.role"
            )
        content = _content_text(m["content"], where)
        if isinstance(m["content"], list) and len(m["content"]) > 1:
            joined.add(i)
        turns.append({"role": role, "content": content})
    if not tokenizer.chat_template:
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
    _too_long("messages", sum(len(t["content"]) for t in turns), max_len, chars_per_token)
    try:
        text = tokenizer.apply_chat_template(turns, **_template_kwargs(body, tokenizer.chat_template))
    except DinferError as e:
        raise ApiError(400, f"the chat template could not render these messages: {e}", "messages") from None
    try:
        return tokenizer.encode(text)
    except TokenizerError:  # name the message whose text it is (the template's own text is the model's)
        for i, t in enumerate(turns):
            try:
                _encode(tokenizer, t["content"], f"messages[{i}].content")
            except ApiError as e:
                if i in joined and "\n" in t["content"] and not _encodes(tokenizer, "\n"):
                    parts = len(messages[i]["content"])
                    e.message += (
                        f" (its {parts} text parts were joined with a newline, as vLLM joins them, and this "
                        "tokenizer has no newline: send the text as one string or one part)"
                    )
                raise
        raise ApiError(400, "the chat template renders text the tokenizer cannot encode", "messages") from None


def _encodes(tokenizer, text: str) -> bool:
    try:
        tokenizer.encode(text)
    except TokenizerError:
        return False
    return True


def _content_text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (``[{"type": "text", "text": ...}]``,
    what the openai client and LangChain send) joined by newlines as vLLM joins them. Any other
    part (an image, audio, a file) is a 400 naming that part: this server reads text only."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                raise ApiError(400, f"'{at}' must be an object {{type: text, text}}, got {_type_name(part)}", at)
            if part.get("type") != "text":
                raise ApiError(
                    400, f"'{at}' is a part of type {_shown(part.get('type'))}: this server reads text only "
                    "(parts of type 'text')", at,
                )  # fmt: skip
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"'{at}.text' must be a string, got {_type_name(part.get('text'))}", f"{at}.text")
            texts.append(part["text"])
        return "\n".join(texts)
    if not isinstance(content, str):
        raise ApiError(
            400, f"'{where}.content' must be a string or a list of text parts, got {_type_name(content)}",
            f"{where}.content",
        )  # fmt: skip
    return content


_RENDERER_SET = ("messages", "add_generation_prompt", "tools", "documents")  # what the server passes itself


def _template_kwargs(body: dict, template: str | None = None) -> dict[str, Any]:
    """``chat_template_kwargs`` (vLLM's field): extra variables for the chat template, e.g.
    ``{"enable_thinking": false}`` for SDAR / Qwen3-style templates. Each key must be a variable
    ``template`` reads (``template_variables``; when it parses), other than those the server sets:
    a key it does not read would change nothing, silently."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ApiError(
            400, f"'chat_template_kwargs' must be an object, got {_type_name(kwargs)}", "chat_template_kwargs"
        )
    reads = template_variables(template) if template else None
    for key in kwargs:
        if not key.isidentifier() or key in _RENDERER_SET:
            raise ApiError(
                400,
                f"'chat_template_kwargs' key {_shown(key)} cannot be set: it must be a name the template reads, "
                "other than messages, add_generation_prompt, tools, documents",
                "chat_template_kwargs",
            )
        if reads is not None and key not in reads:
            shown = ", ".join(sorted(reads - set(_RENDERER_SET))) or "none besides the messages"
            raise ApiError(
                400,
                f"'chat_template_kwargs' key {_shown(key)} is not a variable this model's chat template reads "
                f"(it would change nothing); the template reads: {shown[:400]}",
                "chat_template_kwargs",
            )
    return kwargs


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str] | None:
    """The variables a chat template reads from its context (``jinja2.meta``: every name it uses
    before setting it, ``x is defined`` tests included), without the environment's globals
    (``raise_exception``, ...); None where it does not parse (rendering then says why)."""
    import jinja2
    import jinja2.meta

    from dinfer_rt.tokenizer import _template_environment

    env = _template_environment()
    try:
        names = jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateError:
        return None
    return frozenset(names - set(env.globals))


# ---------------------------------------------------------------- responses


# Response ids from a generator seeded once from the OS: ``uuid4`` reads ``os.urandom`` per call,
# a system call that releases the GIL, and in ``serve`` taking it back waits on the engine
# thread's step (2.2 ms a request of the HTTP thread's wall time at low load, measured).
_IDS = random.Random()
if hasattr(os, "register_at_fork"):  # a forked child draws its own ids, not its parent's sequence
    os.register_at_fork(after_in_child=_IDS.seed)


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{_IDS.getrandbits(96):024x}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _logprob(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf (and nan) are not JSON


def choice_logprobs(
    tok,
    chat: bool,
    ids: list[int],
    lps: list[float],
    tops: list[list[tuple[int, float]]],
    start: int = 0,
    end: int | None = None,
) -> dict:
    """A choice's ``logprobs`` object for its answer tokens ``ids[start:end]`` (a streamed chunk:
    the tokens it carries) with their log-probabilities ``lps`` and top alternatives ``tops``
    (aligned with ``ids``). Chat: ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
    completions (OpenAI's legacy form): ``tokens``, ``token_logprobs``, ``top_logprobs`` (per
    token a dict of the top alternatives and the token itself) and ``text_offset`` (each token's
    character offset in the choice's text). A token's text is its own decoding (special tokens
    included), ``bytes`` the token's raw bytes (``Tokenizer.token_bytes``: a byte token inside a
    multi-byte character decodes alone to U+FFFD, but its bytes are the character's own, so a
    client can join them back into it, as OpenAI's ``bytes`` are meant for)."""
    end = len(ids) if end is None else end

    def text(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False)

    def raw(t: int) -> list[int]:
        return list(tok.token_bytes(t))

    span = range(start, end)
    if chat:
        content = []
        for i in span:
            alts = [{"token": text(t), "logprob": _logprob(v), "bytes": raw(t)} for t, v in tops[i]]
            t = ids[i]
            content.append({"token": text(t), "logprob": _logprob(lps[i]), "bytes": raw(t), "top_logprobs": alts})
        return {"content": content}
    tokens = [text(ids[i]) for i in span]
    top = []
    for i, s in zip(span, tokens):
        alts = {text(t): _logprob(v) for t, v in tops[i]}
        alts.setdefault(s, _logprob(lps[i]))  # the chosen token always (up to logprobs + 1 entries)
        top.append(alts)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(lps[i]) for i in span],
        "top_logprobs": top,
        "text_offset": [len(tok.decode(ids[:i])) for i in span],
    }


def response(
    rid: str, model: str, chat: bool, answers: list[tuple[str, str]], use: dict, logprobs: list[dict] | None = None
) -> dict:
    """The whole answer: one choice per ``(text, finish_reason)`` (several for a completions batch);
    ``logprobs``: each choice's (:func:`choice_logprobs`), when asked."""
    created = int(time.time())
    lp = logprobs or [None] * len(answers)
    if chat:
        choices = [
            {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason, "logprobs": lp[i]}
            for i, (text, reason) in enumerate(answers)
        ]
        kind = "chat.completion"
    else:
        choices = [
            {"index": i, "text": text, "finish_reason": reason, "logprobs": lp[i]}
            for i, (text, reason) in enumerate(answers)
        ]
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, "usage": use}


def chunk(
    rid: str,
    model: str,
    chat: bool,
    text: str | None,
    finish_reason: str | None,
    *,
    index: int = 0,
    use: dict | None = None,
    logprobs: dict | None = None,
    **extra,
) -> dict:
    """One streamed chunk of choice ``index``; ``text`` None with chat is the opening chunk (the
    assistant role); ``use``: the usage so far (``continuous_usage_stats``); ``logprobs``: those
    of the tokens this chunk carries (:func:`choice_logprobs`), when asked."""
    created = int(time.time())
    if chat:
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs, **extra}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs, **extra}
        kind = "text_completion"
    out = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
    if use is not None:
        out["usage"] = use
    return out


def usage_chunk(rid: str, model: str, chat: bool, use: dict) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [], "usage": use}
