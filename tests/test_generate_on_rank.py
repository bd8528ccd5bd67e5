"""``llm.generate_on_rank`` (the torchrun entry point) honours ``allow_mask_in_prompt`` like
``LLM.generate`` and the CLI's other paths. The real function runs in this process as the one
rank of a gloo group of one (no second process: the argument handling is under test, and rank 0
runs the same lead path it runs in a bigger group); the CLI test routes torchrun's rank through
it the same way."""

from __future__ import annotations

import contextlib
import io

import pytest

import dinfer_rt
from dinfer_rt import cli, llm, parallel
from dinfer_rt.errors import GenerationError

PARAMS = dinfer_rt.SamplingParams(gen_length=8, block_length=8, steps=4)
MASKED = [5, 6, 2, 7]  # id 2: the embedded model's mask token


@pytest.fixture
def rendezvous(monkeypatch, tmp_path):
    """A file rendezvous for a gloo group of one (``join``), which is left afterwards."""
    monkeypatch.setenv(parallel.RENDEZVOUS_ENV, f"file://{tmp_path / 'store'}")
    yield
    parallel.leave_group(wait=False)


def join(a=None) -> int:
    """This process as rank 0 of a group of one: what ``cli._torchrun_rank`` does under torchrun."""
    parallel.init_group("cpu", 0, 1)
    return 0


def test_generate_on_rank_refuses_the_mask_token_unless_allowed(rendezvous):
    join()
    with pytest.raises(GenerationError, match=r"prompt 0 holds the mask token \(id 2\)"):
        llm.generate_on_rank(0, 1, None, [MASKED], PARAMS, backend="cpu")
    out = llm.generate_on_rank(0, 1, None, [MASKED], PARAMS, backend="cpu", allow_mask_in_prompt=True)
    assert len(out) == 1 and out[0].stats.tokens > 0


def test_cli_torchrun_path_passes_allow_mask_in_prompt(rendezvous, monkeypatch):
    """``generate --tensor-parallel-size 2`` under torchrun: the rank's call gets the flag (the
    rank runs in the group of one here: the argument handling is under test, not the group)."""
    seen = []
    real = llm.generate_on_rank

    def one_rank(rank, world, *args, **kwargs):
        seen.append(kwargs.get("allow_mask_in_prompt"))
        return real(rank, 1, *args, **kwargs)

    monkeypatch.setattr(llm, "generate_on_rank", one_rank)
    monkeypatch.setattr(cli, "_torchrun_rank", join)  # the CLI leaves the group after each command
    argv = ["generate", "ab<|mdm_mask|>", "--tensor-parallel-size", "2", "--backend", "cpu", "--raw"]
    argv += ["--gen-length", "8", "--block-length", "8", "--steps", "4"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        refused = cli.main(argv)
        allowed = cli.main([*argv, "--allow-mask-in-prompt"])
    assert seen == [False, True], seen
    assert refused == 2 and "holds the mask token (id 2)" in err.getvalue(), err.getvalue()
    assert allowed == 0, err.getvalue()
