"""The mask token in a prompt through the Python API and the CLI (SGLang #35998): refused with a
one-line ``GenerationError`` / ``error:`` line unless the caller asks to infill
(``allow_mask_in_prompt``). The server's 400s are in ``tests/test_model_inputs.py``."""

from __future__ import annotations

import contextlib
import io

import pytest

import dinfer_rt
from dinfer_rt.cli import main
from dinfer_rt.errors import GenerationError

MASK_TEXT = "<|mdm_mask|>"  # the embedded model's mask token (id 2)
PARAMS = dinfer_rt.SamplingParams(gen_length=8, block_length=8, steps=4)


@pytest.fixture(scope="module")
def llm():
    return dinfer_rt.LLM(backend="cpu")


@pytest.mark.parametrize(
    "prompt, where",
    [("ab" + MASK_TEXT + "c", "prompt 0"), ([5, 6, 2, 7], "prompt 0"), (["abc", [5, 2]], "prompt 1")],
    ids=["text", "ids", "second-of-two"],
)
def test_api_refuses_the_mask_token(llm, prompt, where):
    with pytest.raises(GenerationError) as e:
        llm.generate(prompt, PARAMS)
    assert f"{where} holds the mask token (id 2)" in str(e.value) and "\n" not in str(e.value)


def test_api_infills_when_asked(llm):
    out = llm.generate([[5, 6, 2, 7]], PARAMS, allow_mask_in_prompt=True)
    assert len(out) == 1 and out[0].stats.tokens > 0


def _cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(list(argv))
    return rc, err.getvalue()


def test_cli_refuses_the_mask_token_then_infills_on_request():
    args = ["generate", "ab" + MASK_TEXT, "--backend", "cpu", "--gen-length", "8", "--block-length", "8", "--raw"]
    rc, err = _cli(*args)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "holds the mask token (id 2)" in lines[0], err
    assert "--allow-mask-in-prompt" in lines[0]
    rc, err = _cli(*args, "--allow-mask-in-prompt")
    assert rc == 0, err
