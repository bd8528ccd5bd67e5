"""Tensor parallelism on gloo with real worker processes: sharded logits equal one process's,
greedy generation token for token, failures named by rank, configurations that cannot be split."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

import dinfer_rt
from dinfer_rt import parallel
from dinfer_rt.errors import ConfigError
from dinfer_rt.ir import Graph, TensorType, ops
from dinfer_rt.llm import generate_on_rank
from dinfer_rt.lowering import lower
from dinfer_rt.model_spec import parse_spec
from dinfer_rt.passes.shard import TensorParallel, shard_graph
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing import checkpoints


def _ends(text: str) -> str:
    """Both ends of a child's stderr: a rank's own abort message comes first, torchrun's summary last."""
    return text if len(text) <= 3000 else f"{text[:1000]}\n...\n{text[-2000:]}"


@pytest.fixture(scope="module")
def gqa_one_kv_head(tmp_path_factory):
    """Fewer KV heads than ranks: every rank holds the one KV head (replicated)."""
    return checkpoints.llada(tmp_path_factory.mktemp("gqa1"), heads=4, kv_heads=1, seed=11)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["llada", "dream_sharded_tied", "gqa"])
def test_sharded_logits_equal_one_process(ckpt_dir, gqa_one_kv_head, name, world):
    path = gqa_one_kv_head if name == "gqa" else ckpt_dir(name)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    want = dinfer_rt.load_model(path, backend="cpu").forward(ids)
    got = parallel.launch(world, parallel.forward_worker, path, ids, timeout=240)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def _bytes_worker(rank, world, path, expert_parallel=False):
    # launch's ranks meet through a file, not a port picked (and released) before they bind it
    assert "MASTER_PORT" not in os.environ and os.environ[parallel.RENDEZVOUS_ENV].startswith("file://")
    m = parallel.load_sharded(path, rank, world, expert_parallel=expert_parallel)
    return m.bytes_read, sum(w.numel() * w.element_size() for k, w in m.weights.items() if "|" not in k)


def test_each_rank_reads_and_holds_about_one_nth_of_the_weights(ckpt_dir):
    path = ckpt_dir("llada")
    whole = dinfer_rt.load_model(path, backend="cpu")
    spec = whole.spec
    total = whole.bytes_read
    split = sum(
        w.numel() * 4 for k, w in whole.weights.items() if "|" not in k and k.startswith("layers.") and
        k.split(".")[2] in ("q", "k", "v", "o", "gate", "up", "down")
    )  # fmt: skip
    head = whole.weights["lm_head"]
    lo, hi = ops.vocab_shard(spec.vocab, 0, 2)  # rank 0's rows of the vocabulary-parallel LM head
    head_saved = head.numel() * 4 - (hi - lo) * head.shape[1] * 4
    read, held = parallel.launch(2, _bytes_worker, path, timeout=240)
    assert read == total - split // 2 - head_saved and held == read  # replicated tensors whole, split ones halved
    assert spec.n_layers and read < 0.75 * total


def test_the_pass_splits_heads_and_inserts_two_all_reduces_per_layer(ckpt_dir):
    spec = parse_spec(ckpt_dir("llada_gqa_sharded"))  # 6 heads, 2 KV heads
    g = shard_graph(lower(spec, torch.float32, cached=True), spec, TensorParallel(1, 2))
    assert g.op_counts()["all_reduce"] == 2 * spec.n_layers
    heads = sorted({n.attrs["heads"] for n in g.nodes if n.op == "view_heads"})
    assert heads == [1, 3]  # 6 / 2 query heads, 2 / 2 KV heads
    cache = next(v for v in g.inputs if v.name == "k_cache.0")
    assert cache.type.shape[2] == 1
    q = next(p for p in g.params if p.name == "layers.0.q")
    assert q.type.shape[0] == 3 * spec.head_dim


def test_all_reduce_is_the_identity_over_a_group_of_one():
    g = Graph("ar")
    x = g.input("x", TensorType(("B", 4), torch.float32))
    g.output("y", g.op("all_reduce", x, op="sum"))
    t = torch.randn(3, 4)
    assert torch.equal(ops.all_reduce(t, op="max"), t)
    with pytest.raises(Exception, match="op must be one of"):
        g.op("all_reduce", x, op="mean")


