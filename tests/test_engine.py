"""The continuous-batching engine in-process: per-row query windows equal single-row forwards,
every request's greedy output equals ``LLM.generate`` of it alone whatever runs beside it,
admission and retirement order, cancellation, faults and bad requests."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import dinfer_rt
from dinfer_rt.demo import task
from dinfer_rt.engine import Engine, EngineClosed, QueueFull
from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import GenerationError
from dinfer_rt.llm import LLM
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.stopping import streamable
from dinfer_rt.testing import per_row_windows


@pytest.fixture(scope="module")
def embedded():
    return LLM()


@pytest.mark.parametrize("name", ["llada", "llada_gqa_sharded", "dream", "llada_moe", "llada2"])
def test_per_row_windows_equal_single_row_forwards(ckpt_dir, name):
    model = dinfer_rt.load_model(ckpt_dir(name), backend="cpu")
    assert per_row_windows.per_row_error(model, model) <= 1e-5


def test_per_row_graph_takes_a_row_index_and_refuses_bad_shapes(ckpt_dir):
    model = dinfer_rt.load_model(ckpt_dir("llada"), backend="cpu")
    graph = model.executable(True, per_row=True).graph
    assert next(v for v in graph.inputs if v.name == "token_index").type.rank == 2
    cache = model.new_cache(2, 9)
    ids = torch.zeros((2, 4), dtype=torch.long)
    with pytest.raises(GenerationError, match="token_index must be \\[2, 4\\]"):
        model.forward_rows(ids, torch.zeros((2, 3), dtype=torch.long), ids, torch.ones(2, 9, dtype=torch.bool), cache)
    with pytest.raises(GenerationError, match="token_index must lie in \\[0, 9\\)"):
        model.forward_rows(ids, torch.full((2, 4), 9), ids, torch.ones(2, 9, dtype=torch.bool), cache)


# (rule / cache configurations) x prompts: each request decoded beside the others equals it alone
CONFIGS = [
    dict(strategy="threshold", block_length=8),
    dict(strategy="low_confidence", block_length=8, cache="dual"),
    dict(strategy="threshold", block_length=8, cache="adaptive", refresh_bound=4),
    dict(strategy="entropy", block_length=8, cache="vicinity", vicinity_warmup=2, vicinity_before=4),
    dict(strategy="credit", block_length=8, cache="prefix"),
    dict(strategy="random", block_length=8, temperature=0.7, seed=5),
    dict(strategy="hierarchical", block_length=8),
    dict(strategy="topk_margin", block_length=8, steps=20),
    dict(strategy="factor", block_length=8, factor=2.0, cache="dual"),
    dict(strategy="maskgit_plus", block_length=8, cache="adaptive", refresh_window=4),
    dict(strategy="threshold", block_length=8, cache="anchored"),
    dict(strategy="low_confidence", block_length=8, cache="anchored", refresh_bound=12, refresh_window=3),
    dict(strategy="threshold", block_length=8, cache="delayed"),
    dict(strategy="entropy", block_length=8, steps=20, cache="delayed"),
]


def test_embedded_requests_equal_their_lone_generation(embedded):
    items = task.heldout(8)
    prompts = [embedded.encode(it.letters, True) for it in items]
    engine = Engine(embedded.model, max_num_seqs=5)
    cases = []
    for i, cfg in enumerate(CONFIGS):  # every config beside every other, arriving in waves
        for j, prompt in enumerate(prompts[:3]):
            params = SamplingParams(**cfg, gen_length=40 if (i + j) % 2 else 32)
            cases.append((prompt, params, engine.submit(prompt, params)))
        engine.step()
    engine.run_until_idle()
    for prompt, params, req in cases:
        alone = embedded.generate([prompt], dataclasses.replace(params))[0]
        assert req.output_ids == alone.token_ids, (params, req.text, alone.text)
        assert req.text == alone.text
    assert engine.stats.steps < sum(r.forwards for _, _, r in cases)  # rows really shared forwards


@pytest.mark.parametrize("name", ["dream", "llada_moe", "llada2"])
@pytest.mark.parametrize("cache", ["none", "dual", "adaptive", "anchored", "delayed"])
def test_other_families_equal_their_lone_generation(ckpt_dir, name, cache):
    llm = LLM(ckpt_dir(name), backend="cpu")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(6, 60, (n,), generator=g).tolist() for n in (3, 9, 6, 12)]
    params = SamplingParams(gen_length=16, block_length=4, strategy="threshold", threshold=0.2, cache=cache)
    engine = Engine(llm.model, max_num_seqs=3, block_length=4)
    reqs = [engine.submit(p, params, max_tokens=13) for p in prompts]
    engine.run_until_idle()
    for p, req in zip(prompts, reqs):
        alone = llm.generate([p], params)[0].token_ids[:13]
        assert req.output_ids == alone


def test_admission_is_fifo_bounded_by_slots_and_tokens(embedded):
    params = SamplingParams(strategy="threshold", block_length=8, cache="dual")
    prompt = embedded.encode("abcdefghij", True)
    engine = Engine(embedded.model, max_num_seqs=2, max_num_batched_tokens=60)
    reqs = [engine.submit(prompt, params) for _ in range(4)]
    engine.step()  # one row: its first forward computes 52 slots, two would exceed 60
    assert [r.status for r in reqs] == ["running", "waiting", "waiting", "waiting"]
    engine.step()  # the first row now computes a block; the second fits
    assert [r.status for r in reqs[:2]] == ["running", "running"] and engine.num_running == 2
    engine.run_until_idle()
    assert all(r.done for r in reqs)
    assert [r.admitted for r in reqs] == sorted(r.admitted for r in reqs)


def test_rows_retire_the_moment_they_finish(embedded):
    prompt = embedded.encode("qwertyuiop", True)
    params = SamplingParams(strategy="low_confidence", block_length=8, gen_length=40)
    engine = Engine(embedded.model, max_num_seqs=4)
    short = engine.submit(prompt, params, max_tokens=3)
    stop = engine.submit(prompt, dataclasses.replace(params, stop=("|",)))
    full = engine.submit(prompt, params)
    order = []
    while engine.has_work():
        order += [r.id for r in engine.step()]
    assert order == [short.id, stop.id, full.id]
    assert short.finish_reason == "length" and len(short.output_ids) == 3 and short.forwards <= 8
    assert stop.finish_reason == "stop" and "|" not in stop.text and full.text.startswith(stop.text + "|")
    assert full.finish_reason == "stop" and task.check("qwertyuiop", full.text)  # EOS


def test_abort_frees_the_slot_and_the_rest_keep_their_answers(embedded):
    prompt = embedded.encode("zxcvbnmlkj", True)
    params = SamplingParams(strategy="low_confidence", block_length=8)
    engine = Engine(embedded.model, max_num_seqs=2)
    a, b, c = (engine.submit(prompt, params) for _ in range(3))
    engine.step()
    engine.step()
    engine.abort(a.id)
    engine.abort(c.id)  # still waiting
    engine.step()
    assert a.finish_reason == "abort" and c.finish_reason == "abort" and engine.num_running == 1
    engine.run_until_idle()
    assert b.output_ids == embedded.generate([prompt], params)[0].token_ids


def test_a_failing_step_fails_only_its_requests(embedded, monkeypatch):
    prompt = embedded.encode("asdfghjklq", True)
    params = SamplingParams(strategy="threshold", block_length=8)
    engine = Engine(embedded.model, max_num_seqs=2)
    # different settings: two cohorts, which share per-row forwards (equal ones would merge)
    first = [engine.submit(prompt, params), engine.submit(prompt, dataclasses.replace(params, threshold=0.8))]
    real, calls = embedded.model.forward_rows, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(embedded.model, "forward_rows", flaky)
    engine.step()
    later = engine.submit(prompt, params)
    failed = engine.step()
    assert failed == first and all(r.finish_reason == "error" and "device lost" in str(r.error) for r in first)
    engine.run_until_idle()
    assert later.finish_reason == "stop" and later.output_ids == embedded.generate([prompt], params)[0].token_ids


def test_bad_requests_are_refused_at_submit(embedded, ckpt_dir):
    engine = Engine(embedded.model, max_num_seqs=1, max_queue=1)
    ok = embedded.encode("abcdefghij", True)
    cases = [
        (ok, SamplingParams(threshold=2.0), {}, "threshold 2.0 must be in"),
        ([], SamplingParams(), {}, "prompt: at least one token"),
        ([99], SamplingParams(), {}, "token 0 is 99"),
        (ok, SamplingParams(gen_length=56, block_length=8), {}, "exceeds the max model length 64"),
        (ok, SamplingParams(), {"max_tokens": 41}, "max_tokens 41 must be in \\[1, gen_length 40\\]"),
    ]
    for prompt, params, kw, message in cases:
        with pytest.raises(GenerationError, match=message):
            engine.submit(prompt, params, **kw)
    queued = engine.submit(ok, SamplingParams())
    with pytest.raises(QueueFull, match="max_queue 1"):
        engine.submit(ok, SamplingParams())
    engine.abort(queued.id)  # a client that went away frees its place at once, not at the next step
    assert engine.num_waiting == 0
    engine.submit(ok, SamplingParams())
    with pytest.raises(QueueFull, match=r"\(1 of max_queue 1\)"):
        engine.submit(ok, SamplingParams())
    engine.close()
    with pytest.raises(EngineClosed):
        engine.submit(ok, SamplingParams())
    # block-causal: another block length than the served default is decoded (its own forward)
    llm2 = LLM(ckpt_dir("llada2"), backend="cpu")
    block_causal = Engine(llm2.model, block_length=4)
    p4, p8 = (SamplingParams(gen_length=16, block_length=b, strategy="threshold") for b in (4, 8))
    reqs = [block_causal.submit([7, 8, 9], p4), block_causal.submit([7, 8], p8)]
    block_causal.run_until_idle()
    assert [r.output_ids for r in reqs] == [
        llm2.generate([[7, 8, 9]], p4)[0].token_ids,
        llm2.generate([[7, 8]], p8)[0].token_ids,
    ]


def test_a_row_aborted_from_a_waiting_batch_stops_counting_as_waiting(embedded):
    """Its batch stays queued (the others still wait) but the aborted row, finished at the next
    step, is no longer counted (it was again after that step)."""
    engine = Engine(embedded.model, max_num_seqs=2)
    ok = embedded.encode("abcdefghij", True)
    for _ in range(2):
        engine.submit(ok, SamplingParams())
    engine.step()
    batch = engine.submit_batch([ok, ok], SamplingParams())
    assert engine.num_waiting == 2
    engine.abort(batch[0].id)
    assert engine.num_waiting == 1
    engine.step()
    assert batch[0].finish_reason == "abort" and engine.num_waiting == 1
    engine.run_until_idle()
    assert batch[1].finish_reason == "stop" and engine.num_waiting == 0


def test_streamable_text_never_holds_a_stop_string_or_a_split_character():
    assert streamable("abc|x", ("|xy",), final=False) == "abc"  # could still become "|xy"
    assert streamable("abc|xz", ("|xy",), final=False) == "abc|xz"
    assert streamable("ab#cd", ("#",), final=False) == "ab"
    assert streamable("ab\ufffd", (), final=False) == "ab"
    assert streamable("ab\ufffd", (), final=True) == "ab\ufffd"


def test_a_failing_listener_is_detached_and_the_engine_goes_on(embedded):
    prompt = embedded.encode("qwertyuiop", True)
    params = SamplingParams(strategy="threshold", block_length=8)
    engine = Engine(embedded.model)

    def broken(_req, _event):
        raise RuntimeError("event loop is closed")

    req = engine.submit(prompt, params, listener=broken)
    engine.run_until_idle()
    assert req.finish_reason == "stop" and req.listener is None
    assert req.output_ids == embedded.generate([prompt], params)[0].token_ids


# ---------------------------------------------------------------- one engine: invariance and paths

RULES = [
    dict(strategy="low_confidence", steps=6),
    dict(strategy="threshold", threshold=0.3),
    dict(strategy="factor", factor=2.0),
    dict(strategy="hierarchical", threshold=0.5, low_threshold=0.2),
    dict(strategy="credit", threshold=0.3),
    dict(strategy="maskgit_plus", steps=6),
    dict(strategy="topk_margin", steps=6),
    dict(strategy="entropy", steps=6),
    dict(strategy="random", steps=6),  # its remasking draws follow the cohort's generator
]
CACHES = ["none", "prefix", "dual", "vicinity", "adaptive", "anchored", "delayed"]


@pytest.mark.parametrize("name", ["llada", "dream", "llada_moe", "llada2"])
def test_every_rule_and_cache_decodes_the_same_alone_batched_and_served(ckpt_dir, name):
    """Batch invariance: a prompt's greedy tokens alone equal them in a static batch of mixed
    lengths (one lockstep cohort, or one per window shape: ``Engine.submit_batch``) and served
    beside other requests arriving mid-stream (per-row windows), for every rule x cache policy;
    the random rule's draws are per cohort, so it is checked alone vs served only."""
    llm = LLM(ckpt_dir(name), backend="cpu")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(6, 60, (n,), generator=g).tolist() for n in (3, 7, 5)]
    # every pair on LLaDA; on the other families each rule and each cache at least once (CI time)
    pairs = (
        [(r, c) for r in RULES for c in CACHES]
        if name == "llada"
        else [(rule, CACHES[(i * 3) % len(CACHES)]) for i, rule in enumerate(RULES)] + [(RULES[1], c) for c in CACHES]
    )
    for rule, cache in pairs:
        params = SamplingParams(gen_length=8, block_length=4, cache=cache, early_stop=False, **rule)
        alone = [llm.generate([p], params)[0].token_ids for p in prompts]
        if rule["strategy"] != "random":
            batched = [o.token_ids for o in llm.generate(prompts, params)]
            assert batched == alone, (name, rule, cache, "static batch")
        engine = Engine(llm.model, max_num_seqs=3, block_length=4)
        reqs = [engine.submit(prompts[0], params)]
        engine.step()  # the others arrive while the first is mid-block
        reqs += [engine.submit(p, params) for p in prompts[1:]]
        engine.run_until_idle()
        assert [r.output_ids for r in reqs] == alone, (name, rule, cache, "served")
        assert engine.stats.per_row_steps > 0  # rows at different blocks shared forwards


