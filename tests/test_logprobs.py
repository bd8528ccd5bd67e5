"""``logprobs`` (issue #40, point 3): each final token's log-probability under the forward that
made it final (the forward that committed it; with an editing rule, the forward of its last
write), recorded by the decode state only for cohorts that ask.

In-process: the recorded values equal a float64 log-softmax of ``Model.forward``'s logits over
the sequence as it stood before that forward (every family's layout: Dream's shifted logits, a
block-causal first block inside the prompt, an editing rule, sampling); a prompt's log-probs are
the same alone, in a static batch and served beside another request. Served: a real
``dinfer-rt serve`` driven by the official ``openai`` client, completions (OpenAI's legacy form)
and chat, streamed chunks covering exactly the tokens they carry, a batch's choices each their
own, out-of-range values a 400 naming the field."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import openai
import pytest
import torch

import dinfer_rt
from dinfer_rt.decode import Cohort, uses_confidence_head
from dinfer_rt.engine import Engine, run_batch
from dinfer_rt.errors import GenerationError
from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing.serving import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
MODEL = "dinfer-rt-embedded"
P1 = "<|startoftext|>qwertyuiop="  # raw completions prompts (the embedded task: letters then "=")
P2 = "<|startoftext|>zxcvbnm="
LETTERS = "plmoknijbu"
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def offline():
    return LLM()


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"strategy": "threshold", "block_length": 8, "chat": False, **kw})


# ---------------------------------------------------------------- in-process


def _recompute(model, steps, n_final: int, k: int):
    """Per generated slot, the float64 log-softmax (mask token excluded) of ``Model.forward`` over
    the sequence before the last forward that wrote it, at the written token, and the top-k ids."""
    want: dict[int, tuple[float, list[int]]] = {}
    for before, after, p_len, block_size in steps:
        changed = (after[0, p_len:] != before[0, p_len:]).nonzero().flatten().tolist()
        if not changed:
            continue
        logits = model.forward(before, block_size=block_size)[0].double()
        logits[:, model.mask_id] = float("-inf")
        lp = logits.log_softmax(-1)
        for j in changed:
            row = lp[p_len + j]
            want[j] = (float(row[after[0, p_len + j]]), row.topk(k).indices.tolist())
    return [want[j] for j in range(n_final)]


CASES = [
    ("embedded", dict(strategy="threshold", block_length=8)),
    ("embedded", dict(strategy="low_confidence", block_length=8, temperature=0.8, seed=3)),
    ("dream", dict(strategy="low_confidence", block_length=4, gen_length=8)),
    ("llada2", dict(strategy="threshold", threshold=0.5, gen_length=8)),
    ("llada2", dict(strategy="joint_threshold", threshold=0.5, edit_threshold=0.0, gen_length=8, max_post_steps=2)),
]


@pytest.mark.parametrize("name,knobs", CASES, ids=[f"{n}-{k['strategy']}" for n, k in CASES])
def test_logprobs_equal_a_float64_recompute_of_the_forward_that_made_each_token_final(
    ckpt_dir, offline, monkeypatch, name, knobs
):
    model = offline.model if name == "embedded" else dinfer_rt.load_model(ckpt_dir(name), backend="cpu")
    prompt = model.tokenizer.encode(P1) if name == "embedded" else [5, 9, 2, 7, 11, 4]
    steps = []
    decide = Cohort.decide

    def spy(self, out):  # the sequence before and after each decision (cache "none": forward = Model.forward)
        before = self.x.clone()
        commit = decide(self, out)
        steps.append((before, self.x.clone(), self.p_len, self.block_size))
        return commit

    monkeypatch.setattr(Cohort, "decide", spy)
    params = SamplingParams(**{"chat": False, "early_stop": False, **knobs, "logprobs": 3})
    engine = Engine(model, max_num_seqs=1)
    req = engine.submit(prompt, params)
    engine.run_until_idle()
    engine.release()
    assert req.error is None and req.final_ids and len(req.logprobs) == len(req.final_ids)
    want = _recompute(model, steps, len(req.final_ids), 3)
    got = torch.tensor(req.logprobs, dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor([w[0] for w in want], dtype=torch.float64), **CLOSE)
    assert [[t for t, _ in top] for top in req.top_logprobs] == [w[1] for w in want]
    for lp, top in zip(req.logprobs, req.top_logprobs):  # most likely first, the token among them or below
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True) and lp <= values[0] + 1e-6
    if knobs["strategy"] == "joint_threshold":
        assert req.edits > 0  # an edited slot reports its last write's forward


def test_a_prompts_logprobs_are_the_same_alone_in_a_batch_and_served(offline):
    model, tok = offline.model, offline.model.tokenizer
    prompts = [tok.encode(P1), tok.encode(P2), tok.encode("<|startoftext|>asdfghjkl=")]
    params = _params(logprobs=2)
    batch = run_batch(model, prompts, params).requests
    engine = Engine(model, max_num_seqs=4)
    other = engine.submit(prompts[0], _params())  # no logprobs: the confidence head, until they share forwards
    engine.step()
    engine.step()
    served = [engine.submit(p, params) for p in prompts[1:]]
    engine.run_until_idle()
    engine.release()
    assert other.error is None and engine.stats.per_row_steps > 0  # per-row forwards with logits for all
    for i, p in enumerate(prompts):
        alone = run_batch(model, [p], params).requests[0]
        n = len(alone.output_ids)
        assert n and len(alone.logprobs) >= n
        together = [batch[i]] + ([served[i - 1]] if i else [])
        for r in together:
            assert r.output_ids == alone.output_ids, i
            torch.testing.assert_close(torch.tensor(r.logprobs[:n]), torch.tensor(alone.logprobs[:n]), **CLOSE)
            assert [[t for t, _ in top] for top in r.top_logprobs[:n]] == [
                [t for t, _ in top] for top in alone.top_logprobs[:n]
            ]


def test_llm_generate_carries_logprobs_only_when_asked_and_they_change_no_token(offline):
    plain = offline.generate([LETTERS, "zxcvbnm"], SamplingParams(strategy="threshold", block_length=8))
    asked = offline.generate([LETTERS, "zxcvbnm"], SamplingParams(strategy="threshold", block_length=8, logprobs=0))
    for a, b in zip(plain, asked):
        assert a.logprobs is None and a.top_logprobs is None
        assert b.text == a.text and b.token_ids == a.token_ids
        assert len(b.logprobs) == len(b.token_ids) and b.top_logprobs == [[]] * len(b.token_ids)
        assert all(lp <= 0 and math.isfinite(lp) for lp in b.logprobs)


def test_only_a_cohort_that_asks_takes_the_logits_path_and_records(offline):
    model = offline.model
    ids = model.tokenizer.encode(P1)
    assert uses_confidence_head(_params()) and not uses_confidence_head(_params(logprobs=0))
    lean = Cohort(model, [ids], _params())
    assert lean.logprobs is None and not hasattr(lean, "token_logprob") and lean.use_confidence
    asking = Cohort(model, [ids], _params(logprobs=4))
    assert not asking.use_confidence and asking.commit is None and asking.top_ids.shape == (1, 40, 4)
    editing = Cohort(model, [ids], _params(strategy="joint_threshold", logprobs=1))
    assert not editing.use_confidence and editing.device_rule is None


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_sampling_params_refuse_a_bad_logprobs_naming_it(value):
    with pytest.raises(GenerationError, match="logprobs"):
        SamplingParams(logprobs=value).validate()


# ---------------------------------------------------------------- served


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--strategy", "threshold", "--block-length", "8", "--max-num-seqs", "8", cwd=ROOT)
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield s
    s.stop()


def _check_completion_logprobs(lp, text: str, k: int) -> None:
    """OpenAI's legacy form: tokens spelling the text, offsets into it, top dicts of <= k + 1."""
    assert "".join(lp.tokens) == text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and len(top) <= k + 1 and value <= 0


