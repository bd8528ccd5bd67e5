"""LLaDA2.1's token-to-token editing decoder (``strategy="joint_threshold"``, issue #39).

- the rule and its block state machine against a plain-Python transcription of the reference
  algorithm (SGLang ``JointThreshold`` / the LLaDA2.1 ``generate``) on random logits: the same
  commits and edits per step, block ends, post-step budget; prompt slots and earlier blocks never
  written;
- batch invariance on every family: alone == static batch of mixed lengths == served mid-stream;
- finality: with editing a token is final only when its block ends; the final stream is never
  revised, provisional text is marked, and a stop string seen only in provisional text does not
  end a request;
- the K/V rule: the K/V a cache keeps for a finished block are those of its final tokens;
- presets, bad input, stats.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dinfer_rt
from dinfer_rt import strategies
from dinfer_rt.decode import Cohort
from dinfer_rt.demo import task
from dinfer_rt.engine import Engine
from dinfer_rt.errors import GenerationError
from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams

# ---------------------------------------------------------------- the reference, transcribed


def _ref_step(block: list[int], logits: list[list[float]], prompt: list[bool], post: int, p: dict, mask: int):
    """One step of the reference for one row's block, in plain Python (the algorithm as the
    LLaDA2.1 report and SGLang's JointThreshold state it). Returns (new block, committed slots,
    edited slots, post steps, finished)."""
    n = len(block)
    z = [list(row) for row in logits]
    for i in range(n):
        z[i][mask] = -math.inf
    if p["penalty_lambda"] > 0:
        for i in range(1, n):
            z[i][block[i - 1]] -= p["penalty_lambda"]
    x0, prob = [], []
    for row in z:
        best = max(range(len(row)), key=lambda v: (row[v], -v))  # the first of equal maxima
        top = row[best]
        total = sum(math.exp(v - top) for v in row if v != -math.inf)
        x0.append(best)
        prob.append(1.0 / total)
    has_mask = any(t == mask for t in block)
    commit = set()
    if has_mask:
        commit = {i for i in range(n) if block[i] == mask and prob[i] > p["threshold"]}
        if not commit:
            masked = [i for i in range(n) if block[i] == mask]
            commit = {max(masked, key=lambda i: (prob[i], -i))}
    else:
        post += 1
        if post > p["max_post_steps"]:
            return list(block), set(), set(), post, True
    edit = {
        i
        for i in range(n)
        if block[i] != mask and not prompt[i] and x0[i] != block[i] and prob[i] > p["edit_threshold"]
    }
    if not commit and not edit:
        return list(block), set(), set(), post, True
    new = [x0[i] if i in commit or i in edit else block[i] for i in range(n)]
    return new, commit, edit, post, False


@pytest.fixture(scope="module")
def tiny(ckpt_dir):
    return {name: dinfer_rt.load_model(ckpt_dir(name), backend="cpu") for name in ("llada", "llada2")}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**31 - 1),
    family=st.sampled_from(["llada", "llada2"]),
    block=st.sampled_from([3, 4, 5]),
    blocks=st.integers(1, 3),
    prompt_lens=st.lists(st.integers(2, 7), min_size=1, max_size=3),
    threshold=st.sampled_from([0.3, 0.5, 0.7, 0.9, 1.0]),
    edit_threshold=st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]),
    max_post_steps=st.integers(0, 3),
    penalty=st.sampled_from([0.0, 0.0, 1.5]),
    keep=st.sampled_from([0.0, 0.5, 0.9]),
)
def test_the_rule_equals_the_reference_transcription_on_random_logits(
    tiny, seed, family, block, blocks, prompt_lens, threshold, edit_threshold, max_post_steps, penalty, keep
):
    """The Cohort's joint_threshold (batched over rows, on tensors) against the transcription,
    row by row, on random logits (some slots favour the token they hold, so blocks also end by
    a step that edits nothing): identical commits and edits each step, the same block ends
    (post-step budget included); prompt slots and finished blocks are never written."""
    model = tiny[family]
    p = dict(threshold=threshold, edit_threshold=edit_threshold, max_post_steps=max_post_steps, penalty_lambda=penalty)
    params = SamplingParams(
        strategy="joint_threshold", gen_length=block * blocks, block_length=block, early_stop=False, **p
    )
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(6, 60, (n,), generator=g).tolist() for n in prompt_lens]
    if model.spec.block_causal:  # one prompt length per cohort (as the engine groups them)
        prompts = [pr[: min(prompt_lens)] for pr in prompts]
    cohort = Cohort(model, prompts, params)
    mask, v = model.mask_id, model.spec.vocab
    ref = cohort.x.clone().tolist()  # the transcription's own sequences
    ref_final = [False] * cohort.b
    ref_post = [0] * cohort.b
    prompt_ids = cohort.x[:, : cohort.p_len].clone()
    block_start, blocks_seen, forwards = None, 0, 0
    while cohort.prepare():
        s, e = cohort.s, cohort.e
        if s != block_start:  # a new block: every row of the reference finished the last one
            assert all(ref_final) or block_start is None
            ref_final = [False] * cohort.b
            ref_post = [0] * cohort.b
            ref_prompt = [[t != mask for t in row[s:e]] for row in ref]
            frozen = cohort.x[:, :s].clone()  # earlier blocks are final from now on
            block_start, blocks_seen = s, blocks_seen + 1
        cohort.last_forward = forwards
        forwards += 1
        logits = torch.randn((cohort.b, e - s, v), generator=g, dtype=torch.float64) * 3
        favour = torch.rand((cohort.b, e - s), generator=g) < keep  # a bonus for the token already there
        cur = cohort.x[:, s:e]
        bonus = torch.zeros_like(logits).scatter_(-1, cur.clamp_max(v - 1)[..., None], 12.0)
        logits = torch.where(favour[..., None] & (cur != mask)[..., None], logits + bonus, logits)
        before = cohort.x[:, s:e].clone()
        commit = cohort.decide(logits.clone())
        after = cohort.x[:, s:e]
        for r in range(cohort.b):
            if ref_final[r]:
                assert torch.equal(after[r], before[r]), "a finished row's block changed"
                continue
            new, c, ed, ref_post[r], ref_final[r] = _ref_step(
                ref[r][s:e], logits[r].tolist(), ref_prompt[r], ref_post[r], p, mask
            )
            ref[r][s:e] = new
            assert set(commit[r].nonzero().flatten().tolist()) == c, (r, "commits")
            edited = (before[r] != mask) & (after[r] != before[r])
            assert set(edited.nonzero().flatten().tolist()) <= ed  # an edit to the same token is no change
            assert after[r].tolist() == new, (r, "tokens")
            assert bool(cohort.block_final[r]) == ref_final[r], (r, "block end")
        assert torch.equal(cohort.x[:, : cohort.p_len], prompt_ids), "a prompt slot was written"
        assert torch.equal(cohort.x[:, :s], frozen), "an earlier block was written"
    assert cohort.x.tolist() == ref
    assert blocks_seen == len(range((cohort.p_len // block) * block if model.spec.block_causal else cohort.p_len,
                                    cohort.n, block))  # fmt: skip
    assert not (cohort.x == mask).any()


def test_the_block_end_rule_and_its_budget():
    """A no-mask step that edits nothing ends the block; past max_post_steps no-mask steps the
    step decides nothing and ends it; a step with masks never ends it."""
    has = torch.tensor([True, False, False, False])
    edited = torch.tensor([False, False, True, True])
    post = torch.tensor([0, 1, 2, 3])
    decide, ends = strategies.joint_threshold_block_end(has, edited, post, 2)
    assert decide.tolist() == [True, True, True, False]
    assert ends.tolist() == [False, True, False, True]


def test_edit_threshold_zero_rewrites_every_disagreeing_slot_and_prompt_slots_never():
    logits = torch.full((1, 4, 6), -5.0)
    logits[0, :, 2] = 5.0  # every slot's candidate: token 2, with probability near 1
    logits[0, 3, 2], logits[0, 3, 4], logits[0, 3, 5] = 0.0, 0.1, 0.0  # slot 3: token 4 at p ~ 0.35
    current = torch.tensor([[1, 3, 2, 1]])
    masked = torch.zeros(1, 4, dtype=torch.bool)
    editable = torch.tensor([[False, True, True, True]])  # slot 0 is a prompt slot
    for edit_tau, want in ((0.0, [False, True, False, True]), (0.5, [False, True, False, False])):
        rule = strategies.make_joint_threshold(0.9, edit_tau, 0.0)
        inp = strategies.StepInput(logits, masked, torch.ones(1, dtype=torch.long), 0.0, None,
                                   current=current, editable=editable)  # fmt: skip
        x0, write = rule(inp)
        assert write[0].tolist() == want, edit_tau
    # the penalty lowers the logit of the left neighbour's token: slot 2 (holding 2, neighbour 3)
    # keeps 2, slot 1 (neighbour 1) too; with a penalty on token 2 at slot 3 (neighbour 2) its
    # candidate moves away from 2
    z = strategies.penalize_previous(logits, current, 20.0)
    assert z[0, 3, 2] == logits[0, 3, 2] - 20.0 and z[0, 1, 1] == logits[0, 1, 1] - 20.0
    assert torch.equal(z[0, 0], logits[0, 0])  # the block's first slot has no neighbour in it


# ---------------------------------------------------------------- presets and bad input


def test_presets_are_the_model_card_values_and_explicit_settings_win(capsys):
    assert strategies.preset_fields("llada2.1-quality") == dict(
        strategy="joint_threshold", threshold=0.7, edit_threshold=0.5, max_post_steps=16
    )
    assert strategies.preset_fields("llada2.1-speed") == dict(
        strategy="joint_threshold", threshold=0.5, edit_threshold=0.0, max_post_steps=16
    )
    with pytest.raises(GenerationError, match="preset: unknown preset 'fast'.*llada2.1-quality"):
        strategies.preset_fields("fast")
    from dinfer_rt.cli import _params, build_parser

    for cmd in (["generate", "x"], ["eval"], ["bench"], ["serve"]):
        a = build_parser().parse_args([*cmd, "--preset", "llada2.1-speed", "--edit-threshold", "0.25"])
        got = _params(a)
        assert (got.strategy, got.threshold, got.edit_threshold, got.max_post_steps) == (
            "joint_threshold", 0.5, 0.25, 16,
        ), cmd  # fmt: skip
    plain = _params(build_parser().parse_args(["generate", "x"]))
    assert (plain.strategy, plain.threshold) == (SamplingParams().strategy, SamplingParams().threshold)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("edit_threshold", -0.1, "edit_threshold -0.1 must be in \\[0, 1\\]"),
        ("edit_threshold", 1.5, "edit_threshold 1.5 must be in \\[0, 1\\]"),
        ("max_post_steps", -1, "max_post_steps -1 must be in \\[0, 1024\\]"),
        ("max_post_steps", 2.0, "max_post_steps must be int"),
        ("penalty_lambda", float("nan"), "penalty_lambda must be a finite number"),
        ("penalty_lambda", -1.0, "penalty_lambda -1.0 must be in \\[0, 100\\]"),
    ],
)
def test_bad_editing_settings_are_refused_naming_the_field(field, value, message):
    with pytest.raises(GenerationError, match=message):
        SamplingParams(strategy="joint_threshold", **{field: value}).validate()


def test_the_server_body_takes_the_preset_and_the_editing_fields():
    from dinfer_rt.openai_protocol import ApiError, parse

    llm = LLM()
    kw = dict(chat=False, tokenizer=llm.tokenizer, defaults=SamplingParams(block_length=8), model_name="m", max_len=200)
    sub = parse({"prompt": "abc", "preset": "llada2.1-quality", "threshold": 0.8}, **kw)
    assert (sub.params.strategy, sub.params.threshold, sub.params.edit_threshold) == ("joint_threshold", 0.8, 0.5)
    sub = parse({"prompt": "abc", "strategy": "joint_threshold", "penalty_lambda": 3, "max_post_steps": 4}, **kw)
    assert (sub.params.penalty_lambda, sub.params.max_post_steps) == (3.0, 4)
    sub = parse({"prompt": "abc", "stream": True, "stream_provisional": True}, **kw)
    assert sub.stream_provisional
    for body, param in (
        ({"prompt": "abc", "preset": "nope"}, "preset"),
        ({"prompt": "abc", "stream_provisional": True}, "stream_provisional"),
        ({"prompt": "abc", "stream": True, "stream_provisional": "yes"}, "stream_provisional"),
        ({"prompt": "abc", "edit_threshold": 2}, "edit_threshold"),
    ):
        with pytest.raises(ApiError) as err:
            parse(body, **kw)
        assert err.value.status == 400 and err.value.param == param, (body, err.value.message)


# ---------------------------------------------------------------- batch invariance, every family

EDIT_RULES = [
    dict(strategy="joint_threshold", threshold=0.3, edit_threshold=0.2, max_post_steps=3),
    dict(strategy="joint_threshold", threshold=0.5, edit_threshold=0.0, max_post_steps=2, penalty_lambda=1.0),
    dict(strategy="joint_threshold", threshold=0.4, edit_threshold=0.3, max_post_steps=2, temperature=0.8, seed=3),
]
CACHES = ["none", "prefix", "dual", "vicinity", "adaptive", "anchored", "delayed"]


@pytest.mark.parametrize("name", ["llada", "dream", "llada_moe", "llada2"])
def test_joint_threshold_decodes_the_same_alone_batched_and_served(ckpt_dir, name):
    """Batch invariance as for every rule (tests/test_engine.py): a prompt's tokens alone equal
    them in a static batch of mixed lengths and served beside requests arriving mid-stream; with
    temperature the draws are per cohort, so alone vs served only."""
    llm = LLM(ckpt_dir(name), backend="cpu")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, 60, (n,), generator=g).tolist() for n in (3, 7, 5)]
    pairs = [(rule, CACHES[(i * 3) % len(CACHES)]) for i, rule in enumerate(EDIT_RULES)]
    if name in ("llada", "llada2"):  # every cache policy on one bidirectional and one block-causal family
        pairs += [(EDIT_RULES[0], c) for c in CACHES if c not in ("none", "adaptive", "delayed")]
    edits = 0
    for rule, cache in pairs:
        params = SamplingParams(gen_length=8, block_length=4, cache=cache, early_stop=False, **rule)
        alone = [llm.generate([p], params)[0] for p in prompts]
        edits += sum(o.stats.edits for o in alone)
        if not rule.get("temperature"):
            batched = [o.token_ids for o in llm.generate(prompts, params)]
            assert batched == [o.token_ids for o in alone], (name, rule, cache, "static batch")
        engine = Engine(llm.model, max_num_seqs=3, block_length=4)
        reqs = [engine.submit(prompts[0], params)]
        engine.step()
        reqs += [engine.submit(p, params) for p in prompts[1:]]
        engine.run_until_idle()
        assert [r.output_ids for r in reqs] == [o.token_ids for o in alone], (name, rule, cache, "served")
        assert [r.edits for r in reqs] == [o.stats.edits for o in alone]
        assert engine.stats.per_row_steps > 0
    assert edits > 0  # the rule really rewrote tokens on these random models


# ---------------------------------------------------------------- finality and streaming


@pytest.fixture(scope="module")
def embedded():
    return LLM()


SPEED = SamplingParams(strategy="joint_threshold", threshold=0.5, edit_threshold=0.0, max_post_steps=4, block_length=8)


def _watch(engine: Engine, prompt, params, **kw):
    seen = []

    def listener(req, event):
        seen.append((event, list(req.final_ids), list(req.provisional_ids)))
        if req.canvas is not None:  # return_canvas: its final part is the final ids
            assert req.canvas[: req.canvas_final] == req.final_ids and req.canvas_final == len(req.final_ids)

    return engine.submit(prompt, params, listener=listener, **kw), seen


def test_final_text_grows_only_at_block_ends_and_is_never_revised(embedded):
    """With editing, final ids grow a whole block at a time (when the row's block ends) and each
    is a prefix of the next; the provisional tail is revised while its block runs; the
    concatenated final stream equals the output."""
    prompt = embedded.encode(task.heldout(1)[0].letters, True)
    engine = Engine(embedded.model)
    req, seen = _watch(
        engine, prompt, dataclasses.replace(SPEED, early_stop=False), stream_provisional=True, return_canvas=True
    )
    engine.run_until_idle()
    finals = [f for _, f, _ in seen]
    for a, b in zip(finals, finals[1:]):
        assert b[: len(a)] == a  # never revised
    assert {len(f) for f in finals} <= {0, 8, 16, 24, 32, 40}  # whole blocks only
    assert finals[-1][: len(req.output_ids)] == req.output_ids
    tails = [t for _, _, t in seen]
    revised = any(a and b and b[: len(a)] != a for a, b in zip(tails, tails[1:]))
    assert revised, "the provisional tail was never revised: no edit seen"
    assert req.edits > 0 and req.post_steps > 0
    # the threshold rule: final as soon as unmasked (the prefix up to the first mask), no tail
    plain = dataclasses.replace(SPEED, strategy="threshold", early_stop=False)
    eng = Engine(embedded.model)
    req2, seen2 = _watch(eng, prompt, plain, stream_provisional=True)
    eng.run_until_idle()
    assert all(t == [] for _, _, t in seen2) and len({len(f) for _, f, _ in seen2}) > 5


def test_a_stop_string_only_in_provisional_text_does_not_end_the_request(embedded):
    """Find a string that the provisional text held but the final text never did; asked as a
    stop string it changes nothing (the request ends as without it). A check on provisional
    text would have stopped it early."""
    tok = embedded.tokenizer
    prompt = embedded.encode(task.heldout(2)[1].letters, True)
    params = dataclasses.replace(SPEED, early_stop=False)
    engine = Engine(embedded.model)
    req, seen = _watch(engine, prompt, params, stream_provisional=True)
    engine.run_until_idle()
    final_text = tok.decode(req.final_ids)
    candidates = []
    for _, final, tail in seen:
        text = tok.decode(final + tail)
        for k in (3, 2):
            candidates += [text[i : i + k] for i in range(len(text) - k + 1) if text[i : i + k] not in final_text]
    assert candidates, "no provisional-only text to test with"
    stop = candidates[0]
    engine = Engine(embedded.model)
    stopped = engine.submit(prompt, dataclasses.replace(params, stop=(stop,)))
    engine.run_until_idle()
    assert stopped.text == req.text and stopped.finish_reason == req.finish_reason
    # and a stop string in the final text still ends it, before that text
    real = final_text[10:12]
    engine = Engine(embedded.model)
    cut = engine.submit(prompt, dataclasses.replace(params, stop=(real,)))
    engine.run_until_idle()
    assert cut.finish_reason == "stop" and cut.text == final_text[: final_text.index(real)]


def test_eos_in_an_open_block_is_not_final(embedded):
    """EOS is an ordinary editable token until its block ends: a request finishes at an EOS only
    once it is final, so the output equals a run that decodes every block (cut at the first EOS)."""
    items = task.heldout(4)
    prompts = [embedded.encode(it.letters, True) for it in items]
    early = embedded.generate(prompts, SPEED)
    full = embedded.generate(prompts, dataclasses.replace(SPEED, early_stop=False))
    assert [o.token_ids for o in early] == [o.token_ids for o in full]
    assert sum(o.stats.nfe for o in early) <= sum(o.stats.nfe for o in full)


def test_streamed_final_text_equals_the_answer_and_provisional_chunks_are_marked(embedded):
    """The server (in-process): the concatenated content deltas equal the non-streamed text;
    with ``stream_provisional`` chunks carry a ``provisional`` field, revised as blocks run,
    and the usage extension counts the edits."""
    import json

    from fastapi.testclient import TestClient

    from dinfer_rt.server import ServeConfig, build_app

    defaults = SamplingParams(block_length=8)
    app = build_app(embedded.model, defaults, ServeConfig(max_num_seqs=2))
    body = {"prompt": "lkjhgfdsaq", "preset": "llada2.1-speed", "max_tokens": 40, "max_post_steps": 4}
    with TestClient(app) as client:
        whole = client.post("/v1/completions", json=body).json()
        text = whole["choices"][0]["text"]
        assert whole["usage"]["edits"] > 0 and whole["usage"]["post_steps"] > 0
        stream_body = {**body, "stream": True, "stream_provisional": True, "stream_options": {"include_usage": True}}
        deltas, provisional, usage = [], [], None
        with client.stream("POST", "/v1/completions", json=stream_body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage") and not ev["choices"]:
                    usage = ev["usage"]
                    continue
                choice = ev["choices"][0]
                deltas.append(choice["text"])
                if "provisional" in choice:
                    provisional.append(choice["provisional"])
        metrics = client.get("/metrics").text
    assert "".join(deltas) == text
    assert len(provisional) > 2 and provisional[-1] == ""  # cleared when the answer is final
    assert usage["edits"] == whole["usage"]["edits"]
    edits = [float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("dinfer_edits_total")]
    assert edits and edits[0] >= 2 * whole["usage"]["edits"]


# ---------------------------------------------------------------- the K/V rule

KV_RULES = [
    dict(strategy="threshold", threshold=0.3),
    dict(strategy="low_confidence", steps=6),
    dict(strategy="joint_threshold", threshold=0.3, edit_threshold=0.1, max_post_steps=3),
]


@pytest.mark.parametrize("name", ["llada", "llada2"])
@pytest.mark.parametrize("cache", [c for c in CACHES if c != "none"])
def test_kept_k_v_of_finished_blocks_are_those_of_their_final_tokens(ckpt_dir, name, cache):
    """For every cache policy x rule: after decoding, the K/V the cache holds for every finished
    block (all but the last, which nothing reads) come from a forward over the final tokens. On
    the block-causal model a finished block's K/V depend only on earlier blocks, so they must
    equal a fresh prefill's exactly; on the bidirectional model they also depend on the rest of
    the sequence as it was, so the check is on the first layer's K/V, which depend on the token
    (and position) alone: K/V computed for another token (an edit made after the last forward
    that wrote them, or a commit never recomputed) differ there."""
    model = dinfer_rt.load_model(ckpt_dir(name), backend="cpu")
    prompt = [7, 8, 9, 10, 11]
    for rule in KV_RULES:
        params = SamplingParams(gen_length=12, block_length=4, cache=cache, early_stop=False, **rule)
        # contiguous rows: the row's K/V stay readable after the request ends (the paged pool's
        # are checked in tests/test_paged_engine.py)
        engine = Engine(model, max_num_seqs=1, block_length=4, kv_block_size=0)
        req = engine.submit(prompt, params)
        engine.run_until_idle()
        cohort = req.cohort
        last = cohort.n - 4 if not model.spec.block_causal else ((cohort.n - 1) // 4) * 4
        fresh = model.new_cache(1, cohort.n)
        model.forward(cohort.x, cache=fresh, block_size=4 if model.spec.block_causal else None)
        layers = range(len(fresh.k)) if model.spec.block_causal else [0]
        for i in layers:
            for kept, prefill in ((engine.cache.k[i], fresh.k[i]), (engine.cache.v[i], fresh.v[i])):
                err = (kept[0, :last] - prefill[0, :last]).abs().amax(-1).amax(-1)
                assert float(err.max()) < 1e-5, (name, cache, rule, i, err.tolist())
        assert engine.cache.k[0][0, :last].abs().sum() > 0


def test_eval_json_reports_edits_and_post_steps(capsys):
    """``dinfer-rt eval --json --preset llada2.1-speed``: the editing statistics are in the report
    (and zero for a rule that does not edit)."""
    import json

    from dinfer_rt.cli import main

    assert main(["eval", "--json", "--limit", "3", "--preset", "llada2.1-speed", "--block-length", "8"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["edits"] > 0 and r["post_steps"] > 0 and r["edits_per_forward"] > 0
    assert main(["eval", "--json", "--limit", "3", "--strategy", "threshold", "--block-length", "8"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["edits"] == 0 and r["post_steps"] == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_rule_keeps_its_tensors_on_the_logits_device(temperature):
    """As every rule (tests/test_scheduler.py): with the block state on the host and the logits on
    a device (torch's meta device refuses host tensors as CUDA does), the editing rule's work and
    results stay on the logits' device."""
    rule = strategies.make_joint_threshold(0.5, 0.2, 1.5)
    logits = torch.randn(2, 5, 7).to("meta")
    masked = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    current = torch.tensor([[6, 6, 2, 6, 6], [1, 2, 3, 4, 5]])
    editable = ~masked
    inp = strategies.StepInput(
        logits, masked.to("meta"), torch.ones(2, dtype=torch.long).to("meta"), temperature,
        torch.Generator().manual_seed(0), {}, current=current.to("meta"), editable=editable.to("meta"),
    )  # fmt: skip
    x0, write = rule(inp)
    assert (x0.device.type, write.device.type) == ("meta", "meta") and write.shape == (2, 5)


def test_data_parallel_replicas_decode_and_count_edits_as_one_process(embedded):
    """Worker replicas (``LLM(data_parallel_size=2)``) run the editing rule as one process does
    and hand back its statistics."""
    prompts = [it.letters for it in task.heldout(3)]
    want = embedded.generate(prompts, SPEED)
    with LLM(data_parallel_size=2) as llm:
        outs = llm.generate(prompts, SPEED)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert [o.stats.edits for o in outs] == [o.stats.edits for o in want] and sum(o.stats.edits for o in outs) > 0


def test_with_temperature_both_tests_use_the_sampled_token_and_its_untempered_probability():
    """With temperature the candidate is a Gumbel-max sample (the shared sampler, same draws for
    the same seed) and M2T / T2T test that sample's un-tempered probability, not the argmax's."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 6, 9, generator=g, dtype=torch.float64) * 2
    current = torch.randint(0, 9, (3, 6), generator=g)
    masked = torch.rand(3, 6, generator=g) < 0.5
    current[masked] = 8
    logits[..., 8] = -math.inf  # the mask id, banned as the engine bans it
    editable = ~masked
    want_x0 = strategies.sample(logits, 0.9, torch.Generator().manual_seed(11))
    p = logits.softmax(-1).gather(-1, want_x0[..., None]).squeeze(-1)
    assert not torch.equal(want_x0, logits.argmax(-1))  # the sample really differs from greedy here
    rule = strategies.make_joint_threshold(0.4, 0.3, 0.0)
    inp = strategies.StepInput(logits, masked, torch.ones(3, dtype=torch.long), 0.9, torch.Generator().manual_seed(11),
                               current=current, editable=editable)  # fmt: skip
    x0, write = rule(inp)
    assert torch.equal(x0, want_x0)
    m2t = masked & (p > 0.4)
    for r in range(3):  # the forced best masked slot of a row with none above
        if masked[r].any() and not m2t[r].any():
            m2t[r, p[r].masked_fill(~masked[r], -1).argmax()] = True
    assert torch.equal(write, m2t | (editable & (want_x0 != current) & (p > 0.3)))
