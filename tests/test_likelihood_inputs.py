"""Bad arguments to ``dinfer_rt.likelihood.loglikelihood`` and the lm-eval adapter (``DinferLM``)
are refused up front, naming the argument, instead of being truncated, ignored or failing deep in torch."""

from __future__ import annotations

import pytest

from dinfer_rt import LLM
from dinfer_rt.errors import GenerationError
from dinfer_rt.likelihood import loglikelihood


@pytest.fixture(scope="module")
def model():
    return LLM().model


def _ll(model, context=None, continuation=None, **kw):
    tok = model.tokenizer
    context = tok.encode("qwer") if context is None else context
    continuation = tok.encode("ty") if continuation is None else continuation
    kw = {"mc_num": 4, "batch_size": 4, "greedy_check": False, **kw}
    return loglikelihood(model, context, continuation, **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"cfg_scale": float("nan")}, "cfg_scale must be a finite number"),
        ({"cfg_scale": float("inf")}, "cfg_scale must be a finite number"),
        ({"cfg_scale": -5.0}, r"cfg_scale -5.0 must be in \[0, 100\]"),
        ({"mc_num": 2.5}, "mc_num must be int, got float 2.5"),
        ({"mc_num": True}, "mc_num must be int, got bool"),
        ({"mc_num": 10**12, "batch_size": 10**12}, r"mc_num 1000000000000 must be in \[1, 4096\]"),
        ({"batch_size": 2.0}, "batch_size must be int, got float"),
        ({"seed": 1.5}, "seed must be int, got float"),
        ({"seed": 2**70}, r"seed \d+ must be in \[0, 9223372036854775807\]"),
        ({"seed": -1}, "seed -1 must be in"),
        ({"greedy_check": "no"}, "greedy_check must be True or False"),
    ],
)
def test_loglikelihood_refuses_bad_arguments(model, kw, match):
    with pytest.raises(GenerationError, match=match):
        _ll(model, **kw)


@pytest.mark.parametrize(
    "context, continuation, match",
    [
        (None, [7.5], r"continuation token 0 is 7.5; token ids must be ints in \[0, "),
        (None, [True], "continuation token 0 is True"),
        (None, [9999], "continuation token 0 is 9999"),
        (None, [-1], "continuation token 0 is -1"),
        ("qwer", None, "context must be a list of token ids, got str 'qwer'"),
        (None, "ty", "continuation must be a list of token ids, got str"),
    ],
)
def test_loglikelihood_refuses_bad_token_ids(model, context, continuation, match):
    with pytest.raises(GenerationError, match=match):
        _ll(model, context, continuation)


def test_loglikelihood_refuses_the_mask_id_and_takes_tuples(model):
    m = model.mask_id
    with pytest.raises(GenerationError, match=f"continuation holds the mask token \\(id {m}\\) at token 1"):
        _ll(model, continuation=[model.tokenizer.encode("t")[0], m])
    with pytest.raises(GenerationError, match=f"context holds the mask token \\(id {m}\\) at token 0"):
        _ll(model, context=[m, m])
    ctx = model.tokenizer.encode("qwer")
    assert _ll(model, tuple(ctx)) == _ll(model, ctx)


# ---------------------------------------------------------------- lm-eval adapter


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"mc_num": "abc"}, r"--model_args: mc_num must be an int in \[1, 4096\], got 'abc'"),
        ({"mc_num": 2.7}, "mc_num must be an int .*, got 2.7"),
        ({"mc_num": 0}, "mc_num must be an int .*, got 0"),
        ({"mc_num": 10, "mc_batch_size": 4}, "mc_num 10 must be a multiple of mc_batch_size 4"),
        ({"mc_batch_size": 0}, "mc_batch_size must be an int >= 1, got 0"),
        ({"batch_size": "abc"}, "batch_size must be an int >= 1 or 'auto' / 'auto:N', got 'abc'"),
        ({"batch_size": "automatic-garbage"}, "batch_size .*, got 'automatic-garbage'"),
        ({"batch_size": 2.9}, "batch_size .*, got 2.9"),
        ({"tensor_parallel_size": 1.9}, "tensor_parallel_size must be an int >= 1, got 1.9"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size must be an int >= 1, got True"),
    ],
)
def test_model_args_refuse_non_integers_at_construction(kw, match):
    pytest.importorskip("lm_eval")
    from dinfer_rt.lm_eval_model import DinferLM

    with pytest.raises(GenerationError, match=match):
        DinferLM(**kw)


@pytest.fixture(scope="module")
def lm():
    pytest.importorskip("lm_eval")
    from dinfer_rt.lm_eval_model import DinferLM

    return DinferLM(gen_length=8, block_length=8, mc_num="4", mc_batch_size="4", batch_size="auto:2")


def _gen(lm, gen_kwargs):
    from lm_eval.api.instance import Instance

    return lm.generate_until([Instance("generate_until", {}, ("qwer", gen_kwargs), 0)], disable_tqdm=True)


def test_model_args_take_integer_text_and_auto(lm):
    assert (lm.mc_num, lm.mc_batch_size, lm.batch_size) == (4, 4, 16)


@pytest.mark.parametrize(
    "gen_kwargs, match",
    [
        ({"max_gen_toks": -3}, "gen_kwargs max_gen_toks must be an int >= 1, got -3"),
        ({"max_gen_toks": 0}, "gen_kwargs max_gen_toks must be an int >= 1, got 0"),
        ({"max_gen_toks": "abc"}, "max_gen_toks must be an int >= 1, got 'abc'"),
        ({"max_new_tokens": 2.5}, "gen_kwargs max_new_tokens must be an int >= 1, got 2.5"),
        ({"temperature": "0.5"}, "gen_kwargs temperature must be a finite number >= 0, got '0.5'"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
        ({"do_sample": "false"}, "do_sample must be true or false, got 'false'"),
        ({"top_p": 0.1}, "top_p 0.1 is not supported: dinfer-rt does not sample with top_p"),
        ({"top_k": 1}, "top_k 1 is not supported"),
        ({"bogus": 3}, "unknown gen_kwargs key 'bogus'; supported: until, max_gen_toks"),
        (None, "gen_kwargs must be a dict, got None"),
    ],
)
def test_generate_until_refuses_what_it_cannot_honour(lm, gen_kwargs, match):
    with pytest.raises(GenerationError, match=match):
        _gen(lm, gen_kwargs)


def test_generate_until_keeps_lm_eval_standard_gen_kwargs(lm):
    """gsm8k / humaneval style kwargs, with the neutral sampler values tasks often send."""
    greedy = _gen(lm, {"until": ["\n"], "do_sample": False, "temperature": 0.0, "max_gen_toks": 3})
    neutral = {"top_p": 1.0, "top_k": -1, "num_beams": 1}
    assert _gen(lm, {"until": ["\n"], "do_sample": False, "temperature": 0, "max_gen_toks": 3, **neutral}) == greedy
    assert _gen(lm, {"max_new_tokens": 3, "top_k": 0}) == greedy
    assert len(lm.llm.tokenizer.encode(greedy[0])) <= 3


def test_loglikelihood_rolling_empty_text_says_the_text(lm):
    from lm_eval.api.instance import Instance

    with pytest.raises(GenerationError, match="loglikelihood_rolling: the text is empty"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("",), 0)], disable_tqdm=True)