def test_completions_logprobs_equal_offline_for_each_choice_of_a_batch(server, offline):
    tok = offline.model.tokenizer
    reply = server.client.completions.create(model=MODEL, prompt=[P1, P2], logprobs=3, max_tokens=16)
    assert [c.index for c in reply.choices] == [0, 1]
    for prompt, choice in zip([P1, P2], reply.choices):
        want = offline.generate([tok.encode(prompt)], _params(gen_length=16, logprobs=3))[0]
        assert choice.text == want.text
        _check_completion_logprobs(choice.logprobs, choice.text, 3)
        n = len(want.token_ids)
        assert choice.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
        torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs), torch.tensor(want.logprobs), **CLOSE)
        assert len(choice.logprobs.token_logprobs) == n
    plain = server.client.completions.create(model=MODEL, prompt=P1, max_tokens=16)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == reply.choices[0].text


def test_chat_logprobs_content_and_top_logprobs(server, offline):
    messages = [{"role": "user", "content": LETTERS}]
    reply = server.client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    want = offline.generate([LETTERS], SamplingParams(strategy="threshold", block_length=8, logprobs=2))[0]
    content = choice.logprobs.content
    assert choice.message.content == want.text and "".join(c.token for c in content) == want.text
    torch.testing.assert_close(torch.tensor([c.logprob for c in content]), torch.tensor(want.logprobs), **CLOSE)
    tok = offline.model.tokenizer
    for c, top in zip(content, want.top_logprobs):
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2
        assert [a.token for a in c.top_logprobs] == [tok.decode([t], skip_special_tokens=False) for t, _ in top]
        assert all(a.bytes == list(a.token.encode()) for a in c.top_logprobs)
    only = server.client.chat.completions.create(model=MODEL, messages=messages, logprobs=True)
    assert all(c.top_logprobs == [] for c in only.choices[0].logprobs.content)
    assert [c.logprob for c in only.choices[0].logprobs.content] == [c.logprob for c in content]


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_chunks_carry_the_logprobs_of_their_tokens(server, chat):
    """Out-of-order commits over many steps: each chunk's logprobs are those of the tokens whose
    text it completes; together they equal the non-streamed answer's, each token once."""
    knobs = {"strategy": "low_confidence", "cache": "adaptive"}
    if chat:
        body = dict(messages=[{"role": "user", "content": LETTERS}], logprobs=True, top_logprobs=1)
        create = server.client.chat.completions.create
    else:
        body = dict(prompt=[P1, P2], logprobs=1, max_tokens=24)
        create = server.client.completions.create
    whole = create(model=MODEL, **body, extra_body=knobs)
    texts, tokens, values, chunks = {}, {}, {}, 0
    for part in create(model=MODEL, **body, extra_body=knobs, stream=True):
        for c in part.choices:
            i = c.index
            piece = c.delta.content if chat else c.text
            texts[i] = texts.get(i, "") + (piece or "")
            if c.logprobs is None:
                assert chat and c.delta.role == "assistant"  # the opening chunk
                continue
            chunks += 1
            if chat:
                tokens.setdefault(i, []).extend(x.token for x in c.logprobs.content)
                values.setdefault(i, []).extend(x.logprob for x in c.logprobs.content)
            else:
                offsets = c.logprobs.text_offset
                assert offsets == sorted(offsets)
                tokens.setdefault(i, []).extend(c.logprobs.tokens)
                values.setdefault(i, []).extend(c.logprobs.token_logprobs)
            assert len("".join(tokens[i])) <= len(texts[i])  # never ahead of the text sent
    assert chunks > len(whole.choices)  # streamed in several chunks
    for c in whole.choices:
        text = c.message.content if chat else c.text
        want = c.logprobs.content if chat else None
        assert texts[c.index] == text and "".join(tokens[c.index]) == text
        if chat:
            assert tokens[c.index] == [x.token for x in want] and values[c.index] == [x.logprob for x in want]
        else:
            assert tokens[c.index] == c.logprobs.tokens and values[c.index] == c.logprobs.token_logprobs


