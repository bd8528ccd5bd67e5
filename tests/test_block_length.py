"""A request that sets no block length decodes with the checkpoint's (#37 item 8): LLaDA2 and
SDAR are trained with block-causal masks of one size, so decoding them with another block
changes what each position may attend to."""

from __future__ import annotations

import pytest
import torch

import dinfer_rt
from dinfer_rt.engine import Engine, run_batch
from dinfer_rt.errors import GenerationError
from dinfer_rt.sampling import DEFAULT_BLOCK_LENGTH, SamplingParams
from dinfer_rt.testing import checkpoints


@pytest.fixture(scope="module")
def block_causal(ckpt_dir, tmp_path_factory):
    return {
        "llada2": ckpt_dir("llada2"),  # config without block_size: the family's 32
        "sdar": checkpoints.sdar(tmp_path_factory.mktemp("sdar8"), block_size=8),  # config block_size 8
    }


@pytest.mark.parametrize("name, block", [("llada2", 32), ("sdar", 8)])
def test_block_causal_families_take_the_checkpoint_block_when_the_request_sets_none(block_causal, name, block):
    model = dinfer_rt.load_model(block_causal[name])
    assert model.spec.default_block_size == block
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14]]
    # gen_length 20 is no multiple of the block: block-causal blocks align to position 0 anyway
    unset = run_batch(model, prompts, SamplingParams(gen_length=20, strategy="threshold", early_stop=False))
    assert {r.cohort.params.block_length for r in unset.requests} == {block}
    explicit = run_batch(model, prompts, SamplingParams(gen_length=20, block_length=block, strategy="threshold",
                                                        early_stop=False))  # fmt: skip
    assert torch.equal(unset.tokens, explicit.tokens)
    assert not (unset.tokens == model.mask_id).any()
    # LLM.generate, the default gen_length (40) and a served engine's default block agree
    out = dinfer_rt.LLM(model).generate([[7, 8, 9]], SamplingParams(strategy="threshold"))[0]
    assert len(out.token_ids) > 0
    # LLM.generate takes the misaligned gen_length too (it refused it before the model's rule applied)
    params = SamplingParams(gen_length=20, strategy="threshold", early_stop=False)
    llm_out = dinfer_rt.LLM(model).generate(prompts, params)
    for row, o in enumerate(llm_out):
        assert o.token_ids == unset.requests[row].output_ids
    assert Engine(model, max_num_seqs=1).block_size == block


def test_bidirectional_families_keep_the_default_block_and_its_multiple_rule(ckpt_dir):
    model = dinfer_rt.load_model(ckpt_dir("llada"))
    res = run_batch(model, [[7, 8, 9]], SamplingParams(gen_length=DEFAULT_BLOCK_LENGTH, strategy="threshold"))
    assert res.requests[0].cohort.params.block_length == DEFAULT_BLOCK_LENGTH
    with pytest.raises(GenerationError, match="gen_length 20 is not a multiple of block_length 40"):
        run_batch(model, [[7, 8, 9]], SamplingParams(gen_length=20))
    with pytest.raises(GenerationError, match="gen_length 20 is not a multiple of block_length 8"):
        SamplingParams(gen_length=20, block_length=8).validate()
