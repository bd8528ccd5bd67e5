"""lm-evaluation-harness end to end with ``--model dinfer_rt`` on the embedded model: a local task
YAML and JSONL (no hub), the harness's own CLI and metrics, compared with ``dinfer-rt eval --data``
on the same items; and the model's likelihood requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dinfer_rt.demo import task

pytest.importorskip("lm_eval")

N_ITEMS = 12
# The sorted part, cut at the stop string "#": "perm|sorted" -> group 1 must equal the gold letters.
REGEX = r"\|([a-z]+)$"


def _task_dir(tmp_path, items):
    data = tmp_path / "letters.jsonl"
    gold = lambda it: "".join(sorted(it.letters))  # noqa: E731
    # One gold answer is wrong on purpose, so the accuracy is not trivially 1.
    rows = [{"prompt": it.letters, "answer": gold(it) if i else it.letters} for i, it in enumerate(items)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "letters.yaml").write_text(
        f"""task: letters_sorted
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["#"]
  max_gen_toks: 36
filter_list:
  - name: sorted_part
    filter:
      - function: regex
        regex_pattern: '{REGEX}'
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
    )
    return data, tmp_path / "tasks"


def _harness(tmp_path, tasks, launcher: list[str]):
    """Run lm-eval's CLI with dinfer_rt registered; (accuracy, logged samples)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["OMP_NUM_THREADS"] = "1"
    model_args = "strategy=threshold,threshold=0.9,block_length=8"
    out = tmp_path / f"out{len(launcher)}"
    cmd = [*launcher, "dinfer_rt.lm_eval_model", "--model", "dinfer_rt", "--model_args", model_args]
    cmd += ["--tasks", "letters_sorted", "--include_path", str(tasks), "--apply_chat_template"]
    cmd += ["--output_path", str(out), "--log_samples", "--batch_size", "12"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob("samples_letters_sorted_*.jsonl")).read_text().splitlines()]
    return results["results"]["letters_sorted"]["exact_match,sorted_part"], samples


def test_lm_eval_generate_until_matches_dinfer_rt_eval(tmp_path):
    items = task.heldout(N_ITEMS)
    data, tasks = _task_dir(tmp_path, items)
    harness_acc, samples = _harness(tmp_path, tasks, [sys.executable, "-m"])
    assert len(samples) == N_ITEMS
    for s in samples:  # the stop string cut the text before "#": the reversed part is never returned
        text = s["resps"][0][0]
        assert "#" not in text and text.count("|") == 1, text

    argv = ["eval", "--data", str(data), "--metric", "regex", "--regex", REGEX, "--stop", "#", "--json"]
    argv += ["--strategy", "threshold", "--threshold", "0.9", "--block-length", "8", "--gen-length", "40"]
    proc = subprocess.run([sys.executable, "-m", "dinfer_rt", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ours = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ours["n"] == N_ITEMS
    assert harness_acc == pytest.approx(ours["accuracy"])
    assert harness_acc == pytest.approx((N_ITEMS - 1) / N_ITEMS)  # every item but the planted wrong gold


def test_lm_eval_data_parallel_over_two_gloo_ranks(tmp_path):
    """torchrun with two ranks: lm-eval splits the requests by rank, gathers over gloo, and rank 0
    reports the same accuracy and the same answers as one process."""
    items = task.heldout(N_ITEMS)
    _, tasks = _task_dir(tmp_path, items)
    one_acc, one = _harness(tmp_path, tasks, [sys.executable, "-m"])
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    two_acc, two = _harness(tmp_path, tasks, launcher)
    assert two_acc == pytest.approx(one_acc)
    by_doc = lambda rows: {r["doc_id"]: r["resps"] for r in rows}  # noqa: E731
    assert by_doc(two) == by_doc(one)


def test_lm_eval_likelihood_requests(tmp_path):
    """``loglikelihood`` through the harness's Instance objects: the right continuation scores
    higher and is greedy, a corrupted one neither; rolling scores are finite and seeded."""
    from lm_eval.api.instance import Instance

    from dinfer_rt.lm_eval_model import DinferLM

    lm = DinferLM(mc_num=8, mc_batch_size=8)
    it = task.heldout(1)[0]
    ctx = lm.apply_chat_template([{"role": "user", "content": it.letters}]) + it.answer().split("#")[0] + "#"
    reqs = [
        Instance("loglikelihood", {}, (ctx, it.letters[::-1]), 0),
        Instance("loglikelihood", {}, (ctx, it.letters), 1),
    ]
    (good, good_greedy), (bad, bad_greedy) = lm.loglikelihood(reqs, disable_tqdm=True)
    assert good > bad and good_greedy and not bad_greedy
    rolling = [Instance("loglikelihood_rolling", {}, (it.prompt + it.answer(),), 0)]
    a = lm.loglikelihood_rolling(rolling, disable_tqdm=True)
    assert a == lm.loglikelihood_rolling(rolling, disable_tqdm=True) and a[0] < 0
    assert lm.rank == 0 and lm.world_size == 1


def test_unknown_model_args_are_refused_naming_them():
    from dinfer_rt.errors import DinferError
    from dinfer_rt.lm_eval_model import DinferLM

    with pytest.raises(DinferError, match="unknown argument\\(s\\) treshold for dinfer_rt"):
        DinferLM(treshold=0.9)
