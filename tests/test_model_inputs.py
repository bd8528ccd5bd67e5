"""Checkpoints and tokenizer configs in every shape the ecosystem ships (#42 item 4), the mask
token in user text (#38 item 5) and chat template kwargs in the server.

Each refused shape is one row of the "Checkpoint and tokenizer files" table in
``docs/bad-inputs.md`` (ids ``model:...``); ``test_the_docs_table_lists_exactly_these_cases``
keeps the table and :data:`CASES` equal.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dinfer_rt
from dinfer_rt.errors import DinferError, GenerationError
from dinfer_rt.testing import checkpoints
from dinfer_rt.tokenizer import Tokenizer, refuse_mask_token

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "bad-inputs.md"
EMBEDDED = ROOT / "dinfer_rt" / "demo" / "model"
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _ckpt(tmp: Path) -> Path:
    return checkpoints.llada(tmp / "m")


def _tok_config(folder: Path, **changes) -> Path:
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return folder


def _load(folder: Path, **kw) -> dinfer_rt.Model:
    return dinfer_rt.load_model(folder, backend="cpu", **kw)


def _tokenizer_field(**changes) -> Callable:
    return lambda tmp: Tokenizer(_tok_config(_ckpt(tmp), **changes), 61)


def _cli(*argv: str) -> None:
    """The CLI in this process; its one ``error:`` line becomes a DinferError."""
    import contextlib
    import io

    from dinfer_rt.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(list(argv))
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(lines) == 1, (rc, err.getvalue())
    raise DinferError(lines[0].removeprefix("error: "))


def _replace_with_folder(name: str) -> Callable:
    def run(tmp: Path) -> None:
        folder = _ckpt(tmp)
        (folder / name).unlink()
        (folder / name).mkdir()
        _load(folder)

    return run


def _replace_with_loop(name: str) -> Callable:
    def run(tmp: Path) -> None:
        folder = _ckpt(tmp)
        (folder / name).unlink()
        (folder / "loop-a").symlink_to("loop-b")
        (folder / "loop-b").symlink_to("loop-a")
        (folder / name).symlink_to("loop-a")
        _load(folder)

    return run


def _dangling(tmp: Path) -> None:
    folder = _ckpt(tmp)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to("../gone/tokenizer.json")
    _load(folder)


def _index(weight_map_value) -> Callable:
    def run(tmp: Path) -> None:
        folder = checkpoints.llada(tmp / "m", shards=2)
        index = folder / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        first = next(iter(data["weight_map"]))
        data["weight_map"][first] = weight_map_value
        index.write_text(json.dumps(data))
        _load(folder)

    return run


def _raw_dtype(dtype: str) -> Callable:
    """A tensor stored with a dtype torch may not even have: the header is written by hand."""

    def run(tmp: Path) -> None:
        folder = _ckpt(tmp)
        tensors = load_file(str(folder / "model.safetensors"))
        name = "model.transformer.ln_f.weight"
        n = tensors.pop(name).numel()
        save_file(tensors, str(folder / "model.safetensors"))
        extra = folder / "extra.safetensors"
        header = json.dumps({name: {"dtype": dtype, "shape": [n], "data_offsets": [0, n]}}).encode()
        extra.write_bytes(struct.pack("<Q", len(header)) + header + bytes(n))
        _load(folder)

    return run


def _unsigned(tmp: Path) -> None:
    folder = _ckpt(tmp)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.transformer.ln_f.weight"] = torch.ones(48, dtype=torch.uint16)
    save_file(tensors, str(folder / "model.safetensors"))
    _load(folder)


def _generation_config(**fields) -> Callable:
    def run(tmp: Path) -> None:
        folder = _ckpt(tmp)
        (folder / "generation_config.json").write_text(json.dumps(fields))
        _load(folder)

    return run


def _template_name_unknown(tmp: Path) -> None:
    folder = _tok_config(_ckpt(tmp), chat_template=[{"name": "default", "template": TEMPLATE}])
    _cli("generate", "ab", "--model", str(folder), "--chat-template-name", "rag", "--backend", "cpu")


def _mask_in_ids(tmp: Path) -> None:
    refuse_mask_token([7, 8, checkpoints.MASK, 9], checkpoints.MASK, "prompt 0")


def _mask_in_text(tmp: Path) -> None:
    tok = Tokenizer(_ckpt(tmp), 61)
    refuse_mask_token(tok.encode("ab<|mask|>c"), checkpoints.MASK, "'prompt'")


class Case:
    def __init__(self, id: str, run: Callable, message: str) -> None:
        self.id, self.run, self.message = id, run, message


CASES = [
    Case(
        "template-int", _tokenizer_field(chat_template=5), "field 'chat_template' must be a template string or a list"
    ),
    Case("template-empty", _tokenizer_field(chat_template=""), "field 'chat_template' is an empty string"),
    Case(
        "template-object",
        _tokenizer_field(chat_template={"default": TEMPLATE}),
        "field 'chat_template' must be a template string or a list of {name, template} objects, found dict",
    ),
    Case(
        "template-list-item-without-template",
        _tokenizer_field(chat_template=[{"name": "default"}]),
        "field 'chat_template'[0] must be an object with a non-empty string 'name' and 'template'",
    ),
    Case(
        "template-list-without-default",
        _tokenizer_field(chat_template=[{"name": "tool_use", "template": TEMPLATE}]),
        "has no template named 'default' (it has 'tool_use'): choose one with --chat-template-name",
    ),
    Case("template-name-unknown", _template_name_unknown, "has no template named 'rag' (it has 'default')"),
    Case(
        "special-token-int",
        _tokenizer_field(bos_token=5),
        "field 'bos_token' must be a token string (or an object with 'content'), found int 5",
    ),
    Case(
        "special-token-list", _tokenizer_field(eos_token=["<|endoftext|>"]), "field 'eos_token' must be a token string"
    ),
    Case(
        "special-token-object-without-content",
        _tokenizer_field(mask_token={"special": True}),
        "field 'mask_token' is an object without a non-empty string 'content'",
    ),
    Case("special-token-empty", _tokenizer_field(unk_token=""), "field 'unk_token' is an empty string; use null"),
    Case(
        "split-special-tokens-not-bool",
        _tokenizer_field(split_special_tokens="yes"),
        "field 'split_special_tokens' must be true or false",
    ),
    Case(
        "tokenizer-json-is-a-folder", _replace_with_folder("tokenizer.json"), "tokenizer.json is a folder, not a file"
    ),
    Case("tokenizer-json-symlink-loop", _replace_with_loop("tokenizer.json"), "tokenizer.json is a symlink loop"),
    Case("tokenizer-json-dangling-symlink", _dangling, "tokenizer.json is a symlink to '../gone/tokenizer.json'"),
    Case("config-json-is-a-folder", _replace_with_folder("config.json"), "config.json is a folder, not a file"),
    Case("config-json-symlink-loop", _replace_with_loop("config.json"), "config.json is a symlink loop"),
    Case("index-shard-not-a-string", _index(3), "the shard 3; shard names must be file names (strings)"),
    Case(
        "index-shard-with-a-path",
        _index("../other/model.safetensors"),
        "shards must be files in the model folder, named without a path",
    ),
    Case("unsigned-weight", _unsigned, "tensor 'model.transformer.ln_f.weight' has integer dtype torch.uint16"),
    Case(
        "mx-scale-weight",
        _raw_dtype("F8_E8M0"),
        "tensor 'model.transformer.ln_f.weight' has dtype F8_E8M0 (an MX block-scale format), which dinfer-rt",
    ),
    Case(
        "unknown-dtype", _raw_dtype("Q7"), "tensor 'model.transformer.ln_f.weight' has unknown safetensors dtype 'Q7'"
    ),
    Case(
        "generation-eos-outside-vocab",
        _generation_config(eos_token_id=[1, 70]),
        "generation_config.json: field 'eos_token_id' = 70 is outside the vocabulary (61 rows)",
    ),
    Case(
        "generation-eos-not-an-id",
        _generation_config(eos_token_id="<|eot_id|>"),
        "generation_config.json: field 'eos_token_id' should be an id >= 0 or a list of them",
    ),
    Case(
        "revision-with-a-local-folder",
        lambda tmp: dinfer_rt.load_model(_ckpt(tmp), backend="cpu", revision="v2"),
        "--revision 'v2' applies to hub ids (ORG/NAME)",
    ),
    Case("mask-token-in-prompt-ids", _mask_in_ids, "prompt 0 holds the mask token (id 5) at token 2"),
    Case("mask-token-in-prompt-text", _mask_in_text, "'prompt' holds the mask token (id 5) at token 2"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_with_one_line_naming_the_problem(case, tmp_path):
    with pytest.raises(DinferError) as e:
        case.run(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert case.message in msg, msg


def test_the_docs_table_lists_exactly_these_cases():
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("|") and len(cells) == 3 and re.fullmatch(r"`model:[a-z0-9-]+`", cells[0]):
            rows[cells[0].strip("`").removeprefix("model:")] = cells[2]
    assert set(rows) == {c.id for c in CASES}
    for c in CASES:
        assert f"`{c.message}`" == rows[c.id].replace("\\|", "|"), c.id


# ---------------------------------------------------------------- shapes that load


def test_generation_config_stop_ids_are_read_at_load(tmp_path):
    folder = _ckpt(tmp_path)
    assert _load(folder).generation_eos_ids == ()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 1], "temperature": 0.6}))
    assert _load(folder).generation_eos_ids == (4, 1)


def test_named_templates_default_and_chosen(tmp_path):
    from transformers import PreTrainedTokenizerFast

    named = [{"name": "default", "template": TEMPLATE}, {"name": "shout", "template": TEMPLATE + "!!"}]
    folder = _tok_config(_ckpt(tmp_path), chat_template=named)
    chat = [{"role": "user", "content": "ab"}]
    hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
    tok = Tokenizer(folder, 61)
    assert tok.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    shout = Tokenizer(folder, 61, chat_template_name="shout").apply_chat_template(chat)
    assert shout == hf.apply_chat_template(chat, chat_template="shout", tokenize=False, add_generation_prompt=True)
    assert shout.endswith("ab!!")
    model = _load(folder, chat_template_name="shout")
    assert model.tokenizer.apply_chat_template(chat) == shout


def test_chat_template_jinja_file_is_read_like_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    folder = _tok_config(_ckpt(tmp_path), chat_template=TEMPLATE)
    (folder / "chat_template.jinja").write_text(TEMPLATE + "|from the file")
    chat = [{"role": "user", "content": "ab"}]
    want = PreTrainedTokenizerFast.from_pretrained(str(folder)).apply_chat_template(chat, tokenize=False)
    assert Tokenizer(folder, 61).apply_chat_template(chat, add_generation_prompt=False) == want
    assert want.endswith("|from the file")


def test_added_token_objects_are_read_as_their_content(tmp_path):
    folder = _tok_config(_ckpt(tmp_path), bos_token={"__type": "AddedToken", "content": "<|startoftext|>"})
    tok = Tokenizer(folder, 61)
    assert tok.special_id("bos_token") == 2
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]).startswith("<|startoftext|>")


def test_split_special_tokens_makes_typed_special_tokens_plain_text(tmp_path):
    """transformers' ``split_special_tokens``: false (the default, and every model in
    docs/models.md) matches a typed ``<|mask|>`` as the special token; true splits it as text."""
    folder = _ckpt(tmp_path)
    assert Tokenizer(folder, 61).encode("a<|mask|>") == [6, checkpoints.MASK]
    split = Tokenizer(_tok_config(folder, split_special_tokens=True), 61)
    with pytest.raises(DinferError, match=r"does not know: \['<', '>', '\|'\]"):  # the test vocabulary has no '<'
        split.encode("a<|mask|>")


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["F8_E4M3", "F8_E5M2"])
def test_fp8_weights_load_exactly(tmp_path, fp8):
    """fp8-stored weights (no scales: a quantisation config with scales is refused by config.json)
    load as the values they hold: the same logits as a float32 checkpoint of those values."""
    folder = _ckpt(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    ref = tmp_path / "ref"
    shutil.copytree(folder, ref)
    save_file({k: v.to(fp8) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    save_file({k: v.to(fp8).float() for k, v in tensors.items()}, str(ref / "model.safetensors"))
    ids = torch.tensor([[7, 8, 9, checkpoints.MASK, checkpoints.MASK]])
    got = _load(folder, dtype="float32").forward(ids)  # the NaN scan runs (check_weights defaults to True)
    want = _load(ref, dtype="float32").forward(ids)
    assert torch.equal(got, want)


def test_the_nan_scan_finds_nan_in_fp8(tmp_path):
    folder = _ckpt(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors = {k: v.to(torch.float8_e4m3fn) for k, v in tensors.items()}
    tensors["model.transformer.ln_f.weight"][3] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(DinferError, match=r"tensor 'model.transformer.ln_f.weight' holds 1 NaN/infinite value"):
        _load(folder)


def test_refuse_mask_token_allows_infilling_on_request():
    refuse_mask_token([7, 5, 8], 5, "prompt", allow=True)
    refuse_mask_token([7, 8], 5, "prompt")
    refuse_mask_token([7, 5], None, "prompt")  # a model without a mask id has nothing to confuse
    with pytest.raises(GenerationError, match="allow_mask_in_prompt"):
        refuse_mask_token([5], 5, "prompt")


def test_template_kwargs_reach_the_template(tmp_path):
    folder = _tok_config(_ckpt(tmp_path), chat_template=TEMPLATE + "{% if shout is defined and shout %}!{% endif %}")
    tok = Tokenizer(folder, 61)
    chat = [{"role": "user", "content": "ab"}]
    assert tok.apply_chat_template(chat, shout=True).endswith("ab!")
    assert tok.apply_chat_template(chat).endswith("ab")
    with pytest.raises(DinferError, match="chat template kwarg 'tools' is set by dinfer-rt itself"):
        tok.apply_chat_template(chat, tools=[])


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The embedded model with a template that reads a kwarg, served on a free local port."""
    from dinfer_rt.testing.serving import ServerProcess

    folder = tmp_path_factory.mktemp("served") / "letters"
    shutil.copytree(EMBEDDED, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"] + "{% if extra is defined %}{{ extra }}{% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    env = {"DINFER_BACKEND": "cpu", "PYTHONPATH": str(ROOT)}
    s = ServerProcess("--model", str(folder), "--block-length", "8", lifetime=120, cwd=ROOT, env=env)
    yield s
    s.stop()


def _post(server, path: str, body: dict):
    import httpx

    return httpx.post(server.url + path, json={"max_tokens": 8, **body}, timeout=60)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "ab<|mdm_mask|>c"}, "prompt"),
        ("/v1/completions", {"prompt": [5, 6, 2, 7]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a<|mdm_mask|>"}]}, "messages"),
    ],
    ids=["text", "ids", "chat"],
)
def test_server_refuses_the_mask_token_unless_asked(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "holds the mask token (id 2)" in err["message"], err
    assert _post(server, path, {**body, "allow_mask_in_prompt": True}).status_code == 200


def test_server_chat_template_kwargs(server):
    chat = {"messages": [{"role": "user", "content": "abc"}]}
    plain = _post(server, "/v1/chat/completions", chat).json()["usage"]["prompt_tokens"]
    more = _post(server, "/v1/chat/completions", {**chat, "chat_template_kwargs": {"extra": "dd"}})
    assert more.status_code == 200 and more.json()["usage"]["prompt_tokens"] == plain + 2
    for bad, fragment in (
        ([1], "'chat_template_kwargs' must be an object, got list"),
        ({"messages": []}, "'chat_template_kwargs' key 'messages' cannot be set"),
    ):
        r = _post(server, "/v1/chat/completions", {**chat, "chat_template_kwargs": bad})
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    r = _post(server, "/v1/completions", {"prompt": "ab", "chat_template_kwargs": {"extra": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