REFUSED = [
    ("completions-logprobs-6", False, {"prompt": P1, "logprobs": 6}, "logprobs", "integer in [0, 5]"),
    ("completions-logprobs-negative", False, {"prompt": P1, "logprobs": -1}, "logprobs", "integer in [0, 5]"),
    ("completions-logprobs-true", False, {"prompt": P1, "logprobs": True}, "logprobs", "integer in [0, 5]"),
    ("completions-top-logprobs", False, {"prompt": P1, "top_logprobs": 2}, "top_logprobs",
     "a /v1/chat/completions field"),
    ("completions-echo-and-logprobs", False, {"prompt": P1, "echo": True, "logprobs": 1}, "logprobs",
     "'echo' with 'logprobs'"),
    ("chat-logprobs-int", True, {"logprobs": 2}, "logprobs", "must be a boolean"),
    ("chat-top-logprobs-21", True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be in [0, 20]"),
    ("chat-top-logprobs-negative", True, {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "must be in [0, 20]"),
    ("chat-top-logprobs-without-logprobs", True, {"top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
]  # fmt: skip


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_out_of_range_logprobs_are_a_400_naming_the_field(server, case):
    _, chat, body, param, fragment = case
    if chat:
        body = {"messages": [{"role": "user", "content": "ab"}], **body}
    r = httpx.post(f"{server.url}/v1/{'chat/completions' if chat else 'completions'}", json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and fragment in err["message"], err


def test_an_engine_process_relays_the_logprobs(server):
    """``--engine-process``: the front mirrors the engine process's events, log-probs included."""
    split = ServerProcess(
        "--strategy", "threshold", "--block-length", "8", "--engine-process", cwd=ROOT, lifetime=180
    )  # fmt: skip
    try:
        body = {"prompt": [P1, P2], "logprobs": 2, "max_tokens": 16}
        here = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        there = httpx.post(f"{split.url}/v1/completions", json=body, timeout=60).json()
        assert [c["text"] for c in there["choices"]] == [c["text"] for c in here["choices"]]
        for a, b in zip(here["choices"], there["choices"]):
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"] and a["logprobs"]["tokens"]
            torch.testing.assert_close(
                torch.tensor(b["logprobs"]["token_logprobs"]), torch.tensor(a["logprobs"]["token_logprobs"]), **CLOSE
            )
    finally:
        split.stop()
