"""Tokenizer from ``tokenizer.json`` (``tokenizers``), chat template from ``tokenizer_config.json`` (jinja2)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from dinfer_rt.errors import GenerationError, TokenizerError


class Tokenizer:
    """``tokenizer.json`` through the ``tokenizers`` package, and tokenizer_config.json's chat
    template and special tokens, read and checked the way transformers reads them."""

    def __init__(self, model_dir: Path, model_vocab: int, chat_template_name: str | None = None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        require_file(path, "tokenizer.json", TokenizerError, "the model folder needs tokenizer.json")
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
        self.config: dict[str, Any] = tokenizer_config(model_dir)
        self._cfg_path = cfg_path
        self.specials: dict[str, str | None] = {k: special_token(self.config, k, cfg_path) for k in _SPECIAL_KEYS}
        split = self.config.get("split_special_tokens", False)
        if not isinstance(split, bool):
            raise TokenizerError(f"{cfg_path}: field 'split_special_tokens' must be true or false, found {split!r}")
        # transformers' split_special_tokens=True: special tokens typed in text are split as plain text.
        self._tok.encode_special_tokens = split
        self._dir = model_dir
        self.chat_template, self.chat_template_source = select_chat_template(model_dir, self.config, chat_template_name)

    def choose_chat_template(self, name: str) -> None:
        """Render with the template called ``name`` (tokenizer_config.json's list of named ones)."""
        self.chat_template, self.chat_template_source = select_chat_template(self._dir, self.config, name)

    def compiled_chat_template(self):
        """The chat template compiled (None without one); one that does not parse is a
        ``TokenizerError`` naming its file (``serve`` asks at start-up, not at every request)."""
        if not self.chat_template:
            return None
        import jinja2

        try:
            return _compiled_template(self.chat_template)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.chat_template_source}: chat_template does not parse: {e}") from None

    def token_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):  # {"content": "<|...|>", ...} form
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    def special_id(self, key: str) -> int | None:
        """Id of ``bos_token`` / ``eos_token`` / ``pad_token`` / ``mask_token`` named in tokenizer_config.json."""
        token = self.specials.get(key) if key in self.specials else special_token(self.config, key, self._cfg_path)
        return self.token_id(token)

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (None past the vocabulary)."""
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes ``token_id`` stands for (OpenAI's logprobs ``bytes``). A token that holds
        part of a multi-byte character decodes alone to U+FFFD, so its text's UTF-8 would be
        wrong: a byte-level BPE piece maps back through GPT-2's byte-to-unicode table, a
        sentencepiece byte-fallback piece ``<0xNN>`` is the byte NN and its word pieces their text
        with "▁" as the space it stands for (the first token of a text keeps the space the decoder
        strips), an added or special token is its content's UTF-8 (literal text, never
        byte-mapped); any other token is the UTF-8 of its decoding alone, as :meth:`decode` gives it."""
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise TokenizerError(f"token_bytes: token_id must be an int >= 0, got {token_id!r}")
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._tok.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if piece is not None:
            if self._byte_pieces == "byte_level" and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            if self._byte_pieces == "byte_fallback":
                if m := _BYTE_FALLBACK_PIECE.fullmatch(piece):
                    return bytes([int(m.group(1), 16)])
                # a word piece: "▁" is the space before a word, which decoding it alone strips
                return piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8", "surrogatepass")

    @functools.cached_property
    def _byte_pieces(self) -> str | None:
        """How this tokenizer's pieces spell bytes, read from its decoder: ``byte_level`` (GPT-2 /
        Qwen / LLaDA BPE: every piece is bytes through the byte-to-unicode table),
        ``byte_fallback`` (sentencepiece-style ``<0xNN>`` pieces) or None (pieces are text)."""
        decoder = self._tok.decoder
        if decoder is None:
            return None
        kinds = set(re.findall(r'"type":\s*"(\w+)"', decoder.__getstate__().decode()))
        if "ByteLevel" in kinds:
            return "byte_level"
        return "byte_fallback" if "ByteFallback" in kinds else None

    @functools.cached_property
    def _added(self) -> dict[int, str]:
        """Added tokens (special ones included) by id: their content is literal text, not pieces."""
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    def encode(self, text: str) -> list[int]:
        _refuse_surrogates(text)
        # encode_batch releases the GIL while it works (encode holds it: a long prompt tokenised on
        # a server's worker thread would stall its event loop)
        enc = self._tok.encode_batch([text], add_special_tokens=False)[0]
        unk = self.special_id("unk_token")
        if unk is not None and unk in enc.ids:
            bad = sorted({text[a:b] for i, (a, b) in zip(enc.ids, enc.offsets) if i == unk})
            raise TokenizerError(f"prompt {_shown(text)} has text the tokenizer does not know: {bad}")
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

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """The conversation as the model's chat template renders it, exactly as transformers'
        ``apply_chat_template(..., tokenize=False)`` does: the special tokens the config names
        and ``template_kwargs`` (e.g. SDAR's ``enable_thinking=False``; vLLM's
        ``chat_template_kwargs``) are visible to the template; a kwarg overrides a special token.
        ``messages`` must be a list of objects with a string ``role`` and ``content``: templates
        drop or print anything else as text (a bare string rendered as an empty chat)."""
        if not self.chat_template:
            raise TokenizerError(f"{self._cfg_path}: no 'chat_template'; run without chat mode")
        _check_messages(messages)

        reserved = sorted(set(template_kwargs) & {"messages", "add_generation_prompt", "tools", "documents"})
        if reserved:
            raise TokenizerError(f"chat template kwarg {reserved[0]!r} is set by dinfer-rt itself; it cannot be passed")
        template = self.compiled_chat_template()
        # transformers passes only the special tokens that are set (an unset one stays undefined)
        specials = {k: v for k, v in self.specials.items() if v is not None}
        try:
            return template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**specials, **template_kwargs},
            )
        except _TemplateRaised as e:
            raise TokenizerError(f"{self.chat_template_source}: chat_template raised: {e}") from None
        except Exception as e:  # undefined names, wrong types: the template is at fault, not dinfer-rt
            raise TokenizerError(
                f"{self.chat_template_source}: chat_template failed: {type(e).__name__}: {e}"
            ) from None


