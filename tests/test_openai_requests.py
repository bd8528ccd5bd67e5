"""The requests real clients send (issue #40, point 3), against one real ``dinfer-rt serve``
process driven by the official ``openai`` client (raw HTTP only where the client would not send
the body).

The core is a table: every accepted spelling of a request (content parts, token-id prompts, a
batch of prompts, ``max_completion_tokens``, ``stop`` as a string, ``seed`` / ``user`` / fields the
server ignores, ``echo``, neutral values) must be answered exactly as its canonical spelling is;
every refused one is a 400 whose ``param`` and message name the field. Around it: streaming usage
(``include_usage``, ``continuous_usage_stats``) for a batch, a seeded sampled answer against
``LLM.generate``, and the small endpoints (``/v1/models/{id}``, ``/version``, ``/ping``)."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

import dinfer_rt
from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing.serving import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
MODEL = "dinfer-rt-embedded"
P1 = "<|startoftext|>qwertyuiop="  # raw completions prompts (the embedded task: letters then "=")
P2 = "<|startoftext|>zxcvbnm="
LETTERS = "plmoknijbu"


@pytest.fixture(scope="module")
def server():
    """One server for the whole module (bounded: it exits by itself after 300 s)."""
    s = ServerProcess(
        "--strategy", "threshold", "--block-length", "8", "--max-num-seqs", "8", "--max-queue", "16",
        "--body-timeout", "2", cwd=ROOT,
    )  # fmt: skip
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline():
    return LLM()


def _ids(offline: LLM, text: str) -> list[int]:
    return offline.model.tokenizer.encode(text)


def _chat(content, *before: dict) -> dict:
    return {"messages": [*before, {"role": "user", "content": content}]}


def _create(server, chat: bool, body: dict, **options):
    """Send ``body`` through the official client: the fields its ``create`` names as arguments,
    the rest in ``extra_body`` (as a user passes diffusion knobs)."""
    create = server.client.chat.completions.create if chat else server.client.completions.create
    named = set(inspect.signature(create).parameters)
    kwargs = {k: v for k, v in body.items() if k in named}
    extra = {k: v for k, v in body.items() if k not in named}
    return create(model=MODEL, **kwargs, extra_body=extra or None, **options)


def _answer(reply, chat: bool) -> tuple[list[tuple[str, str]], tuple[int, int]]:
    """What a reply says: (text, finish_reason) per choice in order, and the usage."""
    texts = [(c.message.content if chat else c.text, c.finish_reason) for c in reply.choices]
    assert [c.index for c in reply.choices] == list(range(len(texts)))
    return texts, (reply.usage.prompt_tokens, reply.usage.completion_tokens)


@dataclass
class Same:
    """An accepted spelling (``body``) and its canonical one(s): a list of canonical bodies is a
    batch, answered as each of them alone, in order. ``echo``: the texts the variant puts first."""

    id: str
    chat: bool
    body: dict
    canonical: dict | list[dict]
    echo: list[str] = field(default_factory=list)


def accepted(offline: LLM) -> list[Same]:
    ids1, ids2 = _ids(offline, P1), _ids(offline, P2)
    plain = {"prompt": P1}
    chat = _chat(LETTERS)
    return [
        Same("content-one-text-part", True, _chat([{"type": "text", "text": LETTERS}]), chat),
        Same("content-text-parts-split", True,
             _chat([{"type": "text", "text": "ab"}], {"role": "system", "content": [{"type": "text", "text": "cd"}]}),
             _chat("ab", {"role": "system", "content": "cd"})),
        Same("developer-role-is-system", True, _chat("ab", {"role": "developer", "content": "cd"}),
             _chat("ab", {"role": "system", "content": "cd"})),
        Same("prompt-token-ids", False, {"prompt": ids1}, plain),
        Same("prompt-one-string-list", False, {"prompt": [P1]}, plain),
        Same("prompt-batch-of-strings", False, {"prompt": [P1, P2]}, [plain, {"prompt": P2}]),
        Same("prompt-batch-of-token-ids", False, {"prompt": [ids2, ids1], "max_tokens": 16},
             [{"prompt": P2, "max_tokens": 16}, {"prompt": P1, "max_tokens": 16}]),
        Same("max-completion-tokens-completions", False, {"prompt": P1, "max_completion_tokens": 12},
             {"prompt": P1, "max_tokens": 12}),
        Same("max-completion-tokens-chat", True, {**chat, "max_completion_tokens": 12}, {**chat, "max_tokens": 12}),
        Same("both-max-fields-agreeing", True, {**chat, "max_completion_tokens": 12, "max_tokens": 12},
             {**chat, "max_tokens": 12}),
        Same("stop-string", False, {"prompt": P1, "stop": "|"}, {"prompt": P1, "stop": ["|"]}),
        Same("seed-greedy", False, {"prompt": P1, "seed": 1234}, plain),
        Same("user", True, {**chat, "user": "alice@example.com"}, chat),
        Same("n-1", False, {"prompt": P1, "n": 1}, plain),
        Same("response-format-text", True, {**chat, "response_format": {"type": "text"}}, chat),
        Same("no-tools", True, {**chat, "tools": [], "tool_choice": "auto", "parallel_tool_calls": False}, chat),
        Same("logprobs-off", True, {**chat, "logprobs": False, "top_logprobs": 0}, chat),
        Same("logprobs-null", False, {"prompt": P1, "logprobs": None}, plain),
        Same("fields-real-clients-send", True,
             {**chat, "metadata": {"run": "7"}, "store": False, "service_tier": "auto", "frobnicate": 1,
              "stream_options": {"include_usage": False}}, chat),
        Same("vllm-extras-neutral", False, {"prompt": P1, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0},
             plain),
        Same("vllm-stop-token-ids-of-the-model", False,
             {"prompt": P1, "stop_token_ids": sorted(offline.model.eos_ids)}, plain),
        Same("echo-off", False, {"prompt": P1, "echo": False}, plain),
        Same("echo-text", False, {"prompt": P1, "echo": True}, plain, echo=[P1]),
        Same("echo-token-id-batch", False, {"prompt": [ids1, ids2], "echo": True, "max_tokens": 8},
             [{"prompt": P1, "max_tokens": 8}, {"prompt": P2, "max_tokens": 8}], echo=[P1, P2]),
    ]  # fmt: skip


def test_each_accepted_form_is_answered_as_its_canonical_form(server, offline):
    cases = accepted(offline)
    for case in cases:
        got, got_usage = _answer(_create(server, case.chat, case.body), case.chat)
        want, prompt_tokens, completion_tokens = [], 0, 0
        for body in case.canonical if isinstance(case.canonical, list) else [case.canonical]:
            texts, (p, c) = _answer(_create(server, case.chat, body), case.chat)
            want += texts
            prompt_tokens, completion_tokens = prompt_tokens + p, completion_tokens + c
        if case.echo:
            want = [(shown + text, reason) for shown, (text, reason) in zip(case.echo, want)]
        assert got == want, case.id
        assert got_usage == (prompt_tokens, completion_tokens), case.id
        assert all(text for text, _ in got), case.id  # an answer, not an empty choice
    stopped = next(c for c in cases if c.id == "stop-string")
    reply = _create(server, False, stopped.body)
    assert reply.choices[0].finish_reason == "stop" and "|" not in reply.choices[0].text  # the stop was met


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}

# (id, chat, body, param, a fragment of the message)
REFUSED = [
    ("image-part", True, _chat([{"type": "text", "text": "ab"}, {"type": "image_url", "image_url": {"url": "x"}}]),
     "messages[0].content[1]", "type 'image_url'"),
    ("audio-part-in-system", True, _chat("ab", {"role": "system", "content": [{"type": "input_audio"}]}),
     "messages[0].content[0]", "type 'input_audio'"),
    ("part-not-an-object", True, _chat(["ab"]), "messages[0].content[0]", "must be an object"),
    ("part-text-not-a-string", True, _chat([{"type": "text", "text": 5}]), "messages[0].content[0].text",
     "must be a string"),
    ("tools", True, {**_chat("ab"), "tools": [TOOL]}, "tools", "tool calling is not supported"),
    ("tool-choice-required", True, {**_chat("ab"), "tool_choice": "required"}, "tool_choice",
     "tool calling is not supported"),
    ("legacy-functions", True, {**_chat("ab"), "functions": [TOOL["function"]]}, "functions",
     "tool calling is not supported"),
    ("assistant-tool-calls", True, {"messages": [{"role": "user", "content": "ab"},
     {"role": "assistant", "content": None, "tool_calls": [CALL]}]}, "messages[1].tool_calls",
     "tool calling is not supported"),
    ("tool-role", True, _chat("ab", {"role": "tool", "content": "x", "tool_call_id": "c1"}), "messages[0].role",
     "tool calling is not supported"),
    ("response-format-json-object", True, {**_chat("ab"), "response_format": {"type": "json_object"}},
     "response_format", "structured (JSON) output is not supported"),
    ("response-format-json-schema", True,
     {**_chat("ab"), "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format", "only None or {'type': 'text'}"),
    ("chat-logprobs-not-bool", True, {**_chat("ab"), "logprobs": 2}, "logprobs", "must be a boolean"),
    ("chat-top-logprobs-alone", True, {**_chat("ab"), "top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
    ("completions-logprobs-6", False, {"prompt": P1, "logprobs": 6}, "logprobs", "an integer in [0, 5]"),
    ("completions-logprobs-echo", False, {"prompt": P1, "logprobs": 0, "echo": True}, "logprobs",
     "'echo' with 'logprobs'"),
    ("chat-echo", True, {**_chat("ab"), "echo": True}, "echo", "a /v1/completions field"),
    ("echo-not-bool", False, {"prompt": P1, "echo": "yes"}, "echo", "must be a boolean"),
    ("misspelt-threshold", False, {"prompt": P1, "treshold": 0.5}, "treshold", "did you mean 'threshold'"),
    ("misspelt-block-length", False, {"prompt": P1, "block_len": 8}, "block_len", "did you mean 'block_length'"),
    ("misspelt-strategy", True, {**_chat("ab"), "stratgy": "entropy"}, "stratgy", "did you mean 'strategy'"),
    ("misspelt-canvas", False, {"prompt": P1, "return_canvass": True}, "return_canvass",
     "did you mean 'return_canvas'"),
    ("max-fields-disagree", True, {**_chat("ab"), "max_tokens": 8, "max_completion_tokens": 16},
     "max_completion_tokens", "disagree"),
    ("max-completion-tokens-0", False, {"prompt": P1, "max_completion_tokens": 0}, "max_completion_tokens",
     "must be in [1,"),
    ("continuous-usage-not-bool", False,
     {"prompt": P1, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats", "must be a boolean"),
    ("continuous-usage-without-stream", False, {"prompt": P1, "stream_options": {"continuous_usage_stats": True}},
     "stream_options", "only allowed with 'stream': true"),
    ("stream-options-unknown-key", False, {"prompt": P1, "stream": True, "stream_options": {"usage": True}},
     "stream_options", "include_usage / continuous_usage_stats"),
    ("batch-mixing-kinds", False, {"prompt": [P1, [1, 7]]}, "prompt", "mixes strings and token-id lists"),
    ("batch-empty-prompt", False, {"prompt": [P1, " "]}, "prompt[1]", "'prompt[1]' is empty"),
    ("batch-token-outside-vocabulary", False, {"prompt": [[1, 7], [1, 99]]}, "prompt[1]",
     "token 99 is outside the vocabulary"),
    ("batch-untokenisable", False, {"prompt": [P1, "ab C"]}, "prompt[1]", "the tokenizer does not know"),
    ("batch-too-many", False, {"prompt": ["ab"] * 257}, "prompt", "at most 256"),
    ("batch-long-prompt-leaves-no-room", False, {"prompt": [[1, 7], [7] * 60], "max_tokens": 8}, "prompt[1]",
     "the prompt is 60 tokens; the max model length 64 leaves 4, less than one block of 8"),
    ("user-not-a-string", True, {**_chat("ab"), "user": 5}, "user", "must be a string"),
    ("n-2", False, {"prompt": P1, "n": 2}, "n", "must be 1"),
    ("vllm-top-k", False, {"prompt": P1, "top_k": 5}, "top_k", "not supported by this server"),
    ("stop-too-many", False, {"prompt": P1, "stop": ["x"] * 17}, "stop", "at most 16"),
    ("stop-not-strings", False, {"prompt": P1, "stop": [1]}, "stop", "non-empty string"),
    ("server-setting-cfg-scale", False, {"prompt": P1, "cfg_scale": 2.0}, "cfg_scale", "(--cfg-scale)"),
    ("server-setting-gen-length", True, {**_chat("ab"), "gen_length": 16}, "gen_length", "'max_tokens'"),
    # vLLM extras and OpenAI outputs no decoder here honours (they were ignored; from a server probe)
    ("vllm-stop-token-ids", False, {"prompt": P1, "stop_token_ids": [24]}, "stop_token_ids",
     "not supported by this server (only None or [])"),
    ("vllm-skip-special-tokens-off", False, {"prompt": P1, "skip_special_tokens": False}, "skip_special_tokens",
     "not supported by this server"),
    ("vllm-guided-regex", False, {"prompt": P1, "guided_regex": "a+"}, "guided_regex",
     "constrained (guided) decoding is not supported"),
    ("vllm-prompt-logprobs", False, {"prompt": P1, "prompt_logprobs": 1}, "prompt_logprobs", "(only None)"),
    ("chat-audio-out", True, {**_chat("ab"), "modalities": ["text", "audio"]}, "modalities",
     "this server answers text only"),
    ("misspelt-stop", False, {"prompt": P1, "stops": ["r"]}, "stops", "did you mean 'stop' or 'steps'?"),
    ("knob-unread-by-the-rule", False, {"prompt": P1, "edit_threshold": 0.5}, "edit_threshold",
     "applies to 'strategy' joint_threshold (this request: 'threshold', the server's default)"),
    ("knob-unread-by-the-cache", False, {"prompt": P1, "cache": "none", "vicinity_before": 2}, "vicinity_before",
     "applies to 'cache' vicinity (this request: 'none', this request's)"),
    ("credit-knob-unread", False, {"prompt": P1, "credit_alpha": 0.5}, "credit_alpha",
     "applies to 'strategy' credit (this request: 'threshold', the server's default)"),
    ("steps-past-the-answer", False, {"prompt": P1, "max_tokens": 32, "steps": 41, "strategy": "low_confidence"},
     "steps",
     "must be <= the answer's 32 positions ('max_tokens' 32 in whole blocks of 8)"),
    ("huge-value-echo-capped", False, {"prompt": P1, "temperature": list(range(100000))}, "temperature",
     "'temperature' must be a number in [0, 2], got list [0, 1, 2,"),
]  # fmt: skip


def test_every_sampling_field_is_a_request_field_or_refused_by_name():
    """A SamplingParams field a request cannot set would otherwise be ignored as an unknown field
    (a different answer than the client asked for, silently): each one is a request field, is
    refused as an engine or server setting, or is spelt as an OpenAI field (``stop``, ``seed``)."""
    import dataclasses

    from dinfer_rt import openai_protocol as proto

    kw = dict(tokenizer=LLM().tokenizer, defaults=SamplingParams(), model_name=MODEL, max_len=64)
    for f in dataclasses.fields(SamplingParams):
        if f.name in proto.COMPLETION_FIELDS:
            continue
        assert f.name in proto.SERVER_SAMPLING_FIELDS or f.name in proto.ENGINE_FIELDS, f.name
        with pytest.raises(proto.ApiError) as err:
            proto.parse({"prompt": P1, f.name: getattr(SamplingParams(), f.name)}, chat=False, **kw)
        assert (err.value.status, err.value.param) == (400, f.name), err.value.message


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_each_refused_form_is_a_400_naming_the_field(server, case):
    _, chat, body, param, fragment = case
    r = httpx.post(f"{server.url}/v1/{'chat/completions' if chat else 'completions'}", json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == 400, err
    assert err["param"] == param and fragment in err["message"], err
    assert len(err["message"]) < 600 and "\n" not in err["message"], err


def test_the_openai_client_sees_tools_and_logprobs_refused_by_name(server):
    """What a user of the client sees: a BadRequestError that says what is not supported."""
    with pytest.raises(openai.BadRequestError, match="tool calling is not supported") as e:
        server.client.chat.completions.create(model=MODEL, messages=_chat("ab")["messages"], tools=[TOOL])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="must be in \\[0, 20\\]") as e:
        server.client.chat.completions.create(
            model=MODEL, messages=_chat("ab")["messages"], logprobs=True, top_logprobs=21
        )
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError, match="did you mean 'threshold'"):
        server.client.completions.create(model=MODEL, prompt=P1, extra_body={"thresold": 0.5})


def test_a_streamed_batch_with_usage_on_every_chunk(server, offline):
    """A batch of two prompts streamed with echo, include_usage and continuous_usage_stats: each
    choice's chunks concatenate to its non-streamed answer (echo first); every chunk carries its
    choice's usage, its completion tokens never going down and ending at the answer's; the last
    chunk's usage sums the batch."""
    prompts = [_ids(offline, P1), _ids(offline, P2)]  # token ids: echo decodes them
    whole = _create(server, False, {"prompt": prompts, "echo": True, "stop": "|"})
    stream = _create(
        server, False, {"prompt": prompts, "echo": True, "stop": "|"}, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    texts, counts, last_usage, finish = ["", ""], [[], []], None, [None, None]
    for ch in stream:
        assert ch.usage is not None  # continuous: every chunk
        if not ch.choices:
            last_usage = ch.usage
            continue
        (c,) = ch.choices
        texts[c.index] += c.text
        counts[c.index].append(ch.usage.completion_tokens)
        assert ch.usage.prompt_tokens == len(_ids(offline, P1 if c.index == 0 else P2))
        finish[c.index] = finish[c.index] or c.finish_reason
    assert texts == [c.text for c in whole.choices] and texts[0].startswith(P1) and texts[1].startswith(P2)
    assert finish == [c.finish_reason for c in whole.choices]
    single = [_create(server, False, {"prompt": p, "stop": "|"}).usage.completion_tokens for p in (P1, P2)]
    for i in range(2):
        assert counts[i] == sorted(counts[i]) and counts[i][0] == 0 and counts[i][-1] == single[i], counts[i]
    assert last_usage.completion_tokens == whole.usage.completion_tokens == sum(single)
    assert last_usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_with_continuous_usage_and_content_parts(server):
    parts = [{"type": "text", "text": LETTERS}]
    whole = _create(server, True, _chat(parts))
    stream = _create(
        server, True, _chat(parts), stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usages = [c.usage.completion_tokens for c in chunks if c.choices]
    assert usages == sorted(usages) and usages[-1] == whole.usage.completion_tokens
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens and not chunks[-1].choices


def test_seed_makes_a_sampled_answer_reproducible_and_equal_to_offline(server, offline):
    """temperature 1 with a seed: the same answer each time, LLM.generate's answer for that seed,
    and (over a few seeds) not one fixed answer whatever the seed."""
    body = {**_chat(LETTERS), "temperature": 1.0, "max_tokens": 16}
    answers = {}
    for seed in (1, 2, 3):
        first = _create(server, True, {**body, "seed": seed}).choices[0].message.content
        again = _create(server, True, {**body, "seed": seed}).choices[0].message.content
        params = SamplingParams(strategy="threshold", block_length=8, gen_length=16, temperature=1.0, seed=seed)
        assert first == again == offline.generate([LETTERS], params)[0].text, seed
        answers[seed] = first
    assert len(set(answers.values())) > 1, answers


def test_model_card_version_and_ping(server):
    listed = server.client.models.list().data
    card = server.client.models.retrieve(MODEL)
    assert [m.id for m in listed] == [card.id] == [MODEL] and card.owned_by == "dinfer-rt"
    with pytest.raises(openai.NotFoundError) as e:
        server.client.models.retrieve("org/other-model")
    assert e.value.body["param"] == "model" and "'org/other-model' does not exist" in e.value.body["message"]
    assert httpx.get(server.url + "/version").json() == {"version": dinfer_rt.__version__}
    for method in ("GET", "POST"):
        r = httpx.request(method, server.url + "/ping")
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text


def test_a_batch_that_can_never_fit_is_a_400_that_submits_nothing(server):
    """A batch of 40 prompts can never fit 8 rows and a queue of 16 (the server holds 24 requests
    at once): a 400 naming ``prompt`` and the limit, checked before anything is queued (nothing
    running or waiting, no abort counted); the server then answers as before."""
    aborted = server.metric('dinfer_requests_total{finish_reason="abort"}')
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [P1] * 40, "max_tokens": 8}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt", err
    assert "holds 40 prompts, but this server holds at most 24 requests at once" in err["message"], err
    assert "(8 KV pool rows + max_queue 16)" in err["message"], err
    health = httpx.get(server.url + "/health").json()
    assert health["running"] == health["waiting"] == 0, health
    assert server.metric('dinfer_requests_total{finish_reason="abort"}') == aborted
    assert _create(server, False, {"prompt": P1}).choices[0].text


def test_a_body_that_stops_arriving_is_a_408_and_the_server_goes_on(server):
    """A Content-Length promising more than the client sends: without a bound the request hung
    for good (a server probe held 50 such connections open). Here a 408 after --body-timeout
    (2 s), the connection closed, and the next request answered."""
    import socket

    body = b'{"prompt": "abc", "max_tokens": 8}'
    for sent in (body, b""):  # part of the body; headers and nothing
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            s.sendall(head + b"Content-Length: %d\r\n\r\n" % (len(body) + 10) + sent)
            answer = b""
            while chunk := s.recv(65536):  # until the server closes: the 408 says so
                answer += chunk
        status, _, rest = answer.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 408"), answer
        assert b"connection: close" in rest.lower(), answer
        err = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
        assert f"{len(sent)} bytes came, then nothing for 2 s (--body-timeout" in err["message"], err
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": P1, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text


def test_an_error_message_is_never_megabytes():
    """Every check echoes at most ``SHOWN_CHARS`` of a client's value; as a backstop for one that
    does not (a 100k-entry list came back as a 3 MB message), ``ApiError`` cuts its message."""
    from dinfer_rt.openai_protocol import MAX_MESSAGE_CHARS, ApiError

    e = ApiError(400, "x" * 100_000, "strategy")
    assert e.message == "x" * MAX_MESSAGE_CHARS + "... (100000 characters in all)"
    assert e.body()["error"]["message"] == e.message
    assert ApiError(400, "short").message == "short"