def test_greedy_generation_with_two_ranks_equals_one(monkeypatch):
    llm = dinfer_rt.LLM()
    prompts = ["qwertyuiop", "asdfghjklz", "abc"]  # "abc": a shorter, left-padded row
    for params in (
        SamplingParams(strategy="threshold", block_length=8, cache="dual"),
        SamplingParams(strategy="low_confidence", block_length=8, cache="dual"),
    ):
        want = [(o.text, o.token_ids) for o in llm.generate(prompts, params)]
        got = parallel.launch(2, generate_on_rank, None, prompts, params, timeout=240)
        assert [(o.text, o.token_ids) for o in got] == want


def test_generate_under_torchrun_and_with_spawned_workers_print_the_one_process_answer(tmp_path):
    import subprocess
    import sys

    want = dinfer_rt.LLM().generate(["qwertyuiop"], SamplingParams())[0].text
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for cmd in (
        [*torchrun, "-m", "dinfer_rt", "generate", "--tensor-parallel-size", "2", "qwertyuiop"],
        [sys.executable, "-m", "dinfer_rt", "generate", "--tensor-parallel-size", "2", "qwertyuiop"],
    ):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
        assert r.returncode == 0, _ends(r.stderr)
        assert r.stdout.strip() == want  # rank 0 prints once
    bad = subprocess.run(
        [sys.executable, "-m", "dinfer_rt", "generate", "--tensor-parallel-size", "4", "abc"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (
        bad.returncode == 2
        and bad.stderr.strip() == "error: tensor parallel size 4 does not divide the 6 attention heads (n_heads)"
    )


_LEAVE_SCRIPT = """
import os, tempfile, torch, torch.distributed as dist
from dinfer_rt import parallel
from dinfer_rt.ir import ops
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
os.environ[parallel.RENDEZVOUS_ENV] = "file://" + os.path.join(tempfile.mkdtemp(), "store")
parallel.init_group("cpu", 0, 1)
dist.all_reduce(torch.ones(3), group=ops.COLLECTIVE_GROUPS["tp"])
joined = threads()
parallel.leave_group(wait=True)
parallel.leave_group(wait=True)  # idempotent
print(before, joined, threads(), dist.is_initialized(), len(ops.COLLECTIVE_GROUPS))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_leave_group_joins_gloo_threads_before_interpreter_shutdown():
    """A group the IR still references outlives destroy_process_group, and its gloo threads then
    run into interpreter shutdown, where releasing a collective's tensors aborts the process
    (the CI flake: SIGABRT under torchrun). leave_group must drop the reference and join them."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _LEAVE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, _ends(r.stderr)
    before, joined, after, initialized, groups = r.stdout.split()
    assert int(joined) > int(before)  # gloo started its worker threads
    assert (int(after), initialized, groups) == (int(before), "False", "0")


@pytest.mark.parametrize("tp", [1, 2])
def test_data_parallel_replicas_split_the_prompts_and_keep_their_order(tp):
    prompts = ["qwertyuiop", "asdfghjklz", "zxcvbnmlkj", "plmoknijbu", "mnbvcxzlkj"]  # 5: uneven split
    params = SamplingParams(strategy="threshold", block_length=8)
    want = [(o.text, o.token_ids) for o in dinfer_rt.LLM().generate(prompts, params)]
    with dinfer_rt.LLM(tensor_parallel_size=tp, data_parallel_size=2) as llm:
        outs = llm.generate(prompts, params)
        assert [(o.text, o.token_ids) for o in outs] == want
        assert all(served >= 2 for served in llm.pool.served)  # both replicas answered


def test_a_tensor_parallel_llm_keeps_its_ranks_across_generate_calls():
    """``LLM(tensor_parallel_size=2)`` starts its two ranks once: every generate call answers as
    one process does, and the second call starts no process and loads nothing (the same rank
    processes, which loaded their shards once)."""
    import multiprocessing

    one = dinfer_rt.LLM()
    prompts = ["qwertyuiop", "asdfghjklz", "abc"]
    with dinfer_rt.LLM(tensor_parallel_size=2) as llm:
        ranks = [p.pid for group in llm.pool.ranks for p in group]
        assert len(ranks) == 2 and all(llm.pool.alive)
        for params in (
            SamplingParams(strategy="threshold", block_length=8, cache="dual"),
            SamplingParams(strategy="low_confidence", block_length=8, cache="prefix"),
        ):
            before = {p.pid for p in multiprocessing.active_children()}
            got = llm.generate(prompts, params)
            assert [(o.text, o.token_ids) for o in got] == [
                (o.text, o.token_ids) for o in one.generate(prompts, params)
            ]
            assert {p.pid for p in multiprocessing.active_children()} == before  # no process started
            assert [p.pid for group in llm.pool.ranks for p in group] == ranks and all(llm.pool.alive)
    assert not any(p.pid in ranks for p in multiprocessing.active_children())  # close() stopped them


def _serve_in_steps(engine, prompts, params):
    """Request 0 (a shorter output) alone for two steps, then the others: cohorts at different
    blocks share per-row forwards, and when request 0 ends the later rows move in the KV pool."""
    reqs = [engine.submit(prompts[0], dataclasses.replace(params, gen_length=8))]
    engine.step()
    engine.step()
    reqs += [engine.submit(p, params) for p in prompts[1:]]
    engine.run_until_idle()
    return [r.output_ids for r in reqs]


def _prefix_cache_on_rank_0(model, group, prompts, params):
    """A block-causal model's exact prefix cache on a tensor-parallel paged pool: each prompt twice
    (the second hits the first's blocks), the answers and the hit tokens (rank 0's part)."""
    from dinfer_rt.engine import Engine
    from dinfer_rt.model_runner import LeadRunner

    runner = LeadRunner(model, group, 0)
    try:
        engine = Engine(model, max_num_seqs=2, block_length=params.block_length, runner=runner)
        out = []
        for p in prompts + prompts:
            req = engine.submit(p, params)
            engine.run_until_idle()
            out.append((req.output_ids, req.cached_tokens))
    finally:
        runner.stop()
    return out


def _scheduler_on_rank_0(rank, world, prompts, params, block_causal=None):
    """Rank 0 runs the engine and decides; rank 1 only runs the forwards rank 0 sends. Then, on a
    block-causal checkpoint (``block_causal``: its path, prompts and params), the prefix cache."""
    from dinfer_rt.engine import Engine, run_batch
    from dinfer_rt.model_runner import LeadRunner, follow

    model = parallel.load_sharded(None, rank, world)
    group = ops.COLLECTIVE_GROUPS["tp"]
    causal = parallel.load_sharded(block_causal[0], rank, world, backend="cpu")
    if rank:
        return {"forwards": follow(model, group, 0) + follow(causal, group, 0)}
    runner = LeadRunner(model, group, 0)
    sent, send = [], runner.send
    runner.send = lambda msg: (sent.append(msg[0]), send(msg))[1]
    try:
        static = run_batch(model, prompts, params, runner=runner)
        engine = Engine(model, max_num_seqs=4, runner=runner)  # the paged pool: tables travel with the inputs
        served = _serve_in_steps(engine, prompts, params)
        rows = Engine(model, max_num_seqs=4, runner=runner, kv_block_size=0)  # contiguous rows: moves are sent
        served_rows = _serve_in_steps(rows, prompts, params)
        forwards = static.nfe + len(engine.forward_s) + len(rows.forward_s)
    finally:
        runner.stop()
    cached = _prefix_cache_on_rank_0(causal, group, *block_causal[1:])
    return {
        "static": static.tokens, "served": served, "served_rows": served_rows, "forwards": forwards, "sent": sent,
        "stats": engine.stats, "prefix_cache": cached,
    }  # fmt: skip


def test_rank_0_owns_the_scheduler_and_the_others_run_what_it_sends(tmp_path):
    """The seam of ``model_runner``: under tensor parallelism only rank 0 has an engine; rank 1
    runs exactly the forwards rank 0 sends (lockstep and per-row; a paged pool's block tables with
    the inputs, contiguous rows' moves as messages) and the answers equal one process's, static
    and served."""
    from dinfer_rt.engine import Engine, run_batch

    model = dinfer_rt.load_model()
    prompts = [model.tokenizer.encode(t) for t in ("qwertyuiop", "asdfghjklz", "abc")]
    params = SamplingParams(strategy="threshold", block_length=8, cache="dual", gen_length=16)
    want_static = run_batch(model, prompts, params).tokens
    want_served = _serve_in_steps(Engine(model, max_num_seqs=4), prompts, params)
    path = checkpoints.llada2(tmp_path / "llada2", heads=8, kv_heads=2, head_dim=12, partial=1.0, seed=9)
    system = [7, 19, 8, 30, 9, 41, 10, 52, 11, 23, 12, 34]  # 3 blocks of 4 shared by both prompts
    causal_prompts = [system + [13, 45], system + [20, 21, 22]]
    causal_params = SamplingParams(strategy="threshold", block_length=4, cache="dual", gen_length=8)
    alone = dinfer_rt.load_model(path, backend="cpu")
    want_causal = [dinfer_rt.LLM(alone).generate([p], causal_params)[0].token_ids for p in causal_prompts]
    lead, follower = parallel.launch(
        2, _scheduler_on_rank_0, prompts, params, (path, causal_prompts, causal_params), timeout=240, all_ranks=True
    )
    assert torch.equal(lead["static"], want_static) and lead["served"] == lead["served_rows"] == want_served
    # the prefix cache on the group's paged pool: every answer as one process alone; the second
    # request hits the first's three blocks, and each repeat hits its whole prompt blocks
    assert [ids for ids, _ in lead["prefix_cache"]] == want_causal + want_causal
    assert [hit for _, hit in lead["prefix_cache"]] == [0, 12, 12, 12]
    # rank 1 ran every forward rank 0 sent: the first model's (counted here) and the cache's after them
    assert lead["forwards"] == lead["sent"].count("run") and follower["forwards"] > lead["forwards"]
    # a paged pool is bound once and never moves; contiguous rows' moves went to the group too
    assert {"bind", "bind_paged", "move", "run"} <= set(lead["sent"])
    assert lead["stats"].per_row_steps > 0 and lead["stats"].lockstep_steps > 0


def _raises_on_rank_1(rank, world):
    if rank == 1:
        raise RuntimeError("planted failure")
    time.sleep(60)


def _dies_on_rank_1(rank, world):
    if rank == 1:
        os._exit(3)
    time.sleep(60)


def _hangs(rank, world):
    time.sleep(60)


def test_a_failing_rank_ends_the_run_naming_it():
    t0 = time.monotonic()
    with pytest.raises(parallel.ParallelError, match="rank 1 failed: RuntimeError: planted failure"):
        parallel.launch(2, _raises_on_rank_1, timeout=60)
    with pytest.raises(parallel.ParallelError, match="rank 1 died \\(exit code 3\\)"):
        parallel.launch(2, _dies_on_rank_1, timeout=60)
    with pytest.raises(parallel.ParallelError, match="did not finish within 3 s"):
        parallel.launch(2, _hangs, timeout=3)
    assert time.monotonic() - t0 < 50  # none waited for the 60 s sleep


@pytest.mark.parametrize(
    "name, world, message",
    [
        ("dream", 2, "does not divide the 7 attention heads"),
        ("llada_gqa_sharded", 4, "does not divide the 6 attention heads"),
        ("llada_moe", 2, "does not divide the 3 attention heads"),
        ("more_ranks_than_experts", 8, "more ranks than the 4 experts"),
        ("experts_do_not_divide", 4, "does not divide the 6 experts"),
        ("expert_intermediate", 8, "does not divide the experts' intermediate size 12"),
        ("llada2", 3, "does not divide the 4 attention heads"),
        ("dense_expert_parallel", 2, r"expert parallelism splits MoE experts over the ranks; this model \(llada\)"),
        ("one_rank_expert_parallel", 1, "MoE experts over tensor-parallel ranks; tensor parallel size 1 has one"),
    ],
)
def test_configurations_that_cannot_be_split_are_one_line_errors(ckpt_dir, tmp_path, name, world, message):
    expert_parallel = name in (
        "more_ranks_than_experts", "experts_do_not_divide", "dense_expert_parallel", "one_rank_expert_parallel"
    )  # fmt: skip
    if name == "dense_expert_parallel":  # a dense model has no experts to split: it was ignored
        name = "llada_gqa_sharded"
    if name == "one_rank_expert_parallel":  # one rank holds every expert (serve's ReplicaPool ignored it)
        name = "llada_moe"
    if name in ("more_ranks_than_experts", "expert_intermediate"):
        path = checkpoints.llada_moe(tmp_path, heads=8, head_dim=6, experts=4, top_k=2, inter=12)
    elif name == "experts_do_not_divide":
        path = checkpoints.llada_moe(tmp_path, heads=8, head_dim=6, experts=6, top_k=2)
    else:
        path = ckpt_dir(name)
    with pytest.raises(ConfigError, match=message):
        parallel.check_split(parse_spec(path), world, expert_parallel)


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """LLaDA-MoE with 8 experts and 4 heads; LLaDA2 with fused QKV, 2 KV heads (replicated at 4
    ranks), partial RoPE, a dense first layer, a shared expert and 8 grouped-routed experts."""
    return {
        "llada_moe": checkpoints.llada_moe(tmp_path_factory.mktemp("moe"), heads=4, head_dim=12, experts=8, top_k=3),
        "llada2": checkpoints.llada2(tmp_path_factory.mktemp("llada2")),
    }


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep", "tp_experts"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["llada_moe", "llada2"])
def test_moe_logits_equal_one_process(moe_checkpoints, name, world, expert_parallel):
    """Both ways of splitting the routed experts (whole experts per rank, or every expert's
    intermediate size) give the one-process logits."""
    path = moe_checkpoints[name]
    spec = parse_spec(path)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(4))
    block = spec.default_block_size if spec.block_causal else None
    want = dinfer_rt.load_model(path, backend="cpu").forward(ids, block_size=block)
    got = parallel.launch(world, parallel.forward_worker, path, ids, block, expert_parallel, timeout=240)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_expert_parallel_graph_and_bytes(moe_checkpoints):
    """Each rank holds E/N experts and routes with the whole router; per MoE layer one all-reduce
    for attention, one for the experts and one for the shared experts; dense layers two."""
    path = moe_checkpoints["llada2"]
    spec = parse_spec(path)
    ep = TensorParallel(1, 2, expert_parallel=True)
    g = shard_graph(lower(spec, torch.float32, block_size=spec.default_block_size), spec, ep)
    dense = sum(not spec.is_moe_layer(i) for i in range(spec.n_layers))
    moe_layers = spec.n_layers - dense
    assert g.op_counts()["all_reduce"] == 2 * dense + 3 * moe_layers
    moe = next(n for n in g.nodes if n.op == "moe_experts")
    assert moe.attrs["first_expert"] == 4 and moe.inputs[3].type.shape[0] == 4
    router = next(p for p in g.params if p.name.endswith("router"))
    assert router.type.shape[0] == 8  # replicated: every rank routes over all experts
    split = next(n for n in g.nodes if n.op == "split")
    assert split.attrs["sizes"] == (2 * spec.head_dim, spec.head_dim, spec.head_dim)  # 4/2 q heads, 2/2 kv heads
    read, held = parallel.launch(2, _bytes_worker, path, True, timeout=240)
    whole = dinfer_rt.load_model(path, backend="cpu")
    experts = sum(w.numel() * 4 for k, w in whole.weights.items() if k.endswith(("experts_gate_up", "experts_down")))
    assert read < whole.bytes_read - experts // 2 + 1 and held == read


def test_tensor_parallel_experts_graph_and_bytes(moe_checkpoints):
    """Without --expert-parallel every rank holds every expert's 1/N of the intermediate size
    (gate / up rows, down columns), routes over all experts and sums with one all-reduce; each
    rank reads at most half of the experts' bytes."""
    path = moe_checkpoints["llada_moe"]
    spec = parse_spec(path)
    g = shard_graph(lower(spec, torch.float32), spec, TensorParallel(0, 2))
    e, ei, h = spec.moe.n_experts, spec.moe.expert_intermediate, spec.hidden
    moe = next(n for n in g.nodes if n.op == "moe_experts")
    assert "first_expert" not in moe.attrs
    assert moe.inputs[3].type.shape == (e, ei, h) and moe.inputs[4].type.shape == (e, h, ei // 2)
    assert g.op_counts()["all_reduce"] == 2 * spec.n_layers
    whole = dinfer_rt.load_model(path, backend="cpu")
    shards = parallel.launch(2, _expert_slices_worker, path, all_ranks=True, timeout=240)
    for name in ("layers.0.experts_gate_up", "layers.0.experts_down"):
        w = whole.weights[name]
        if name.endswith("gate_up"):  # each rank: its rows of the gate half, then of the up half
            n = ei // 2
            gate = torch.cat([s[name][:, :n] for s in shards], 1)
            up = torch.cat([s[name][:, n:] for s in shards], 1)
            assert torch.equal(torch.cat([gate, up], 1), w)
        else:
            assert torch.equal(torch.cat([s[name] for s in shards], 2), w)
    experts = sum(w.numel() * 4 for k, w in whole.weights.items() if k.endswith(("experts_gate_up", "experts_down")))
    assert all(s["bytes_read"] <= whole.bytes_read - experts // 2 for s in shards)


def _expert_slices_worker(rank, world, path):
    m = parallel.load_sharded(path, rank, world)
    names = ("layers.0.experts_gate_up", "layers.0.experts_down")
    return {"bytes_read": m.bytes_read, **{k: m.weights[k] for k in names}}


def test_loading_a_shard_without_a_process_group_is_refused(ckpt_dir):
    with pytest.raises(ConfigError, match="the process group has 1 rank\\(s\\), not 2"):
        dinfer_rt.load_model(ckpt_dir("llada"), backend="cpu", tensor_parallel=(0, 2))


def test_llm_eval_and_bench_take_the_tensor_parallel_size(tmp_path):
    """The Python API and the eval / bench commands run on worker ranks and give the one-process
    answers (eval's accuracy; bench reports its measurements)."""
    import json
    import subprocess
    import sys

    params = SamplingParams(strategy="threshold", block_length=8)
    prompts = ["qwertyuiop", "abc"]
    want = [(o.text, o.token_ids) for o in dinfer_rt.LLM().generate(prompts, params)]
    llm = dinfer_rt.LLM(tensor_parallel_size=2)
    assert llm.model is None
    assert [(o.text, o.token_ids) for o in llm.generate(prompts, params)] == want
    llm.close()
    with pytest.raises(dinfer_rt.errors.GenerationError, match="this LLM was closed"):
        llm.generate(prompts, params)  # named, not an AttributeError on the absent model
    # the lm-eval model: generation on the group, likelihood refused naming why
    from lm_eval.api.instance import Instance

    from dinfer_rt.lm_eval_model import DinferLM

    asks = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 16}), i) for i, p in enumerate(prompts)]
    alone = DinferLM(strategy="threshold", block_length=8).generate_until(asks, disable_tqdm=True)
    lm = DinferLM(strategy="threshold", block_length=8, tensor_parallel_size=2, expert_parallel="false")
    try:
        assert lm.generate_until(asks, disable_tqdm=True) == alone
        with pytest.raises(dinfer_rt.errors.DinferError, match="likelihood tasks need the model in this process"):
            lm.loglikelihood([Instance("loglikelihood", {}, ("ab", "c"), 0)], disable_tqdm=True)
    finally:
        lm.llm.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "dinfer_rt"]
    common = ["--strategy", "threshold", "--block-length", "8", "--json"]
    one = subprocess.run([*run, "eval", "--limit", "6", *common], capture_output=True, text=True, timeout=240, env=env)
    two = subprocess.run(
        [*run, "eval", "--limit", "6", "--tensor-parallel-size", "2", *common],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert json.loads(two.stdout)["accuracy"] == json.loads(one.stdout)["accuracy"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    under = subprocess.run(
        [*torchrun, "-m", "dinfer_rt", "eval", "--limit", "6", "--tensor-parallel-size", "2", *common],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert under.returncode == 0, _ends(under.stderr)
    (line,) = under.stdout.strip().splitlines()  # reported once, by rank 0
    assert json.loads(line)["accuracy"] == json.loads(one.stdout)["accuracy"]
    bench = subprocess.run(
        [*run, "bench", "--tensor-parallel-size", "2", "--iters", "1", "--warmup", "0", "--batch-size", "2", *common],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert json.loads(bench.stdout)["tokens_per_s"] > 0


def _confidence_worker(rank, world, path, ids, select, kind):
    from dinfer_rt.ir import ops as ir_ops

    model = parallel.load_sharded(path, rank, world)
    ir_ops.COLLECTIVE_BYTES.clear()
    score, token = model.confidence(ids, select=select, score=kind)
    graph = model.executable(False, head="confidence", score=kind).graph
    moved = ir_ops.COLLECTIVE_BYTES.get("tp/lm_head", 0)
    return score, token, graph.op_counts().get("vocab_parallel_confidence", 0), moved


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["max", "margin", "entropy"])
def test_vocabulary_parallel_confidence_head_equals_one_process(ckpt_dir, world, kind):
    """An untied LM head split over the vocabulary (61 rows: uneven shards): the distributed
    confidence head gives the one-process scores (fp32 1e-5) and argmax, and moves a few numbers
    per position instead of the logits."""
    path = ckpt_dir("llada")
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(5))
    ids[:, 6:] = 5  # masked slots, as the scheduler asks
    select = torch.arange(4, 12)
    want_s, want_t = dinfer_rt.load_model(path, backend="cpu").confidence(ids, select=select, score=kind)
    got_s, got_t, fused, moved = parallel.launch(world, _confidence_worker, path, ids, select, kind, timeout=240)
    assert fused == 1 and torch.equal(got_t, want_t)
    assert ((got_s - want_s).abs().max() / want_s.abs().max()).item() <= 1e-5
    logits_bytes = 2 * 8 * 61 * 4
    assert 0 < moved < logits_bytes  # statistics, not the [positions x vocab] logits


def test_generate_with_expert_parallel_flag_prints_the_one_process_tokens(moe_checkpoints):
    """``dinfer-rt generate --tensor-parallel-size 2 [--expert-parallel]`` on LLaDA-MoE: the same
    token ids as one process either way."""
    import json
    import subprocess
    import sys

    path = str(moe_checkpoints["llada_moe"])
    run = [sys.executable, "-m", "dinfer_rt", "generate", "--model", path, "--json", "--gen-length", "8"]
    run += ["--block-length", "4", "--strategy", "low_confidence", "abcde"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ids = []
    for extra in ([], ["--tensor-parallel-size", "2"], ["--tensor-parallel-size", "2", "--expert-parallel"]):
        r = subprocess.run([*run, *extra], capture_output=True, text=True, timeout=240, env=env)
        assert r.returncode == 0, _ends(r.stderr)
        ids.append(json.loads(r.stdout.strip().splitlines()[-1])["token_ids"])
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 8


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_expert_dispatch_equals_one_process(world):
    """The measured alternative to the runtime's all-reduce combine (benchmarks/moe_dispatch_bench.py):
    all-to-all dispatch and combine give the one-process MoE output (fp32 1e-5), with a token
    count the ranks do not divide; the all-reduce path agrees too."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import moe_dispatch_bench as bench

    shape = {"tokens": 7, "hidden": 16, "inter": 8, "experts": 8, "top": 3, "seed": 1}
    want = bench.reference(shape)
    got = parallel.launch(world, bench.dispatch_worker, shape, 1, timeout=240)
    for name in ("all_reduce", "all_to_all"):
        assert ((got[name]["out"] - want).abs().max() / want.abs().max()).item() <= 1e-5, name
    assert got["all_to_all"]["sent"] > 0 and got["all_reduce"]["sent"] == 2 * (world - 1) * 7 * 16 // world


def test_more_ranks_than_visible_devices_is_a_one_line_error(monkeypatch):
    """One device per rank: ``launch`` and ``init_group`` refuse more local ranks than the
    backend's visible devices before any process starts (CPU ranks share the host)."""

    class TwoGpus:
        name, device_type = "cuda", "cuda"

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    parallel.check_devices(TwoGpus(), 2)
    with pytest.raises(parallel.ParallelError, match=r"^4 ranks on this machine but backend cuda sees 2 cuda device"):
        parallel.check_devices(TwoGpus(), 4)
    parallel.check_devices(dinfer_rt.plugins.select_backend("cpu"), 64)


def test_worker_threads_follow_the_cpu_affinity_not_the_machine(monkeypatch):
    """Under ``taskset -c 0`` (or a container's CPU set) a worker gets one thread per usable CPU,
    not ``os.cpu_count()``'s: more would oversubscribe the cores it may run on."""
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(parallel.os, "cpu_count", lambda: 64)
    assert parallel.usable_cpus() == 1
    assert parallel.threads_per_process(1) == 1 and parallel.threads_per_process(4) == 1
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert parallel.threads_per_process(2) == 4
