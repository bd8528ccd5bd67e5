"""OpenAI request bodies -> engine submissions, and engine results -> OpenAI response objects.

Every field is checked before any compute; a bad one is an :class:`ApiError` (HTTP 400) whose
message and ``param`` name the field and the allowed values. Diffusion knobs ride as extra body
fields with the CLI's names (``strategy``, ``threshold``, ``cache``, ``block_length``, ...) and
the server's defaults. ``max_tokens`` is rounded up to whole blocks for decoding and the output
cut to it.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from dinfer_rt.errors import DinferError, TokenizerError
from dinfer_rt.sampling import MAX_STOP, SamplingParams
from dinfer_rt.tokenizer import refuse_mask_token


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


# Diffusion knobs accepted as extra body fields: SamplingParams names (the CLI's, with dashes).
DIFFUSION_FIELDS = (
    "strategy threshold factor low_threshold credit_decay credit_boost credit_alpha cache block_length steps "
    "vicinity_before vicinity_after vicinity_warmup refresh_bound refresh_window confidence_head sync_every"
).split()
# OpenAI fields that are accepted only at a neutral value (anything else would be ignored silently):
# null, or one of the values clients send by default.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
}
SHOWN_CHARS = 80  # an error echoes at most this much of a client's value
_COMMON = {"model", "max_tokens", "temperature", "seed", "stop", "stream", "stream_options", "n", "user"}
_COMMON |= {"return_canvas", *DIFFUSION_FIELDS, *_NEUTRAL}
_COMMON |= {"allow_mask_in_prompt"}  # infilling on purpose: the prompt may hold the mask token
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs"}
ROLES = ("system", "user", "assistant")


@dataclass
class Submission:
    """A validated request: what the engine needs plus how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stream: bool
    include_usage: bool
    return_canvas: bool
    chat: bool


def _type_name(v: Any) -> str:
    return type(v).__name__


def _shown(v: Any) -> str:
    """``repr(v)`` cut to SHOWN_CHARS characters (an error does not echo a huge value in full)."""
    text = repr(v)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


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


