"""The KV pool's byte budget over contiguous rows (``kv_block_size=0``; the paged pool, the
default, is ``tests/test_paged_engine.py``): ``--kv-cache-memory`` /
``--kv-cache-memory-fraction`` (``EngineArgs.kv_cache_memory`` / ``kv_cache_memory_fraction``) size
the engine's rows as min(max_num_seqs, budget // bytes per row), with one arithmetic
(``kv_pool.kv_pool_plan``) for the engine and ``serve``'s start-up check; a budget below one row is
an error naming the numbers; a served budget of two rows answers four concurrent requests as
``LLM.generate`` does."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest
import torch

import dinfer_rt
from dinfer_rt.cli import _byte_size, _fraction, _kv_budget_args, build_parser, main
from dinfer_rt.demo import task
from dinfer_rt.engine import Engine
from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import DinferError, GenerationError
from dinfer_rt.kv_pool import kv_pool_plan, kv_row_bytes
from dinfer_rt.llm import LLM
from dinfer_rt.loader import default_model_path
from dinfer_rt.model_spec import parse_spec
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.server import ServeConfig, check_pool, kv_pool_summary
from dinfer_rt.testing.serving import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
PARAMS = SamplingParams(strategy="threshold", block_length=8)
EMBEDDED_ROW = 2 * 6 * 65 * 6 * 32 * 4  # the embedded model's row: K and V x 6 layers x 65 positions x 6 x 32 x fp32


@pytest.fixture(scope="module")
def embedded():
    return LLM()


@pytest.fixture(scope="module")
def gqa(ckpt_dir):
    return dinfer_rt.load_model(ckpt_dir("llada_gqa_sharded"), backend="cpu")  # 6 heads, 2 KV heads


def allocated(engine: Engine) -> int:
    return sum(t.nbytes for t in (*engine.cache.k, *engine.cache.v))


def test_budget_to_rows_arithmetic_equals_the_allocated_tensors(gqa, monkeypatch):
    s = gqa.spec
    row = kv_row_bytes(s, torch.float32, 21)
    assert s.n_kv_heads == 2 and row == 2 * s.n_layers * 21 * 2 * s.head_dim * 4
    cases = [  # (engine fields, rows decoded at once)
        ({"max_num_seqs": 3}, 3),  # no budget: max_num_seqs rows
        ({"max_num_seqs": 8, "kv_cache_memory": 3 * row - 1}, 2),  # budget // row
        ({"max_num_seqs": 8, "kv_cache_memory": 3 * row}, 3),
        ({"max_num_seqs": 4, "kv_cache_memory": 100 * row}, 4),  # min(max_num_seqs, ...)
    ]
    for fields, rows in cases:
        engine = Engine(gqa, kv_block_size=0, max_model_len=20, prefix_cache_bytes=0, **fields)
        assert engine.max_num_seqs == engine.args.max_num_seqs == engine.pool_rows == rows, fields
        assert engine.kv_pool_bytes == allocated(engine) == rows * row, fields
        assert engine.kv_pool_bytes <= fields.get("kv_cache_memory", engine.kv_pool_bytes)
        engine.release()
    no_scratch = Engine(
        gqa, kv_block_size=0, max_model_len=20, max_num_seqs=8, kv_cache_memory=3 * row, scratch_slot=False
    )
    assert no_scratch.kv_pool_bytes == allocated(no_scratch) == 3 * kv_row_bytes(s, torch.float32, 20)
    no_scratch.release()
    # a fraction of the free memory after the weights (the CPU's MemAvailable, here 10 rows)
    monkeypatch.setattr(dinfer_rt.engine, "available_memory", lambda device: 10 * row)
    engine = Engine(gqa, kv_block_size=0, max_model_len=20, max_num_seqs=8, kv_cache_memory_fraction=0.25)
    assert engine.max_num_seqs == 2 and engine.kv_plan.budget == int(2.5 * row) and allocated(engine) == 2 * row
    assert "2 rows decode at once (--max-num-seqs 8: the budget holds 2)" in kv_pool_summary(engine, 8)
    engine.release()
    monkeypatch.setattr(dinfer_rt.engine, "available_memory", lambda device: None)
    with pytest.raises(GenerationError, match="free memory of this device is unknown; give the budget in bytes"):
        Engine(gqa, kv_block_size=0, kv_cache_memory_fraction=0.5)


def test_graph_padding_rows_only_as_far_as_the_budget_holds_them(ckpt_dir, monkeypatch):
    from tests.test_graph_buckets import ARGS, decode, eager, graphed_model, prompts

    model, _ = graphed_model(ckpt_dir("llada"), monkeypatch)
    row = kv_pool_plan(model.spec, model.dtype, EngineArgs(), model.spec.max_length).row_bytes
    roomy = Engine(model, kv_block_size=0, max_num_seqs=6, kv_cache_memory=10 * row, **ARGS)
    assert (roomy.max_num_seqs, roomy.pool_rows, roomy.graph_buckets) == (6, 8, (1, 2, 4, 8))
    roomy.release()
    tight = Engine(model, kv_block_size=0, max_num_seqs=8, kv_cache_memory=6 * row + 5, **ARGS)
    assert (tight.max_num_seqs, tight.pool_rows, tight.graph_buckets) == (6, 6, (1, 2, 4, 8))
    assert tight.kv_pool_bytes == allocated(tight) == 6 * row
    batch = prompts(5, seed=3)  # bucket 8 > the 6 pool rows: eager, same tokens
    assert decode(tight, batch) == eager(dinfer_rt.load_model(ckpt_dir("llada"), backend="cpu"), batch)
    assert tight.stats.eager_forwards == tight.stats.steps > 0
    tight.release()


def test_a_budget_below_one_row_is_an_error_naming_the_numbers(gqa, capsys):
    row = kv_row_bytes(gqa.spec, torch.float32, 21)
    with pytest.raises(GenerationError) as e:
        Engine(gqa, kv_block_size=0, max_model_len=20, kv_cache_memory=row - 1)
    msg = str(e.value)
    parts = (f"budget of {row - 1} bytes", f"one row needs {row} bytes", "2 KV heads", "--kv-cache-memory")
    for part in (*parts, "21 positions (max_model_len 20 + 1 scratch)", "--max-model-len (20)"):
        assert part in msg, (part, msg)
    # serve's start-up check: the same arithmetic and message, before anything is loaded
    config = ServeConfig(max_model_len=20, engine_args={"kv_cache_memory": row - 1, "kv_block_size": 0})
    with pytest.raises(DinferError, match=f"serve: the KV-cache budget of {row - 1} bytes .* one row needs {row} "):
        check_pool(gqa.spec, torch.float32, torch.device("cpu"), config)
    assert check_pool(gqa.spec, torch.float32, torch.device("cpu"), ServeConfig(max_model_len=20)) == 20
    assert main(["serve", "--port", "1", "--kv-cache-memory", "1KiB", "--kv-block-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "budget of 1024 bytes (1.0 KiB; kv_cache_memory, --kv-cache-memory) holds no pool row" in err
    assert f"one row needs {EMBEDDED_ROW} bytes" in err
    for bad, message in (
        ({"kv_cache_memory": 1, "kv_cache_memory_fraction": 0.5}, "both given"),
        ({"kv_cache_memory_fraction": 0.0}, "must be a number in \\(0, 1\\]"),
        ({"kv_cache_memory_fraction": 1.5}, "must be a number in \\(0, 1\\]"),
        ({"kv_cache_memory": 0}, "kv_cache_memory must be an int >= 1"),
    ):
        with pytest.raises(GenerationError, match=message):
            EngineArgs.build(**bad)


def test_a_request_past_the_model_length_names_its_kv_bytes(embedded):
    engine = Engine(embedded.model, kv_block_size=0, max_num_seqs=1)
    assert engine.kv_bytes_per_position * 65 == EMBEDDED_ROW
    with pytest.raises(GenerationError) as e:
        engine.submit([5] * 30, PARAMS)  # 30 + 40 = 70 > 64
    per = EMBEDDED_ROW // 65
    assert "70 tokens exceeds the max model length 64 (its K/V would need" in str(e.value)
    assert f"{70 * per} bytes: 70 positions x {per} bytes; a KV pool row holds 64 positions" in str(e.value)


def test_two_rows_of_budget_decode_four_requests_two_at_a_time(embedded):
    engine = Engine(
        embedded.model, kv_block_size=0, max_num_seqs=8, kv_cache_memory=2 * EMBEDDED_ROW + EMBEDDED_ROW // 2
    )
    assert engine.max_num_seqs == 2 and engine.kv_pool_bytes == 2 * EMBEDDED_ROW
    prompts = [embedded.encode(item.letters, True) for item in task.heldout(4)]
    reqs = [engine.submit(p, PARAMS) for p in prompts]
    most = 0
    while engine.has_work():
        engine.step()
        most = max(most, engine.num_running)
    assert most == 2
    for p, req in zip(prompts, reqs):
        assert req.finish_reason == "stop" and req.output_ids == embedded.generate([p], PARAMS)[0].token_ids


def test_serve_with_a_two_row_budget_answers_four_concurrent_requests_as_offline(embedded):
    s = ServerProcess(
        "--strategy", "threshold", "--block-length", "8", "--max-num-seqs", "8",
        "--kv-cache-memory", str(2 * EMBEDDED_ROW + 100), "--kv-block-size", "0", cwd=ROOT,
    )  # fmt: skip
    try:
        assert s.metric("dinfer_kv_pool_rows") == 2 and s.metric("dinfer_kv_pool_bytes") == 2 * EMBEDDED_ROW
        items = task.heldout(4)
        answers = s.chats([item.letters for item in items])
        for item, got in zip(items, answers):
            assert got == embedded.generate([item.letters], PARAMS)[0].text, item.letters
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
    finally:
        s.stop()


def test_flags_sizes_with_units_bad_values_and_both_flags(capsys):
    for text, want in (
        ("1073741824", 2**30), ("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("512mib", 512 * 2**20),
        ("1.5G", 3 * 2**29), ("2KB", 2000), ("3 k", 3072), ("1TB", 10**12), ("100B", 100),
    ):  # fmt: skip
        assert _byte_size(text) == want, text
    for bad in ("8XB", "", "GiB", "-1", "0", "0.1B", "1e9", "nan", "1 GiB x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected bytes|at least 1 byte"):
            _byte_size(bad)
    assert _fraction("0.5") == 0.5 and _fraction("1") == 1.0
    for bad in ("0", "1.5", "nan", "-0.1", "half"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"\(0, 1\]"):
            _fraction(bad)
    parser = build_parser()
    a = parser.parse_args(["serve", "--kv-cache-memory", "8GiB"])
    assert _kv_budget_args(a) == {"kv_cache_memory": 8 * 2**30}
    a = parser.parse_args(["serve", "--kv-cache-memory-fraction", "0.9"])
    assert _kv_budget_args(a) == {"kv_cache_memory_fraction": 0.9}
    assert _kv_budget_args(parser.parse_args(["serve"])) == {}
    assert _kv_budget_args(parser.parse_args(["serve", "--kv-block-size", "0"])) == {"kv_block_size": 0}
    for argv, message in (
        (["--kv-cache-memory", "8XB"], "argument --kv-cache-memory: expected bytes or a size with a unit"),
        (["--kv-cache-memory-fraction", "2"], "argument --kv-cache-memory-fraction: must be in (0, 1], got '2'"),
        (["--kv-cache-memory", "1GiB", "--kv-cache-memory-fraction", "0.5"], "not allowed with argument"),
    ):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["serve", *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err, argv


def test_the_embedded_row_is_what_serve_measures():
    spec = parse_spec(default_model_path())
    assert kv_row_bytes(spec, torch.float32, spec.max_length + 1) == EMBEDDED_ROW