def test_guidance_and_precision_schedules_are_served_and_equal_their_lone_generation(embedded):
    """CFG and precision schedules run in the one engine: beside other requests a request with
    either decodes as LLM.generate does it alone (such a cohort takes its own lockstep forward)."""
    prompts = [embedded.encode(it.letters, True) for it in task.heldout(3)]
    plain = SamplingParams(strategy="threshold", block_length=8, cache="dual")
    special = [
        SamplingParams(strategy="low_confidence", block_length=8, cfg_scale=1.0),
        SamplingParams(strategy="threshold", block_length=8, cache="dual", precision_schedule="int8@0.5,fp32"),
    ]
    for params in special:
        engine = Engine(embedded.model, max_num_seqs=3)
        other = engine.submit(prompts[0], plain)
        engine.step()
        req = engine.submit(prompts[1], params)
        engine.run_until_idle()
        assert req.finish_reason == "stop" and req.output_ids == embedded.generate([prompts[1]], params)[0].token_ids
        assert other.output_ids == embedded.generate([prompts[0]], plain)[0].token_ids
        assert engine.stats.lockstep_steps == engine.stats.steps  # each cohort its own forward


def test_a_static_batch_runs_lockstep_and_mixed_blocks_run_per_row(embedded):
    """The lockstep fast path is taken for one cohort (a static batch: one compute window per
    step, no padding) and the per-row path for cohorts at different blocks; same tokens."""
    prompts = [embedded.encode(it.letters, True) for it in task.heldout(4)]
    params = SamplingParams(strategy="threshold", block_length=8, cache="dual")
    engine = Engine(embedded.model, max_num_seqs=4)
    batch = engine.submit_batch(prompts, params)
    engine.run_until_idle()
    st = engine.stats
    assert st.steps == st.lockstep_steps > 0 and st.per_row_steps == 0 and st.padded_tokens == 0
    engine = Engine(embedded.model, max_num_seqs=4)
    served = [engine.submit(prompts[0], params)]
    engine.step()
    served += [engine.submit(p, params) for p in prompts[1:]]
    engine.run_until_idle()
    assert engine.stats.per_row_steps > 0
    assert [r.output_ids for r in served] == [r.output_ids for r in batch]