def _check_messages(messages: object) -> None:
    """What a chat template can render: ``[{"role": str, "content": str, ...}, ...]``."""
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(
            f"apply_chat_template: messages must be a list of {{'role', 'content'}} objects, got "
            f"{type(messages).__name__} {_short(messages)}"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TokenizerError(f"apply_chat_template: messages[{i}] must be an object, got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "no such key" if key not in m else f"{type(m[key]).__name__} {_short(m[key])}"
                hint = " (join a list of text parts into one string)" if isinstance(m.get(key), list) else ""
                raise TokenizerError(f"apply_chat_template: messages[{i}]['{key}'] must be a string, got {got}{hint}")


_SURROGATE = re.compile("[\ud800-\udfff]")
_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_table() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` reversed: the character a byte-level BPE piece spells each byte
    with -> that byte (printable Latin-1 bytes stand for themselves, the rest for 256 + n)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


_BYTE_OF_CHAR = _gpt2_byte_table()


def _refuse_surrogates(text: str) -> None:
    """Lone UTF-16 surrogates (``"\\ud800"`` in JSON) are no text: no tokenizer can encode them."""
    if isinstance(text, str) and (bad := sorted(set(_SURROGATE.findall(text)))):
        raise TokenizerError(f"prompt {_shown(text)} has text the tokenizer does not know: {bad} (lone surrogates)")


def _shown(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut to ``limit`` characters for a long prompt (errors do not echo it in full)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


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


def tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """tokenizer_config.json of ``model_dir`` as a dict ({} when the folder has none)."""
    return _json_object(model_dir / "tokenizer_config.json")


def _json_object(path: Path) -> dict[str, Any]:
    """An optional JSON object file ({} when absent); unreadable or not an object: one line naming it."""
    if not (path.exists() or path.is_symlink()):
        return {}
    require_file(path, path.name, TokenizerError, "")
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def special_token(config: dict[str, Any], key: str, cfg_path: Path) -> str | None:
    """A special-token field of tokenizer_config.json as its string: a string, ``null`` (unset), or
    transformers' serialised ``AddedToken`` (an object with a string ``content``). Anything else
    (a number, a list, an object without ``content``, an empty string) is refused naming the
    field: rendering it as an empty string would silently change every prompt."""
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, dict):
        content = value.get("content")
        if not isinstance(content, str) or not content:
            raise TokenizerError(
                f"{cfg_path}: field {key!r} is an object without a non-empty string 'content': {_short(value)}"
            )
        return content
    if not isinstance(value, str):
        raise TokenizerError(
            f"{cfg_path}: field {key!r} must be a token string (or an object with 'content'), "
            f"found {type(value).__name__} {_short(value)}"
        )
    if not value:
        raise TokenizerError(f"{cfg_path}: field {key!r} is an empty string; use null for no such token")
    return value


def select_chat_template(model_dir: Path, config: dict[str, Any], name: str | None = None) -> tuple[str | None, str]:
    """The chat template transformers would use, and where it came from (for messages).

    Sources, in transformers' order: a ``chat_template.jinja`` file beside the tokenizer (newer
    transformers saves it there, its named ones in ``additional_chat_templates/<name>.jinja``),
    else tokenizer_config.json's ``chat_template``: a string, or a list of ``{"name",
    "template"}`` objects (the ``default`` one unless ``name`` picks another).
    A field of any other shape is a one-line error naming it."""
    cfg_path = model_dir / "tokenizer_config.json"
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists() or jinja.is_symlink():
        text = _template_file(jinja, "chat_template.jinja")
        if name is not None and name != "default":
            return _additional_template(model_dir, name, str(jinja))
        return text, str(jinja)
    value = config.get("chat_template")
    where = f"{cfg_path}: field 'chat_template'"
    if value is None:
        if name is not None:
            raise TokenizerError(f"chat template name {name!r} given, but {cfg_path} has no 'chat_template'")
        return None, str(cfg_path)
    if isinstance(value, str):
        if not value.strip():
            raise TokenizerError(f"{where} is an empty string; remove it (no template) or give one")
        return _named_single(value, name, str(cfg_path))
    if not isinstance(value, list):
        raise TokenizerError(
            f"{where} must be a template string or a list of {{name, template}} objects, "
            f"found {type(value).__name__} {_short(value)}"
        )
    templates: dict[str, str] = {}
    for i, item in enumerate(value):
        ok = isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)
        if not ok or not item["name"] or not item["template"].strip():
            raise TokenizerError(
                f"{where}[{i}] must be an object with a non-empty string 'name' and 'template', found {_short(item)}"
            )
        if item["name"] in templates:
            raise TokenizerError(f"{where} names template {item['name']!r} twice")
        templates[item["name"]] = item["template"]
    if not templates:
        raise TokenizerError(f"{where} is an empty list; remove it (no template) or give one")
    pick = "default" if name is None else name
    if pick not in templates:
        have = ", ".join(repr(n) for n in templates)
        hint = "choose one with --chat-template-name" if name is None else "check --chat-template-name"
        raise TokenizerError(f"{where} has no template named {pick!r} (it has {have}): {hint}")
    return templates[pick], f"{cfg_path} (template {pick!r})"


ADDITIONAL_TEMPLATES = "additional_chat_templates"
"""transformers saves named templates beside ``chat_template.jinja`` (the default) as
``additional_chat_templates/<name>.jinja``."""


def _additional_template(model_dir: Path, name: str, default_source: str) -> tuple[str, str]:
    """The named template ``additional_chat_templates/<name>.jinja``, or an error listing the names."""
    folder = model_dir / ADDITIONAL_TEMPLATES
    have = sorted(p.stem for p in folder.glob("*.jinja")) if folder.is_dir() else []
    if name not in have:
        names = ", ".join(repr(n) for n in ["default", *have])
        where = f"{default_source} and {folder}" if have else f"{default_source} (no {ADDITIONAL_TEMPLATES}/ folder)"
        raise TokenizerError(f"chat template name {name!r} given, but {where} hold only {names}")
    path = folder / f"{name}.jinja"
    return _template_file(path, "chat template"), str(path)


def _template_file(path: Path, what: str) -> str:
    """A template file's text: readable, UTF-8, not blank (each problem named with the path)."""
    require_file(path, what, TokenizerError, "")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    if not text.strip():
        raise TokenizerError(f"{path}: the chat template file is empty")
    return text


def _named_single(template: str, name: str | None, source: str) -> tuple[str, str]:
    """A single template answers only to the name ``default``."""
    if name is not None and name != "default":
        raise TokenizerError(f"chat template name {name!r} given, but {source} holds one unnamed template")
    return template, source


def require_file(path: Path, what: str, error: type[Exception], hint: str) -> None:
    """``path`` must be a readable regular file (through symlinks); a folder, a symlink loop, a
    dangling symlink or a missing file is each named as such, not all as "not found"."""
    import errno
    import os

    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(f"{path}: {what} is a symlink loop") from None
        if path.is_symlink():
            raise error(f"{path}: {what} is a symlink to {os.readlink(path)!r}, which does not exist") from None
        if e.errno == errno.ENOENT:
            raise error(f"{path}: not found" + (f" ({hint})" if hint else "")) from None
        raise error(f"{path}: cannot read {what} ({e.strerror or e})") from None
    import stat

    if stat.S_ISDIR(st.st_mode):
        raise error(f"{path}: {what} is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: {what} is not a regular file")


def refuse_mask_token(ids: list[int], mask_id: int | None, where: str, allow: bool = False) -> None:
    """A prompt must not hold the model's mask id unless the caller asked to infill (``allow``):
    the scheduler treats every mask position as a blank to fill, so a user who types the mask
    token's text (SDAR's ``<|MASK|>`` is not even a special token) would silently turn their prompt
    into an infilling request (SGLang #35998). ``where`` names the prompt (field, argument)."""
    if allow or mask_id is None:
        return
    for pos, t in enumerate(ids):
        if t == mask_id:
            raise GenerationError(
                f"{where} holds the mask token (id {mask_id}) at token {pos}: the model would fill it in as a "
                "blank; remove it, or set allow_mask_in_prompt (CLI: --allow-mask-in-prompt) to infill on purpose"
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """``eos_token_id`` of generation_config.json (an id or a list of ids; () without the file).

    Instruct checkpoints list their end-of-turn token there (SDAR: ``[151645, 151643]``) while
    config.json often names only ``<|endoftext|>``: transformers' ``generate`` stops on this list,
    so dinfer-rt must too."""
    path = model_dir / "generation_config.json"
    cfg = _json_object(path)
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TokenizerError(f"{path}: field 'eos_token_id' should be an id >= 0 or a list of them, found {eos!r}")
    return tuple(ids)


def stop_ids(
    tok: Tokenizer | None,
    config_eos: tuple[int, ...] | list[int],
    family_tokens: tuple[str, ...] | list[str],
    model_dir: Path | None = None,
) -> tuple[int, ...]:
    """Every id that ends a generation: config.json's ``eos_token_id`` (an id or a list),
    generation_config.json's, the tokenizer's ``eos_token`` and the family's turn-end / end-of-text
    token strings (e.g. LLaDA-8B ``<|eot_id|>`` 126348 and ``<|endoftext|>`` 126081)."""
    ids = set(config_eos)
    if model_dir is not None:
        ids.update(generation_eos_ids(model_dir))
    if tok is not None:
        for text in family_tokens:
            i = tok.token_id(text)
            if i is not None:
                ids.add(i)
        eos = tok.special_id("eos_token")
        if eos is not None:
            ids.add(eos)
    return tuple(sorted(ids))
