"""Tokenizer from ``tokenizer.json`` (``tokenizers``), chat template from ``tokenizer_config.json`` (jinja2)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from dinfer_rt.errors import TokenizerError


class Tokenizer:
    def __init__(self, model_dir: Path, model_vocab: int) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: not found (the model folder needs tokenizer.json)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"{path}: cannot be read by the tokenizers package: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        if self.vocab_size > model_vocab:
            raise TokenizerError(
                f"{path}: tokenizer has {self.vocab_size} tokens but the model's embedding has {model_vocab} rows"
            )
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                self.config = json.loads(cfg_path.read_text())
            except OSError as e:
                raise TokenizerError(f"{cfg_path}: cannot read ({e.strerror or e})") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{cfg_path}: not valid JSON ({e})") from None
            if not isinstance(self.config, dict):
                raise TokenizerError(f"{cfg_path}: expected a JSON object, found {type(self.config).__name__}")
        self.chat_template: str | None = self.config.get("chat_template")
        self._cfg_path = cfg_path

    def token_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):  # {"content": "<|...|>", ...} form
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    def special_id(self, key: str) -> int | None:
        """Id of ``bos_token`` / ``eos_token`` / ``pad_token`` / ``mask_token`` named in tokenizer_config.json."""
        return self.token_id(self.config.get(key))

    def encode(self, text: str) -> list[int]:
        enc = self._tok.encode(text, add_special_tokens=False)
        unk = self.special_id("unk_token")
        if unk is not None and unk in enc.ids:
            bad = sorted({text[a:b] for i, (a, b) in zip(enc.ids, enc.offsets) if i == unk})
            raise TokenizerError(f"prompt {text!r} has text the tokenizer does not know: {bad}")
        return enc.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Ids past the tokenizer's vocabulary (an embedding may have more rows
        than the tokenizer has tokens, e.g. padded to a multiple of 128) are never dropped:
        each is written as ``<|id:N|>``."""
        out, run = [], []
        for i in ids:
            if 0 <= i < self.vocab_size:
                run.append(i)
                continue
            if run:
                out.append(self._tok.decode(run, skip_special_tokens=skip_special_tokens))
                run = []
            out.append(f"<|id:{i}|>")
        if run:
            out.append(self._tok.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError(f"{self._cfg_path}: no 'chat_template'; run without chat mode")
        import jinja2

        try:
            template = _compiled_template(self.chat_template)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self._cfg_path}: chat_template does not parse: {e}") from None
        specials = {k: _content(self.config.get(k)) or "" for k in _SPECIAL_KEYS}
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **specials)
        except _TemplateRaised as e:
            raise TokenizerError(f"{self._cfg_path}: chat_template raised: {e}") from None
        except Exception as e:  # undefined names, wrong types: the template is at fault, not dinfer-rt
            raise TokenizerError(f"{self._cfg_path}: chat_template failed: {type(e).__name__}: {e}") from None


class _TemplateRaised(Exception):
    pass


_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token", "sep_token", "cls_token")


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str):
    """Compile a chat template once (a server renders it for every request)."""
    return _template_environment().from_string(source)


@functools.cache
def _template_environment():
    """The environment transformers renders chat templates in (``apply_chat_template``): a
    sandbox with trim_blocks / lstrip_blocks, the loop-controls extension, a ``{% generation %}``
    tag that renders its body, ``tojson`` without HTML escaping, and the globals
    ``raise_exception`` and ``strftime_now``: the same template gives the same text."""
    import datetime
    import json

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_from_template
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _raise_from_template(message: str) -> None:
    """``raise_exception(msg)``, the helper HF chat templates call to refuse a conversation."""
    raise _TemplateRaised(message)


def _content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