def test_the_confidence_head_choice_is_one_rule_for_every_path():
    from dinfer_rt.decode import uses_confidence_head

    assert uses_confidence_head(SamplingParams(strategy="threshold"))
    assert not uses_confidence_head(SamplingParams(strategy="threshold", temperature=0.5))
    assert not uses_confidence_head(SamplingParams(strategy="threshold", cfg_scale=1.0))
    assert not uses_confidence_head(SamplingParams(strategy="credit"))
    assert not uses_confidence_head(SamplingParams(strategy="threshold"), EngineArgs(confidence_head=False))


@pytest.mark.parametrize(
    "args", [EngineArgs(sync_every=2), EngineArgs(confidence_head=False), EngineArgs(max_forward_tokens=20)]
)
def test_engine_settings_apply_to_every_request_and_keep_the_answers(embedded, args):
    """Engine settings (``EngineArgs``) are the engine's, not a request's: an engine built with
    them serves requests arriving mid-stream with the tokens ``LLM(..., **settings)`` decodes
    alone, which are those of the default settings (they trade syncs and memory, not answers)."""
    prompts = [embedded.encode(t, True) for t in ("qwertyuiop", "asdfghjklz", "zxcvbn")]
    configs = [
        dict(strategy="threshold", block_length=8, cache="delayed"),
        dict(strategy="entropy", block_length=8, steps=8, cache="dual"),
        dict(strategy="hierarchical", block_length=8),
    ]
    engine = Engine(embedded.model, args, max_num_seqs=4)
    assert engine.args.max_num_seqs == 4 and engine.args.sync_every == args.sync_every
    tuned = LLM(embedded.model, **dataclasses.asdict(args))
    for cfg in configs:
        params = SamplingParams(**cfg, gen_length=16)
        reqs = [engine.submit(prompts[0], params)]
        engine.step()
        reqs += [engine.submit(p, params) for p in prompts[1:]]
        engine.run_until_idle()
        for p, req in zip(prompts, reqs):
            alone = tuned.generate([p], params)[0]
            assert req.output_ids == alone.token_ids == embedded.generate([p], params)[0].token_ids
            if args.sync_every > 1:
                assert alone.stats.nfe % args.sync_every == 0


