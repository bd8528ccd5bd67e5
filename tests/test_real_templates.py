"""The models' own tokenizer_config.json files, rendered exactly as transformers renders them.

``tests/data/templates/`` holds the published tokenizer_config.json of LLaDA-8B-Instruct,
LLaDA2.0-mini, Dream-v0-Instruct-7B and SDAR-8B-Chat (public files; provenance in
``../shared/reference/templates/README.md``: copies vendored unmodified in public GitHub repos).
Each is dropped into a test checkpoint's folder; dinfer-rt's rendering must equal transformers'
``PreTrainedTokenizerFast.apply_chat_template(..., tokenize=False)`` on the same folder, for
single- and multi-turn chats, with and without a system prompt and the generation prompt, and
with SDAR's ``enable_thinking``. The stop ids of each family follow from these files, the
config and generation_config.json, checked at the real ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dinfer_rt.model_spec import EOS_TOKENS
from dinfer_rt.testing import checkpoints
from dinfer_rt.tokenizer import Tokenizer, stop_ids

TEMPLATES = Path(__file__).parent / "data" / "templates"
MODELS = ("LLaDA-8B-Instruct", "LLaDA2.0-mini", "Dream-v0-Instruct-7B", "SDAR-8B-Chat")

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2+2?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Hi there  "}],
    "multi": [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": 'And one more — «quoted» "json"?'},
    ],
    "system-multi-thinking": [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "2*3?"},
        {"role": "assistant", "content": "<think>\ntwo threes\n</think>\n\n6"},
        {"role": "user", "content": "and 2*4?"},
    ],
    "ends-with-assistant": [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "<think>greet</think>hi"},
    ],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint-tokenizer folder per model, holding that model's real tokenizer_config.json."""
    root = tmp_path_factory.mktemp("real-templates")
    out = {}
    for model in MODELS:
        folder = root / model
        checkpoints.write_tokenizer(folder, 61)
        shutil.copy(TEMPLATES / f"{model}.tokenizer_config.json", folder / "tokenizer_config.json")
        out[model] = folder
    return out


