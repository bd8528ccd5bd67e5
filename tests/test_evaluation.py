"""Evaluation building blocks (issue #17): stop strings in the scheduler, ``eval --data`` on a JSONL
file, and the masked-diffusion log-likelihood, all on the embedded model."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

import dinfer_rt
from dinfer_rt.demo import task
from dinfer_rt.evaluation import wilson
from dinfer_rt.likelihood import loglikelihood
from dinfer_rt.sampling import SamplingParams


@pytest.fixture(scope="module")
def llm():
    return dinfer_rt.LLM()


def _params(**kw):
    return SamplingParams(strategy="threshold", block_length=8, batch_size=8, **kw)


def test_stop_string_cuts_the_text_and_saves_forwards(llm):
    prompts = [it.letters for it in task.heldout(8)]
    full = llm.generate(prompts, _params(early_stop=False))
    cut = llm.generate(prompts, _params(early_stop=False, stop=("|",)))
    for f, c in zip(full, cut):
        assert "|" in f.text
        assert c.text == f.text.split("|")[0]  # cut before the stop string, as OpenAI does
        assert llm.model.tokenizer.decode(c.token_ids) == c.text
    # "|" is answer slot 10, final once block 2 (slots 8-15) is done: blocks 3-5 never run.
    assert cut[0].stats.nfe < full[0].stats.nfe


def test_stop_strings_any_of_several_and_one_never_produced(llm):
    prompt = task.heldout(1)[0].letters
    text = llm.generate(prompt, _params())[0].text
    sorted_part = text.split("|")[1].split("#")[0]
    got = llm.generate(prompt, _params(stop=("#", "zz-never")))[0]
    assert got.text == text.split("#")[0] and got.text.endswith(sorted_part)
    assert llm.generate(prompt, _params(stop=("zz-never",)))[0].text == text


def _write(path, items, answer):
    path.write_text("".join(json.dumps({"question": it.letters, "gold": answer(it)}) + "\n" for it in items))
    return path


def test_eval_data_regex_metric_table_and_per_item_file(tmp_path):
    items = task.heldout(20)
    data = _write(tmp_path / "sorted.jsonl", items, lambda it: "".join(sorted(it.letters)))
    out = tmp_path / "res" / "items.jsonl"
    argv = ["eval", "--data", str(data), "--prompt-field", "question", "--answer-field", "gold"]
    argv += ["--metric", "regex", "--regex", r"\|([a-z]+)#", "--strategy", "threshold", "--block-length", "8"]
    proc = subprocess.run(
        [sys.executable, "-m", "dinfer_rt", *argv, "--output", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "accuracy         1.0000 (20/20)" in proc.stdout
    lo, hi = wilson(20, 20)
    assert f"[{lo:.4f}, {hi:.4f}]" in proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == list(range(1, 21))
    assert all(r["correct"] and r["extracted"] == r["answer"] for r in rows)


def test_eval_data_metrics_agree_with_the_embedded_checker(llm, tmp_path):
    from dinfer_rt.evaluation import evaluate_file

    items = task.heldout(16)
    params = _params()
    outs = llm.generate([it.letters for it in items], params)
    # exact match against the model's own outputs: 100%; against a wrong answer: 0%
    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps({"prompt": it.letters, "answer": o.text}) + "\n" for it, o in zip(items, outs)))
    assert evaluate_file(llm, params, own, progress=False).accuracy == 1.0
    wrong = _write(tmp_path / "wrong.jsonl", items, lambda it: it.letters)
    fields = dict(prompt_field="question", answer_field="gold", progress=False)
    r = evaluate_file(llm, params, wrong, metric="exact", **fields)
    assert r.accuracy == 0.0 and r.ci_low == 0.0 and 0 < r.ci_high < 0.25
    rev = _write(tmp_path / "rev.jsonl", items, lambda it: "#" + it.letters[::-1])
    assert evaluate_file(llm, params, rev, metric="contains", **fields).accuracy == 1.0


def test_wilson_interval_matches_known_values():
    lo, hi = wilson(8, 10)  # textbook: [0.490, 0.943]
    assert abs(lo - 0.4902) < 1e-3 and abs(hi - 0.9433) < 1e-3
    assert wilson(0, 5)[0] == 0.0 and wilson(5, 5)[1] == 1.0


def _context(llm, letters: str) -> list[int]:
    tok = llm.model.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": letters}]))


def _corrupt(answer: str, rng: random.Random) -> str:
    """Swap two letters of the sorted part: a wrong answer one edit away."""
    perm, rest = answer.split("|")
    srt, rev = rest.split("#")
    i, j = rng.sample(range(len(srt)), 2)
    s = list(srt)
    s[i], s[j] = s[j], s[i]
    return perm + "|" + "".join(s) + "#" + rev


def test_loglikelihood_ranks_the_right_answer_above_a_corrupted_one(llm):
    tok, rng = llm.model.tokenizer, random.Random(0)
    items = task.heldout(40)
    wins = 0
    for it in items:
        ctx = _context(llm, it.letters)
        good, bad = it.answer(), _corrupt(it.answer(), rng)
        lg = loglikelihood(llm.model, ctx, tok.encode(good), mc_num=16, batch_size=16, greedy_check=False)
        lb = loglikelihood(llm.model, ctx, tok.encode(bad), mc_num=16, batch_size=16, greedy_check=False)
        wins += lg.logprob > lb.logprob
    assert wins / len(items) >= 0.95


def test_loglikelihood_is_deterministic_and_its_error_shrinks_with_mc_num(llm):
    tok = llm.model.tokenizer
    it = task.heldout(1)[0]
    ctx, cont = _context(llm, it.letters), tok.encode(it.answer())
    a = loglikelihood(llm.model, ctx, cont, mc_num=16, seed=3)
    b = loglikelihood(llm.model, ctx, cont, mc_num=16, seed=3)
    assert a == b
    assert loglikelihood(llm.model, ctx, cont, mc_num=16, seed=4).logprob != a.logprob
    big = loglikelihood(llm.model, ctx, cont, mc_num=64, batch_size=32, seed=3, greedy_check=False)
    assert big.stderr < a.stderr
    assert a.logprob < 0


def test_greedy_flag_tells_the_deterministic_part_from_a_wrong_one(llm):
    tok = llm.model.tokenizer
    it = task.heldout(2)[1]
    # Context: the prompt and the answer up to "#"; continuation: the reversed prompt, fully determined.
    head = tok.apply_chat_template([{"role": "user", "content": it.letters}]) + it.answer().split("#")[0] + "#"
    ctx = tok.encode(head)
    right = loglikelihood(llm.model, ctx, tok.encode(it.letters[::-1]), mc_num=8, batch_size=8)
    wrong = loglikelihood(llm.model, ctx, tok.encode(it.letters), mc_num=8, batch_size=8)
    assert right.is_greedy and not wrong.is_greedy
    assert right.logprob > wrong.logprob