def test_a_static_batch_larger_than_the_engine_or_its_length_is_refused(embedded):
    engine = Engine(embedded.model, max_num_seqs=2, max_model_len=30)
    with pytest.raises(GenerationError, match="a batch of 3 prompts exceeds max_num_seqs 2"):
        engine.submit_batch([[7, 8]] * 3, SamplingParams())
    with pytest.raises(GenerationError, match="42 tokens exceed the engine's max model length 30"):
        engine.submit_batch([[7, 8]], SamplingParams())
    with pytest.raises(GenerationError, match=r"max_model_len 65 must be in \[1, 64\]"):  # never clamped silently
        Engine(embedded.model, max_model_len=65)


def test_review_defects_of_the_two_loops_are_fixed(embedded, ckpt_dir, capsys, tmp_path):
    """#37's review list: a data-parallel LLM over a loaded Model names the sizes it was given;
    a replica pool counts only the rows its replicas report running (not requests in transit);
    ``bench`` measures prompts that fit the model (``--prompt-len`` / ``--data``) and refuses the
    embedded task's prompts for another model."""
    from dinfer_rt.cli import main
    from dinfer_rt.workers import ReplicaPool

    with pytest.raises(GenerationError, match="data_parallel_size=2: worker processes load the model"):
        LLM(embedded.model, data_parallel_size=2)
    pool = ReplicaPool.__new__(ReplicaPool)
    pool.inflight = {"a": None, "b": None, "c": None}  # three submitted, one not yet reported anywhere
    pool._reported = [{"running": 1, "waiting": 0}, {"running": 0, "waiting": 1}]
    assert pool.num_running == 1 and pool.num_waiting == 1
    path = str(ckpt_dir("llada"))
    args = ["bench", "--model", path, "--gen-length", "4", "--block-length", "4", "--iters", "1", "--warmup", "0"]
    assert main([*args, "--batch-size", "2"]) == 2
    assert "the embedded task's prompts fit only the embedded model" in capsys.readouterr().err
    assert main([*args, "--batch-size", "2", "--prompt-len", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["batch_size"] == 2
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hello"}\n')
    assert main([*args, "--model", str(dinfer_rt.loader.default_model_path()), "--data", str(data), "--json"]) == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gen-length", "64", "--block-length", "8"], "exceeds the max model length 64"),
        (["--gen-length", "40", "--max-model-len", "30"], "exceeds the max model length 30"),
        (["--model", "SDAR", "--cache", "delayed", "--gen-length", "8", "--block-length", "4"], "is not exact"),
    ],
)
def test_serve_refuses_at_start_up_defaults_every_request_would_be_refused_with(
    ckpt_dir, tmp_path, capsys, flags, message
):
    """A default the engine would refuse per request is one error before anything loads (the
    classifier-free guidance and precision-schedule defaults, refused before #37, now serve)."""
    from dinfer_rt.cli import main
    from dinfer_rt.testing import checkpoints

    if "SDAR" in flags:
        flags = [str(checkpoints.sdar(tmp_path / "sdar")) if f == "SDAR" else f for f in flags]
    assert main(["serve", "--port", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert "every request would be refused with these defaults" in err and message in err


def test_requests_waiting_together_decode_as_one_lockstep_cohort(embedded):
    """Requests that wait together with the same greedy settings are admitted as one cohort (one
    lockstep forward, as offline); their tokens are those of each request alone. Sampled ones
    (a cohort shares one generator) and ones arriving later keep their own cohorts."""
    prompts = [embedded.encode(t, True) for t in ("qwertyuiop", "asdfghjklz", "zxcvbn", "plmokn")]
    params = SamplingParams(strategy="threshold", block_length=8, cache="dual", gen_length=16)
    engine = Engine(embedded.model, max_num_seqs=3)
    reqs = [engine.submit(p, dataclasses.replace(params)) for p in prompts]  # equal settings, own objects
    engine.step()
    assert len(engine.cohorts) == 1 and engine.cohorts[0].b == 3  # bounded by max_num_seqs
    engine.run_until_idle()
    assert engine.stats.per_row_steps == 0 and engine.stats.lockstep_steps > 0
    for p, req in zip(prompts, reqs):
        assert req.output_ids == embedded.generate([p], params)[0].token_ids
    sampled = dataclasses.replace(params, temperature=0.7, seed=3)
    engine = Engine(embedded.model, max_num_seqs=3)
    reqs = [engine.submit(p, sampled) for p in prompts[:2]]
    engine.step()
    assert [c.b for c in engine.cohorts] == [1, 1]
    engine.run_until_idle()
    for p, req in zip(prompts, reqs):
        assert req.output_ids == embedded.generate([p], sampled)[0].token_ids


def test_a_stop_string_within_max_tokens_finishes_with_stop_even_when_both_meet_in_one_step(embedded):
    """max_tokens and a stop string reached in the same step: the stop cut the answer, so its
    reason is "stop" (it was "length": the max_tokens check ran first; from a server probe).
    Every (stop, max_tokens) pair of a raw prompt's answer: "stop" exactly when the uncut
    answer's first max_tokens tokens hold the stop string."""
    from dinfer_rt.stopping import first_stop

    model = embedded.model
    prompt = model.tokenizer.encode("qwertyuiop")  # raw, no chat template: an answer with many letters
    params = SamplingParams(block_length=8, strategy="threshold", threshold=0.9)
    engine = Engine(model, max_num_seqs=1)
    whole = engine.submit(prompt, params, max_tokens=40)
    engine.run_until_idle()
    checked = 0
    for stop in ("|", "e", "w", "uuu", "r|", "t"):
        for max_tokens in (8, 16, 24, 32):
            head = model.tokenizer.decode(whole.output_ids[:max_tokens])
            req = engine.submit(prompt, dataclasses.replace(params, stop=(stop,)), max_tokens=max_tokens)
            engine.run_until_idle()
            want = "stop" if first_stop(head, (stop,)) >= 0 else "length"
            assert req.finish_reason == want, (stop, max_tokens, head, req.text)
            checked += want == "stop"
    assert checked >= 6  # the case the fix is about occurs in this table
