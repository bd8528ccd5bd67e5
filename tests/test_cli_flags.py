"""The CLI refuses flags it would otherwise ignore or misread, by name, before anything loads:
rule-specific flags the run's strategy / cache does not read, empty lists and values, arguments
that are not UTF-8; and ``ir --backend`` treats every spelling of a backend alike."""

from __future__ import annotations

import builtins
import dataclasses

import pytest
import torch

from dinfer_rt import strategies
from dinfer_rt.cli import _params, build_parser, main
from dinfer_rt.sampling import STRATEGIES, SamplingParams


@pytest.fixture
def no_load(monkeypatch):
    """Nothing may resolve or load a model: each check below must come first."""
    import dinfer_rt.cli as cli
    import dinfer_rt.llm as llm_mod
    import dinfer_rt.loader as loader

    def loaded(*a, **k):
        raise AssertionError("a model was resolved or loaded before the flags were checked")

    monkeypatch.setattr(cli, "_resolve_model_args", loaded)
    monkeypatch.setattr(llm_mod.LLM, "__init__", loaded)
    monkeypatch.setattr(loader, "load_model", loaded)


def _refused(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


# ------------------------------------------------------------------ ir --backend


def test_ir_backend_treats_every_spelling_alike(capsys, monkeypatch):
    """An unavailable backend whose kernel table needs no runtime (cuda's Triton kernels) is
    annotated by name and by name:flavour:arch alike; one whose kernels are its runtime's
    operators (ascend without torch_npu) is refused with the reason, spelt either way."""
    monkeypatch.delenv("DINFER_INTERPRET", raising=False)
    for choice in ("cuda", "cuda:nvidia", "cuda::sm_90"):
        assert main(["ir", "--backend", choice]) == 0, choice
        assert f"# backend {choice}: " in capsys.readouterr().out
    for choice in ("ascend", "ascend:910b"):
        err = _refused(["ir", "--backend", choice], capsys)
        assert f"ir --backend {choice}: backend 'ascend' is unavailable: torch_npu is not installed" in err


def test_ir_backend_ascend_never_imports_torch_npu_where_it_cannot_work(capsys, monkeypatch):
    """torch_npu installed but CANN missing: refused with the probe's reason, no import tried."""
    import importlib.util

    from dinfer_rt.backends.ascend import plugin as ascend

    real_spec, real_import = importlib.util.find_spec, builtins.__import__
    tried = []

    def spy(name, *a, **k):
        if name == "torch_npu":
            tried.append(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "torch_npu" else real_spec(n, *a))
    monkeypatch.setattr(ascend, "find_cann_library", lambda name="hccl": None)
    monkeypatch.setattr(builtins, "__import__", spy)
    err = _refused(["ir", "--backend", "ascend"], capsys)
    assert "is unavailable: torch_npu is installed but cannot import without CANN: libhccl.so not found" in err
    assert not tried


# ------------------------------------------------------------------ validate lists


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backends", ""], "validate --backends '' names nothing"),
        (["--backends", " , "], "validate --backends ' , ' names nothing"),
        (["--backends", "cpu,,reference"], "validate --backends 'cpu,,reference': item 2 is empty"),
        (["--backends", "cpu", "--dtypes", ""], "validate --dtypes '' names nothing"),
        (["--backends", "cpu", "--dtypes", "float32,"], "validate --dtypes 'float32,': item 2 is empty"),
        (["--backends", "all,cpu"], "validate --backends 'all,cpu': 'all' (every available backend) stands alone"),
        (["--backends", "reference, reference"], "validate --backends 'reference, reference' names 'reference' twice"),
        (["--backends", "cpu", "--dtypes", "float32,float32"], "names 'float32' twice"),
        (  # the JSON report was silently replaced by the Markdown one
            ["--backends", "cpu", "--json", "r.txt", "--markdown", "./r.txt"],
            "validate --json and --markdown name the same file (r.txt): the second report would replace the first",
        ),
    ],
)
def test_validate_refuses_empty_lists(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    import dinfer_rt.validation.runner as runner

    def ran(*a, **k):
        raise AssertionError("validate ran (and would print a pass having checked nothing)")

    monkeypatch.setattr(runner, "validate", ran)
    assert message in _refused(["validate", "--quick", *argv], capsys)


# ------------------------------------------------------------------ flags the run does not read

ABSENT = "(this run: low_confidence, the default)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--threshold", "0.5"], f"--threshold applies to --strategy threshold, hierarchical, credit, "
         f"low_confidence_dynamic, joint_threshold {ABSENT}; add --strategy threshold or drop --threshold"),
        (["--low-threshold", "0.5", "--strategy", "threshold"],
         "--low-threshold applies to --strategy hierarchical (this run: threshold); add --strategy hierarchical"),
        (["--factor", "2"], f"--factor applies to --strategy factor {ABSENT}"),
        (["--edit-threshold", "0.2"], f"--edit-threshold applies to --strategy joint_threshold {ABSENT}"),
        (["--penalty-lambda", "1"], f"--penalty-lambda applies to --strategy joint_threshold {ABSENT}"),
        (["--max-post-steps", "2"], f"--max-post-steps applies to --strategy joint_threshold {ABSENT}"),
        (["--steps", "4", "--strategy", "factor"], "--steps applies to --strategy low_confidence, random"),
        (["--refresh-bound", "2"], "--refresh-bound applies to --cache adaptive, anchored, delayed (this run: "
         "none, the default); add --cache adaptive or drop --refresh-bound"),
        (["--refresh-window", "2", "--cache", "dual"], "--refresh-window applies to --cache adaptive, anchored, "
         "delayed (this run: dual)"),
        (["--precision-refresh"], "--precision-refresh applies to runs with --precision-schedule (this run: none"),
        (["--precision-refresh", "--precision-schedule", "int8@0.5,fp32"],
         "--precision-refresh applies to --cache prefix, dual, vicinity, adaptive, anchored, delayed"),
        # a preset's field is not a flag the user gave; its strategy is named as the preset's
        (["--preset", "llada2.1-speed", "--strategy", "threshold"], None),
        (["--preset", "llada2.1-speed", "--strategy", "threshold", "--edit-threshold", "0.1"],
         "--edit-threshold applies to --strategy joint_threshold (this run: threshold)"),
        (["--preset", "llada2.1-speed", "--steps", "4"], "(this run: joint_threshold, from --preset llada2.1-speed)"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", [["generate", "ab"], ["eval"], ["bench"]])
def test_a_flag_the_run_does_not_read_is_refused(command, argv, message, no_load, capsys):
    if message is None:
        _params(build_parser().parse_args([*command, *argv]))  # accepted
        return
    assert message in _refused([*command, *argv], capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["--strategy", "threshold", "--threshold", "0.5"],
        ["--strategy", "hierarchical", "--threshold", "0.8", "--low-threshold", "0.3"],
        ["--strategy", "factor", "--factor", "2"],
        ["--strategy", "joint_threshold", "--edit-threshold", "0.2", "--penalty-lambda", "1", "--max-post-steps", "2"],
        ["--preset", "llada2.1-quality", "--edit-threshold", "0.3", "--threshold", "0.6"],
        ["--steps", "10"],
        ["--cache", "anchored", "--refresh-bound", "4", "--refresh-window", "2"],
        ["--cache", "prefix", "--precision-schedule", "int8@0.5,fp32", "--precision-refresh"],
    ],
)
def test_a_flag_the_run_reads_is_accepted(argv):
    _params(build_parser().parse_args(["generate", "ab", *argv]))