def _transformers(folder: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("gen_prompt", [True, False], ids=["gen", "nogen"])
def test_real_template_renders_like_transformers(folders, model, conv, gen_prompt):
    messages = CONVERSATIONS[conv]
    want = _transformers(folders[model]).apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    got = Tokenizer(folders[model], 61).apply_chat_template(messages, add_generation_prompt=gen_prompt)
    assert got == want


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("conv", ["single", "system-multi-thinking"])
def test_sdar_enable_thinking_reaches_the_template(folders, thinking, conv):
    folder = folders["SDAR-8B-Chat"]
    messages = CONVERSATIONS[conv]
    want = _transformers(folder).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    got = Tokenizer(folder, 61).apply_chat_template(messages, enable_thinking=thinking)
    assert got == want
    assert got.endswith("<think>\n\n</think>\n\n") == (not thinking)


def test_the_facts_the_templates_are_known_for(folders):
    """What each template is documented to do (shared/reference/templates/README.md)."""
    user = CONVERSATIONS["single"]
    dream = Tokenizer(folders["Dream-v0-Instruct-7B"], 61).apply_chat_template(user)
    assert dream.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")  # default system prompt
    llada = Tokenizer(folders["LLaDA-8B-Instruct"], 61)
    no_gen = llada.apply_chat_template(user, add_generation_prompt=False)
    assert no_gen.startswith("<|startoftext|>") and no_gen.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert no_gen == llada.apply_chat_template(user)  # it always appends the assistant header
    llada2 = Tokenizer(folders["LLaDA2.0-mini"], 61).apply_chat_template(user)
    assert (
        llada2
        == "<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>What is 2+2?<|role_end|>"
        + ("<role>ASSISTANT</role>")
    )


# ---------------------------------------------------------------- stop ids at the real ids

# Special tokens at their real ids (shared/reference/templates/*.tokens.json) and what config.json /
# generation_config.json say about EOS there.
FAMILIES = {
    "LLaDA-8B-Instruct": {
        "family": "llada",
        "vocab": 126464,
        "tokens": {126080: "<|startoftext|>", 126081: "<|endoftext|>", 126336: "<|mdm_mask|>", 126348: "<|eot_id|>"},
        "config_eos": 126081,
        "generation": {"bos_token_id": 126080, "eos_token_id": 126081},
        "stop": (126081, 126348),
    },
    "Dream-v0-Instruct-7B": {
        "family": "dream",
        "vocab": 152064,
        "tokens": {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151666: "<|mask|>"},
        "config_eos": 151643,
        "generation": {"eos_token_id": 151643, "pad_token_id": 151643},
        "stop": (151643, 151645),
    },
    "SDAR-8B-Chat": {
        "family": "sdar",
        "vocab": 151936,
        "tokens": {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151669: "<|MASK|>"},
        "config_eos": 151643,
        "generation": {"eos_token_id": [151645, 151643], "pad_token_id": 151643},
        "stop": (151643, 151645),
    },
    "LLaDA2.0-mini": {
        "family": "llada2",
        "vocab": 157184,
        "tokens": {156892: "<|endoftext|>", 156895: "<|mask|>", 156900: "<|role_end|>"},
        "config_eos": None,
        "generation": None,
        "stop": (156892, 156900),
    },
}


def _real_id_folder(root: Path, model: str) -> Path:
    """A tokenizer whose special tokens sit at the model's real ids (filler tokens elsewhere), the
    model's real tokenizer_config.json and generation_config.json."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    fam = FAMILIES[model]
    specials = fam["tokens"]
    highest = max(specials) + 1
    vocab = {f"<t{i}>": i for i in range(highest) if i not in specials}
    vocab.update({text: i for i, text in specials.items()})
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials.values()))
    folder = root / model
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    shutil.copy(TEMPLATES / f"{model}.tokenizer_config.json", folder / "tokenizer_config.json")
    if fam["generation"] is not None:
        (folder / "generation_config.json").write_text(json.dumps(fam["generation"]))
    return folder


@pytest.mark.parametrize("model", list(FAMILIES))
def test_stop_ids_per_family(tmp_path, model):
    fam = FAMILIES[model]
    folder = _real_id_folder(tmp_path, model)
    tok = Tokenizer(folder, fam["vocab"])
    config_eos = () if fam["config_eos"] is None else (fam["config_eos"],)
    family_tokens = EOS_TOKENS.get(fam["family"], ())
    assert stop_ids(tok, config_eos, family_tokens, folder) == fam["stop"]
    for i, text in fam["tokens"].items():  # the folder really holds the ids the table claims
        assert tok.token_id(text) == i


def test_sdar_needs_generation_config_for_its_turn_end(tmp_path):
    """SDAR's config.json names only <|endoftext|> and its tokenizer's eos_token is <|endoftext|>:
    without generation_config.json's list, <|im_end|> would not stop a chat turn."""
    folder = _real_id_folder(tmp_path, "SDAR-8B-Chat")
    tok = Tokenizer(folder, 151936)
    assert stop_ids(tok, (151643,), (), None) == (151643,)
    assert stop_ids(tok, (151643,), (), folder) == (151643, 151645)


@pytest.mark.parametrize(
    "value, message",
    [("151645", "should be an id >= 0 or a list"), ([151645, -1], "should be an id"), ([True], "should be an id")],
)
def test_generation_config_eos_of_the_wrong_type(tmp_path, value, message):
    from dinfer_rt.errors import TokenizerError
    from dinfer_rt.tokenizer import generation_eos_ids

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    with pytest.raises(TokenizerError, match=f"generation_config.json: field 'eos_token_id' {message}"):
        generation_eos_ids(tmp_path)


def test_a_config_bos_id_unlike_the_tokenizers_loads(tmp_path):
    """Dream-7B's config.json says bos_token_id 151643 (<|endoftext|>) while its tokenizer's
    bos_token is <|beginoftext|> 151665 (``Dream-v0-Instruct-7B.tokens.json``, notes): harmless,
    since only the tokenizer's BOS is rendered or scored, so it loads (it was refused as a
    contradiction). The same shape on a test checkpoint: config BOS 1, tokenizer BOS id 2."""
    import json

    import dinfer_rt
    from dinfer_rt.testing import checkpoints

    path = checkpoints.llada(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "bos_token_id": 1}))
    model = dinfer_rt.load_model(path, backend="cpu")
    assert model.tokenizer.special_id("bos_token") == 2