def _int(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer, got {_type_name(v)} {_shown(v)}", name)
    if v < low or (high is not None and v > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ApiError(400, f"'{name}' must be {span}, got {v}", name)
    return v


def _bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {_type_name(v)} {_shown(v)}", name)
    return v


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
) -> Submission:
    """Validate an OpenAI completions / chat-completions body (``chat``) against the served model.

    ``chars_per_token``: the most characters one token of the tokenizer covers; when given, a text
    prompt longer than ``max_len`` tokens could hold is refused before it is tokenised. ``mask_id``:
    the model's mask token, refused in the prompt unless ``allow_mask_in_prompt`` is true."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        name = _shown(unknown[0])
        raise ApiError(400, f"unknown field {name}; accepted: {', '.join(sorted(allowed))}", unknown[0][:SHOWN_CHARS])
    for name, neutral in _NEUTRAL.items():
        if name in body and not _neutral(body[name], neutral):
            only = " or ".join(repr(v) for v in (None, *neutral))
            raise ApiError(400, f"'{name}' {_shown(body[name])} is not supported by this server (only {only})", name)
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404, f"model {_shown(model)} does not exist; this server serves '{model_name}'", "model", "not_found"
        )
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise ApiError(400, f"'n' must be 1 (one choice per request), got {n}", "n")
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ApiError(400, "'stream_options' must be an object with only 'include_usage'", "stream_options")
    if options and not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    include_usage = bool(options and options.get("include_usage"))
    if include_usage and not stream:  # without include_usage the options ask for nothing: accepted
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    canvas = bool(_bool(body, "return_canvas"))
    if canvas and not stream:
        raise ApiError(400, "'return_canvas' streams the canvas each step: it needs 'stream': true", "return_canvas")

    if tokenizer is None:
        raise ApiError(400, "this model was loaded without a tokenizer: text requests cannot be served")
    ids = (
        _chat_prompt(body, tokenizer, max_len, chars_per_token)
        if chat
        else _completion_prompt(body, tokenizer, max_len, chars_per_token)
    )
    where = "messages" if chat else "prompt"
    try:
        refuse_mask_token(ids, mask_id, f"'{where}'", bool(_bool(body, "allow_mask_in_prompt")))
    except DinferError as e:
        raise ApiError(400, str(e), where) from None

    fields: dict[str, Any] = {}
    for name in DIFFUSION_FIELDS:
        if body.get(name) is not None:
            fields[name] = body[name]
    if body.get("temperature") is not None:
        t = body["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 or t > 2:
            raise ApiError(400, f"'temperature' must be a number in [0, 2], got {t!r}", "temperature")
        fields["temperature"] = float(t)
    seed = _int(body, "seed", 0, 2**63 - 1)
    if seed is not None:
        fields["seed"] = seed
    fields["stop"] = _stop(body.get("stop"))
    params = dataclasses.replace(defaults, **fields, chat=False)
    block = params.block_length
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ApiError(400, f"'block_length' must be an integer >= 1, got {block!r}", "block_length")
    budget = max_len - len(ids)
    if budget < 1:
        raise ApiError(
            400, f"the prompt is {len(ids)} tokens; the max model length is {max_len}: no room to generate", "prompt"
        )
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, 1, budget)
    if max_tokens is None:
        max_tokens = min(defaults.gen_length, budget)
    gen = -(-max_tokens // block) * block
    if len(ids) + gen > max_len:
        raise ApiError(
            400,
            f"'{key}' {max_tokens} rounds up to {gen} tokens (whole blocks of {block}); with the prompt's "
            f"{len(ids)} tokens that exceeds the max model length {max_len}",
            key,
        )
    steps = params.steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ApiError(400, f"'steps' must be an integer >= 1, got {steps!r}", "steps")
    params = dataclasses.replace(params, gen_length=gen)
    try:
        params.validate()
    except DinferError as e:
        raise ApiError(400, str(e), _field_named(str(e))) from None
    return Submission(ids, params, max_tokens, stream, include_usage, canvas, chat)


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


def _completion_prompt(body: dict, tokenizer, max_len: int, chars_per_token: int | None) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ApiError(400, "'prompt' is empty", "prompt")
        _too_long("prompt", len(prompt), max_len, chars_per_token)
        return _encode(tokenizer, prompt, "prompt")
    if isinstance(prompt, list) and len(prompt) >= max_len:
        raise ApiError(
            400, f"the prompt is {len(prompt)} tokens; the max model length is {max_len}: no room to generate", "prompt"
        )
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ApiError(
                400, f"'prompt' token {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})", "prompt"
            )
        return list(prompt)
    raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def _chat_prompt(body: dict, tokenizer, max_len: int, chars_per_token: int | None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ApiError(400, f"'{where}' must be an object with 'role' and 'content'", where)
        if m["role"] not in ROLES:
            role = _shown(m["role"])
            raise ApiError(400, f"'{where}.role' {role} must be one of {', '.join(ROLES)}", f"{where}.role")
        content = m["content"]
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ApiError(400, f"'{where}.content' parts must be {{type: text, text}} objects", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"'{where}.content' must be a string, got {_type_name(content)}", f"{where}.content")
        turns.append({"role": m["role"], "content": content})
    if not tokenizer.chat_template:
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
    _too_long("messages", sum(len(t["content"]) for t in turns), max_len, chars_per_token)
    try:
        text = tokenizer.apply_chat_template(turns, **_template_kwargs(body))
    except DinferError as e:
        raise ApiError(400, f"the chat template could not render these messages: {e}", "messages") from None
    try:
        return tokenizer.encode(text)
    except TokenizerError:  # name the message whose text it is (the template's own text is the model's)
        for i, t in enumerate(turns):
            _encode(tokenizer, t["content"], f"messages[{i}].content")
        raise ApiError(400, "the chat template renders text the tokenizer cannot encode", "messages") from None


def _template_kwargs(body: dict) -> dict[str, Any]:
    """``chat_template_kwargs`` (vLLM's field): extra variables for the chat template, e.g.
    ``{"enable_thinking": false}`` for SDAR / Qwen3-style templates."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ApiError(
            400, f"'chat_template_kwargs' must be an object, got {_type_name(kwargs)}", "chat_template_kwargs"
        )
    for key in kwargs:
        if not key.isidentifier() or key in ("messages", "add_generation_prompt", "tools", "documents"):
            raise ApiError(
                400,
                f"'chat_template_kwargs' key {_shown(key)} cannot be set: it must be a name the template reads, "
                "other than messages, add_generation_prompt, tools, documents",
                "chat_template_kwargs",
            )
    return kwargs


# ---------------------------------------------------------------- responses


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(rid: str, model: str, chat: bool, text: str, finish_reason: str, use: dict) -> dict:
    created = int(time.time())
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": use,
        }
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chunk(rid: str, model: str, chat: bool, text: str | None, finish_reason: str | None, **extra) -> dict:
    """One streamed chunk; ``text`` None with chat is the opening chunk (the assistant role)."""
    created = int(time.time())
    if chat:
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, **extra}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None, **extra}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, chat: bool, use: dict) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [], "usage": use}