@pytest.mark.parametrize(
    "argv", [["--graph-batch-sizes", "1,2"], ["--graph-length-step", "7"], ["--graph-length-step", "0"]]
)
def test_graph_knobs_with_graphs_off_are_refused(argv, no_load, capsys):
    message = _refused(["generate", "ab", "--graphs", "off", *argv], capsys)
    assert f"{argv[0]} applies to device graphs (this run: --graphs off); drop one of the two" in message


@pytest.mark.parametrize("command", [["generate", "ab"], ["bench"], ["serve"]])
def test_expert_parallel_without_tensor_parallelism_is_refused(command, no_load, capsys):
    """One rank holds every expert: the flag was ignored (serve and bench decoded plainly)."""
    message = _refused([*command, "--expert-parallel"], capsys)
    assert "--expert-parallel splits MoE experts over tensor-parallel ranks; it needs --tensor-parallel-size > 1" in (
        message
    )


def test_serve_flags_are_request_defaults(no_load, capsys):
    """serve's strategy / cache flags are defaults a request can make read by choosing its own
    strategy or cache, so they pass; --precision-refresh (the server's alone) is still checked."""
    from dinfer_rt.cli import _sampling

    a = build_parser().parse_args(["serve", "--threshold", "0.5", "--refresh-bound", "4"])
    assert _sampling(a).threshold == 0.5 and a.sampling.refresh_bound == 4
    assert "--precision-refresh applies to runs with --precision-schedule" in _refused(
        ["serve", "--precision-refresh"], capsys
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "{data}", "--regex", "a"], "eval --regex applies to --metric regex (this run: exact, the default)"),
        (["--data", "{data}", "--metric", "contains", "--regex", "a"], "--metric regex (this run: contains)"),
        (["--regex", "a"], "eval --regex applies to eval --data FILE.jsonl (this run: the embedded model's held-out"),
        (["--metric", "contains"], "eval --metric applies to eval --data FILE.jsonl"),
        (["--prompt-field", "q"], "eval --prompt-field applies to eval --data FILE.jsonl"),
        (["--output", "out.jsonl"], "eval --output applies to eval --data FILE.jsonl"),
    ],
)
def test_eval_data_flags_without_their_use_are_refused(argv, message, tmp_path, no_load, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "ab", "answer": "b"}\n')
    assert message in _refused(["eval", *[x.format(data=data) for x in argv]], capsys)


