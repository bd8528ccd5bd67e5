"""Chat templates render exactly as transformers renders them (its own ``render_jinja_template``).

The templates are of the three forms the families use: Llama-3 style with the BOS once before the
first message (LLaDA-8B-Instruct, as docs/models.md describes it), ChatML with a default system
prompt (Qwen2-based Dream-Instruct) and role-tagged turns (LLaDA2 / Bailing), plus templates that
use the features transformers' environment adds (loop controls, ``tojson``, ``{% generation %}``,
namespaces). The public tokenizer_config.json files cannot be read offline, so these strings are
written to their published forms rather than copied from the hub."""

from __future__ import annotations

import json

import pytest

from dinfer_rt.errors import TokenizerError
from dinfer_rt.testing import checkpoints
from dinfer_rt.tokenizer import Tokenizer

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLE_TAGS = (
    "{% for message in messages %}{% set role = message['role'] | upper %}"
    "{% if role == 'USER' %}{% set role = 'HUMAN' %}{% endif %}{% set role = role | lower %}"
    "{{ '<role>' + role + '</role>' + message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}"
)
FEATURES = (
    "{%- set ns = namespace(n=0) -%}\n"
    "{%- for m in messages -%}\n"
    "  {%- if m['role'] == 'skip' %}{% continue %}{% endif -%}\n"
    "  {%- set ns.n = ns.n + 1 -%}\n"
    "  {{ ns.n }}:{{ m['role'] }}:{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "{% endgeneration %}{% else %}{{ m['content'] | tojson }}{% endif %}\n"
    "  {%- if ns.n > 3 %}{% break %}{% endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt %}>{{ eos_token }}{% endif -%}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "  What is 2+2?  "}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": 'Sum 1..3 — «quoted» "json" <b>'},
    ],
    [
        {"role": "user", "content": "a"},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
    ],
]


def _tokenizer(tmp_path, template: str) -> Tokenizer:
    path = checkpoints.llada(tmp_path / "m")
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) | {"chat_template": template}
    cfg_path.write_text(json.dumps(cfg))
    return Tokenizer(path, 61)


@pytest.mark.parametrize(
    "template", [LLAMA3, CHATML, ROLE_TAGS, FEATURES], ids=["llama3", "chatml", "roles", "features"]
)
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_renders_like_transformers(tmp_path, template, conv, gen_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    tok = _tokenizer(tmp_path, template)
    messages = CONVERSATIONS[conv]
    specials = {k: v for k, v in tok.config.items() if k.endswith("_token") and isinstance(v, str)}
    want = render_jinja_template([messages], chat_template=template, add_generation_prompt=gen_prompt, **specials)[0][0]
    assert tok.apply_chat_template(messages, add_generation_prompt=gen_prompt) == want


def test_raise_exception_in_a_template_is_a_tokenizer_error(tmp_path):
    tok = _tokenizer(tmp_path, "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}")
    with pytest.raises(TokenizerError, match="chat_template raised: user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_the_sandbox_refuses_what_transformers_refuses(tmp_path):
    tok = _tokenizer(tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(TokenizerError, match="chat_template failed"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_named_templates_transformers_saves_as_files_are_chosen_by_name(tmp_path):
    """transformers writes the default template to chat_template.jinja and each named one to
    additional_chat_templates/<name>.jinja; that layout refused every name but 'default'."""
    from transformers import PreTrainedTokenizerFast

    path = checkpoints.llada(tmp_path / "m")
    hf = PreTrainedTokenizerFast.from_pretrained(path)
    hf.chat_template = {"default": CHATML, "shout": "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"}
    hf.save_pretrained(path)
    assert (path / "additional_chat_templates" / "shout.jinja").is_file() and (path / "chat_template.jinja").is_file()
    chat = [{"role": "user", "content": "abc"}]
    for name in (None, "default", "shout"):
        want = PreTrainedTokenizerFast.from_pretrained(path).apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True, **({} if name is None else {"chat_template": name})
        )
        assert Tokenizer(path, 61, chat_template_name=name).apply_chat_template(chat, add_generation_prompt=True) == (
            want
        ), name
    with pytest.raises(TokenizerError, match="chat template name 'tools' given, but .* hold only 'default', 'shout'"):
        Tokenizer(path, 61, chat_template_name="tools")


@pytest.mark.parametrize(
    "messages, message",
    [
        ("What is 2+2?", "messages must be a list of {'role', 'content'} objects, got str 'What is 2+2?'"),
        (["hi"], "messages[0] must be an object, got str"),
        ([{"role": "user"}], "messages[0]['content'] must be a string, got no such key"),
        ([{"role": "user", "content": None}], "messages[0]['content'] must be a string, got NoneType None"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            "got list [{'type': 'text', 'text': 'a'}] (join a list of text parts into one string)",
        ),
        ([{"role": 1, "content": "a"}], "messages[0]['role'] must be a string, got int 1"),
    ],
)
def test_messages_a_template_cannot_render_are_refused(tmp_path, messages, message):
    """Templates drop or print them: a bare string rendered as an empty chat, None as 'None'."""
    tok = _tokenizer(tmp_path, CHATML)
    with pytest.raises(TokenizerError) as e:
        tok.apply_chat_template(messages)
    assert message in str(e.value), e.value