def _step(seed: int, b: int = 4, length: int = 16, vocab: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    masked = torch.rand(b, length, generator=g) < 0.6
    masked[:, 0] = True
    return dict(
        logits=3 * torch.randn(b, length, vocab, generator=g),
        masked=masked,
        quota=torch.full((b,), 2),
        current=torch.randint(0, vocab, (b, length), generator=g),
        editable=~masked,
    )


@pytest.mark.parametrize(
    "field, other",
    [("threshold", 0.3), ("low_threshold", 0.05), ("factor", 50.0), ("edit_threshold", 0.0), ("penalty_lambda", 5.0)],
)
def test_read_by_names_exactly_the_rules_that_read_a_field(field, other):
    """``strategies.READ_BY`` (what the CLI refuses by) against ``strategies.build``: a rule it
    lists decides differently when the field changes, one it does not list never does.
    (``steps`` and ``max_post_steps`` are read by the scheduler, not the rule.)"""
    ((setting, readers),) = strategies.READ_BY[field]
    assert setting == "strategy" and set(readers) <= set(STRATEGIES)
    for name in STRATEGIES:
        base = SamplingParams(strategy=name)
        changed = dataclasses.replace(base, **{field: other})
        differs = False
        for seed in range(4):
            outs = []
            for params in (base, changed):
                s = strategies.StepInput(**_step(seed), temperature=0.0, generator=torch.Generator().manual_seed(1))
                outs.append(strategies.build(params)(s))
            differs |= not all(torch.equal(x, y) for x, y in zip(*outs))
        assert differs == (name in readers), (field, name)


def test_every_rule_decides_on_float64_logits():
    """The reference backend in float64 hands the rules float64 logits (hierarchical once failed
    there: its per-run maximum was a float32 buffer)."""
    for name in STRATEGIES:
        step = _step(0)
        step["logits"] = step["logits"].double()
        s = strategies.StepInput(**step, temperature=0.0, generator=torch.Generator().manual_seed(1))
        x0, commit = strategies.build(SamplingParams(strategy=name))(s)
        assert commit.dtype == torch.bool and bool((commit & step["masked"]).any(-1).all()), name


# ------------------------------------------------------------------ checked before anything loads


@pytest.mark.parametrize("command", [["generate", "ab"], ["eval"], ["bench"], ["serve"]])
def test_sampling_flags_are_checked_before_the_model_resolves_or_loads(command, no_load, capsys):
    assert "gen_length 0 must be >= 1" in _refused([*command, "--gen-length", "0"], capsys)


def test_block_alignment_is_the_models_to_decide_before_the_load(ckpt_dir, capsys, monkeypatch):
    """gen_length need not be a multiple of block_length for a block-causal family (its blocks align
    to position 0): ``serve --model LLaDA2 --block-length 32`` (README) starts, while a bidirectional
    model's misaligned gen_length is still refused from its config.json, before the weights load."""
    import dinfer_rt.llm as llm_mod
    from dinfer_rt.cli import _check_serve_defaults, _sampling
    from dinfer_rt.server import ServeConfig

    a = build_parser().parse_args(["serve", "--model", str(ckpt_dir("llada2")), "--block-length", "32"])
    assert _sampling(a).gen_length == 40
    assert _check_serve_defaults(ckpt_dir("llada2"), a.sampling, ServeConfig()).block_length == 32

    def loaded(*a, **k):
        raise AssertionError("the model loaded before its config.json refused the settings")

    monkeypatch.setattr(llm_mod.LLM, "__init__", loaded)
    err = _refused(["generate", "ab", "--gen-length", "6", "--block-length", "4"], capsys)
    assert "gen_length 6 is not a multiple of block_length 4" in err


# ------------------------------------------------------------------ empty values, bytes not UTF-8


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "ab", "--model", ""], "--model '' is empty; give a model folder or a hub id ORG/NAME"),
        (["generate", "ab", "--model", "  "], "--model '  ' is only whitespace"),
        (["ir", "--model", ""], "--model '' is empty"),
        (["generate", "ab", "--backend", ""], "--backend '' is empty; give a backend name[:flavour[:arch]]"),
        (["ir", "--backend", ""], "--backend '' is empty"),
    ],
)
def test_an_empty_model_or_backend_is_refused_by_name(argv, message, no_load, capsys):
    assert message in _refused(argv, capsys)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "ab\udcffc"], r"prompt 1 b'ab\xffc' has a byte that is not UTF-8 (0xff) at position 2"),
        (["generate", "ok", "\u00e9\udcfe\udcff"], r"prompt 2 b'\xc3\xa9\xfe\xff' has a byte that is not UTF-8 "
         "(0xfe) at position 2 (and 1 more)"),
        (["generate", "ab", "--stop", "\udcff"], r"--stop b'\xff' has a byte that is not UTF-8 (0xff) at position 0"),
    ],
)  # fmt: skip
def test_an_argument_that_is_not_utf8_names_the_byte_and_its_position(argv, message, no_load, capsys):
    """Python hands a byte of the command line that is not UTF-8 over as a lone surrogate
    (surrogateescape): ``$'ab\\xffc'`` arrives as ``'ab\\udcffc'``."""
    assert message in _refused(argv, capsys)
