"""Every bad input in docs/bad-inputs.md, one row a case: each must raise the project's own error
type (or, for the CLI, exit 2) with one line that contains the row's message. The last test
keeps the table and these cases the same."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dinfer_rt
from dinfer_rt import plugins
from dinfer_rt.engine_args import EngineArgs
from dinfer_rt.errors import DinferError
from dinfer_rt.testing import checkpoints

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "bad-inputs.md"


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable  # (env) -> None; raises the error under test
    message: str  # a fragment the one-line message must contain


class Env:
    """What a case may use: a fresh tiny checkpoint, pytest's monkeypatch and the CLI."""

    def __init__(self, tmp_path: Path, monkeypatch) -> None:
        self.tmp, self.monkeypatch = tmp_path, monkeypatch
        self._ckpt: Path | None = None

    @property
    def ckpt(self) -> Path:
        if self._ckpt is None:
            self._ckpt = checkpoints.llada(self.tmp / "m")
        return self._ckpt

    def config(self, **changes) -> Path:
        cfg = json.loads((self.ckpt / "config.json").read_text())
        cfg.update(changes)
        (self.ckpt / "config.json").write_text(json.dumps(cfg))
        return self.ckpt

    def tensor(self, name: str, value: torch.Tensor) -> Path:
        f = self.ckpt / "model.safetensors"
        t = load_file(str(f))
        t[name] = value
        save_file(t, str(f))
        return self.ckpt

    def tokenizer_config(self, **changes) -> Path:
        path = self.ckpt / "tokenizer_config.json"
        cfg = json.loads(path.read_text())
        cfg.update(changes)
        path.write_text(json.dumps(cfg))
        return self.ckpt

    def data(self, *lines: str) -> Path:
        """A JSONL data file with these lines."""
        path = self.tmp / "data.jsonl"
        path.write_text("\n".join(lines) + "\n")
        return path

    def cli(self, *argv: str) -> None:
        """Run the CLI; exit status 2 with a message becomes a DinferError carrying it."""
        import contextlib
        import io

        from dinfer_rt.cli import main

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as e:  # argparse's own errors
                rc = e.code
        lines = [ln for ln in err.getvalue().splitlines() if ln.startswith(("error:", "dinfer-rt"))]
        if rc == 2:
            raise DinferError(lines[-1] if lines else err.getvalue())
        raise AssertionError(f"exit {rc}, stderr {err.getvalue()!r}")


def _load(path: Path, **kw) -> None:
    dinfer_rt.load_model(path, **{"backend": "cpu", **kw})


def _sampling(**fields) -> Callable:
    return lambda env: dinfer_rt.SamplingParams(**fields).validate()


def _generate(prompt) -> Callable:
    def run(env: Env) -> None:
        llm = dinfer_rt.LLM(env.ckpt, backend="cpu")
        llm.generate(prompt, dinfer_rt.SamplingParams(gen_length=4, block_length=4))

    return run


def _template(template: str) -> Callable:
    def run(env: Env) -> None:
        env.tokenizer_config(chat_template=template)
        dinfer_rt.load_model(env.ckpt, backend="cpu").tokenizer.apply_chat_template([{"role": "user", "content": "a"}])

    return run


def _unreadable_config(env: Env) -> None:
    real = Path.read_text

    def deny(self, *a, **k):
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied")
        return real(self, *a, **k)

    env.monkeypatch.setattr(Path, "read_text", deny)
    _load(env.ckpt)


def _dump_ir_unwritable(env: Env) -> None:
    blocker = env.tmp / "file"
    blocker.write_text("x")
    env.monkeypatch.setenv("DINFER_DUMP_IR", str(blocker / "dumps"))
    _load(env.ckpt)


def _plugins_missing(env: Env) -> None:
    env.monkeypatch.setenv("DINFER_PLUGINS", "cpu,nosuchplugin")
    plugins.registry.cache_clear()
    _load(env.ckpt)


def _cfg(id: str, message: str, **changes) -> Case:
    """A case that edits config.json fields and loads the model."""
    return Case(id, lambda env: _load(env.config(**changes)), message)


CASES = [
    # ------------------------------------------------------------------ config.json
    _cfg("zero-layers", "field 'n_layers' must be > 0, found 0", n_layers=0),
    _cfg("negative-heads", "field 'n_heads' must be > 0, found -2", n_heads=-2),
    _cfg("zero-hidden", "field 'd_model' must be > 0, found 0", d_model=0),
    _cfg("zero-mlp", "field 'mlp_hidden_size' must be > 0", mlp_hidden_size=0),
    _cfg("zero-max-length", "field 'max_sequence_length' must be > 0, found 0", max_sequence_length=0),
    _cfg("zero-eps", "field 'rms_norm_eps' must be > 0, found 0.0", rms_norm_eps=0.0),
    _cfg("nan-eps", "field 'rms_norm_eps' must be a finite", rms_norm_eps=math.nan),
    _cfg("negative-rope-theta", "field 'rope_theta' must be > 0, found -1.0", rope_theta=-1.0),
    _cfg("heads-not-multiple-of-kv", "field 'n_heads' (4) is not a multiple of 'n_kv_heads' (5)", n_kv_heads=5),
    _cfg(
        "mask-id-outside-vocab",
        "field 'mask_token_id' = 999 is outside the vocabulary (embedding_size 61)",
        mask_token_id=999,
    ),
    _cfg("eos-id-outside-vocab", "field 'eos_token_id' = 70 is outside the vocabulary", eos_token_id=[1, 70]),
    _cfg("negative-pad-id", "field 'pad_token_id' must be >= 0", pad_token_id=-1),
    _cfg("bool-where-int", "field 'n_layers' should be int, found True", n_layers=True),
    _cfg(
        "more-layers-than-tensors",
        "the model has 1000000000000000000000000000000 layers by config.json, but the checkpoint holds only",
        n_layers=10**30,
    ),
    _cfg("mask-id-contradicts-tokenizer", "field 'mask_token_id' = 4 contradicts", mask_token_id=4),
    _cfg("pad-id-contradicts-tokenizer", "field 'pad_token_id' = 3 contradicts", pad_token_id=3),
    Case("model-path-is-a-file", lambda env: _load(env.ckpt / "config.json"), "is a file; the model path must be"),
    Case("unreadable-config", _unreadable_config, "config.json: cannot read (Permission denied)"),
    # ------------------------------------------------------------------ weights
    Case(
        "integer-weight",
        lambda env: _load(env.tensor("model.transformer.ln_f.weight", torch.ones(48, dtype=torch.int32))),
        "tensor 'model.transformer.ln_f.weight' has integer dtype torch.int32",
    ),
    Case(
        "nan-weight",
        lambda env: _load(env.tensor("model.transformer.ln_f.weight", torch.full((48,), math.nan))),
        "tensor 'model.transformer.ln_f.weight' holds 48 NaN/infinite value(s)",
    ),
    Case(
        "inf-weight",
        lambda env: _load(
            env.tensor("model.transformer.blocks.0.q_proj.weight", torch.tensor(math.inf).expand(48, 48).clone())
        ),
        "holds 2304 NaN/infinite value(s)",
    ),
    Case(
        "weight-overflows-dtype",
        lambda env: _load(env.tensor("model.transformer.ln_f.weight", torch.full((48,), 1e6)), dtype="float16"),
        "tensor 'model.transformer.ln_f.weight' overflows torch.float16",
    ),
    # ------------------------------------------------------------------ tokenizer and chat template
    Case("template-raises", _template("{{ raise_exception('no system role here') }}"), "raised: no system role here"),
    Case(
        "template-undefined-name",
        _template("{{ messages[0].content.nope.deeper }}"),
        "chat_template failed: UndefinedError",
    ),
    Case("template-does-not-parse", _template("{% for %}"), "chat_template does not parse"),
    # ------------------------------------------------------------------ SamplingParams
    Case("nan-temperature", _sampling(temperature=math.nan), "temperature must be a finite number, got nan"),
    Case("inf-threshold", _sampling(threshold=math.inf), "threshold must be a finite number, got inf"),
    Case("negative-cfg-scale", _sampling(cfg_scale=-1.0), "cfg_scale -1.0 must be in [0, 100]"),
    Case("float-gen-length", _sampling(gen_length=4.0), "gen_length must be int, got float 4.0"),
    Case("bool-batch-size", _sampling(batch_size=True), "batch_size must be int, got bool True"),
    Case("zero-sync-every", lambda env: EngineArgs(sync_every=0).validate(), "sync_every must be an int >= 1, got 0"),
    Case("negative-seed", _sampling(seed=-1), "seed -1 must be in [0, 9223372036854775807]"),
    Case("strategy-not-a-string", _sampling(strategy=3), "strategy must be str, got int 3"),
    Case("threshold-above-one", _sampling(threshold=1.5), "threshold 1.5 must be in (0, 1]"),
    # ------------------------------------------------------------------ token ids through the API
    Case("token-id-past-vocab", _generate([7, 999]), "prompt 0: token 1 is 999; token ids must be ints in [0, 61)"),
    Case("negative-token-id", _generate([-3, 7]), "prompt 0: token 0 is -3"),
    Case("non-int-token", _generate([[7, "a"]]), "prompt 0: token 1 is 'a'"),
    Case("prompt-wrong-type", _generate(5), "prompts must be a string or a non-empty list, got 5"),
    Case(
        "forward-ids-past-vocab",
        lambda env: dinfer_rt.load_model(env.ckpt, backend="cpu").forward(torch.tensor([[1, 61]])),
        "input_ids hold ids outside [0, 61) (min 1, max 61)",
    ),
    # ------------------------------------------------------------------ environment and backends
    Case("backend-extra-parts", lambda env: _load(env.ckpt, backend="cpu:::"), "'cpu:::' from the backend argument"),
    Case("backend-empty-flavour", lambda env: _load(env.ckpt, backend="cpu:"), "is not name[:flavour[:arch]]"),
    Case("cpu-unknown-flavour", lambda env: _load(env.ckpt, backend="cpu:fast"), "backend cpu has no flavour 'fast'"),
    Case("plugin-not-installed", _plugins_missing, "DINFER_PLUGINS names plugin(s) not installed: nosuchplugin"),
    Case("dump-ir-not-writable", _dump_ir_unwritable, "DINFER_DUMP_IR"),
    # ------------------------------------------------------------------ CLI numbers
    Case("eval-limit-zero", lambda env: env.cli("eval", "--limit", "0"), "argument --limit: must be >= 1, got 0"),
    Case(
        "eval-limit-not-int", lambda env: env.cli("eval", "--limit", "ten"), "--limit: expected an integer, got 'ten'"
    ),
    Case("bench-iters-zero", lambda env: env.cli("bench", "--iters", "0"), "argument --iters: must be >= 1, got 0"),
    Case("bench-warmup-negative", lambda env: env.cli("bench", "--warmup", "-1"), "argument --warmup: must be >= 0"),
    Case("ir-block-size-zero", lambda env: env.cli("ir", "--block-size", "0"), "argument --block-size: must be >= 1"),
    Case(
        "generate-gen-length-zero",
        lambda env: env.cli("generate", "ab", "--gen-length", "0"),
        "gen_length 0 must be >= 1",
    ),
    Case(
        "eval-limit-past-heldout",
        lambda env: env.cli("eval", "--limit", "1001"),
        "eval --limit 1001: the held-out set has 1000 items",
    ),
    Case(
        "eval-data-missing-field",
        lambda env: env.cli("eval", "--data", str(env.data('{"prompt": "ab", "answer": "x"}', '{"prompt": "cd"}'))),
        "data.jsonl:2: no field 'answer' (fields: prompt)",
    ),
    Case(
        "eval-data-not-json",
        lambda env: env.cli("eval", "--data", str(env.data('{"prompt": "ab", "answer": "x"}', "{oops"))),
        "data.jsonl:2: not a JSON object",
    ),
    Case(
        "eval-data-empty-prompt",
        lambda env: env.cli(
            "eval", "--data", str(env.data('{"prompt": "ab", "answer": "x"}', '{"prompt": " ", "answer": "x"}'))
        ),
        "data.jsonl:2: the prompt is an empty prompt",
    ),
    Case(
        "bench-data-unknown-text",
        lambda env: env.cli("bench", "--data", str(env.data('{"prompt": "ab"}', '{"prompt": "ab C"}'))),
        "data.jsonl:2: prompt 'ab C' has text the tokenizer does not know",
    ),
    Case(
        "eval-data-missing-file",
        lambda env: env.cli("eval", "--data", str(env.tmp / "nope.jsonl")),
        "nope.jsonl: cannot read the data file",
    ),
    Case(
        "eval-unknown-metric",
        lambda env: env.cli("eval", "--data", str(env.data('{"prompt": "a", "answer": "b"}')), "--metric", "f1"),
        "unknown metric 'f1'; choose one of: exact, contains, regex",
    ),
    Case(
        "eval-bad-regex",
        lambda env: env.cli(
            "eval", "--data", str(env.data('{"prompt": "a", "answer": "b"}')), "--metric", "regex", "--regex", "(a"
        ),
        "--regex '(a' is not a valid regular expression",
    ),
    Case("stop-not-strings", _sampling(stop=("ok", 3)), "stop must be a list of non-empty strings"),
    Case("stop-empty-string", _sampling(stop=("",)), "stop must be a list of non-empty strings"),
    Case("refresh-bound-negative", _sampling(refresh_bound=-1), "refresh_bound -1 must be >= 0"),
    Case(
        "validate-report-unwritable",
        lambda env: env.cli("validate", "--backends", "cpu", "--json", "/proc/nope/report.json"),
        "report folder /proc/nope is not a writable folder",
    ),
    # ------------------------------------------------------------------ round 3 (issue #42)
    Case("cfg-scale-overflows", _sampling(cfg_scale=1e39), "cfg_scale 1e+39 must be in [0, 100]"),
    Case("temperature-overflows", _sampling(temperature=1e300), "temperature 1e+300 must be in [0, 100]"),
    Case("credit-alpha-overflows", _sampling(credit_alpha=1e39), "credit_alpha 1e+39 must be in [0, 100]"),
    Case("factor-overflows", _sampling(factor=1e39), "factor 1e+39 must be in (0, 1000000]"),
    Case(
        "sync-every-past-a-block",
        lambda env: dinfer_rt.LLM(env.ckpt, backend="cpu", sync_every=41).generate(
            [[7, 8]], dinfer_rt.SamplingParams(gen_length=8, block_length=8)
        ),
        "sync_every 41 must be <= 40: a block runs at most 40 steps",
    ),
    Case(
        "cli-cfg-scale-overflows",
        lambda env: env.cli("generate", "ab", "--cfg-scale", "1e39"),
        "cfg_scale 1e+39 must be in [0, 100]",
    ),
    Case(
        "serve-drain-timeout-nan",
        lambda env: _serve(env, "--drain-timeout", "nan"),
        "drain_timeout (--drain-timeout) must be a finite number in [0, 86400] seconds, got nan",
    ),
    Case(
        "serve-shutdown-after-inf",
        lambda env: env.cli("serve", "--port", "0", "--shutdown-after-s", "inf"),
        "shutdown_after_s (--shutdown-after-s) must be a finite number in (0, 31536000] seconds, got inf",
    ),
    Case(
        "serve-max-model-len-past-model",
        lambda env: _serve(env, "--max-model-len", "100000"),
        "--max-model-len 100000 exceeds the model's max_sequence_length 64",
    ),
    Case(
        "serve-max-num-seqs-past-memory",
        lambda env: _serve(env, "--max-num-seqs", "1000000000", "--kv-block-size", "0"),  # contiguous rows
        "the KV pool would need",
    ),
    Case(
        "serve-model-length-past-memory",
        lambda env: _serve(env, "--model", str(env.config(max_sequence_length=10**12))),
        "or --max-model-len (1000000000000, from the model's max_sequence_length)",
    ),
    Case(
        "boolean-env-not-boolean",
        lambda env: _with_env(env, DINFER_TRACE_PLUGINS="maybe"),
        "DINFER_TRACE_PLUGINS='maybe' is not a boolean; use 1, 0, true or false (any case)",
    ),
    Case(
        "plugins-env-names-none",
        lambda env: _with_env(env, DINFER_PLUGINS=",,,"),
        "DINFER_PLUGINS=',,,' names no plugin",
    ),
    Case(
        "model-env-missing",
        lambda env: _with_env(env, DINFER_MODEL="/nonexistent/model"),
        "DINFER_MODEL='/nonexistent/model': no such model folder",
    ),
    Case(
        "precision-schedule-unknown-dtype",
        _sampling(precision_schedule="int8@0.5,float8"),
        "the last stage 'float8' must name the model's precision: full, fp32, float32, bf16, bfloat16",
    ),
    Case(
        "output-is-a-folder",
        lambda env: env.cli(
            "eval", "--data", str(env.data('{"prompt": "ab", "answer": "b"}')), "--output", str(env.tmp)
        ),
        "is a folder; give a file path (or - for standard output)",
    ),
    Case(
        "prompt-lone-surrogate",
        _generate("a\ud800b"),
        r"has text the tokenizer does not know: ['\ud800'] (lone surrogates)",
    ),
    Case(
        "cli-prompt-untokenisable",
        lambda env: env.cli("generate", "ab C"),
        "has text the tokenizer does not know: [' ', 'C']",
    ),
]


def _header_entry(**changes) -> Callable:
    """Rewrite one tensor's entry in model.safetensors' header (the data left as it is), then load."""

    def run(env: Env) -> None:
        import struct

        f = env.ckpt / "model.safetensors"
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header["model.transformer.ln_f.weight"].update(changes)
        text = json.dumps(header).encode()
        f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
        _load(env.ckpt)

    return run


def _fifo_weights(env: Env) -> None:
    import os

    f = env.ckpt / "model.safetensors"
    f.unlink()
    os.mkfifo(f)  # opened for reading, it would block until a writer came
    _load(env.ckpt)


def _index_not_utf8(env: Env) -> None:
    (env.ckpt / "model.safetensors.index.json").write_bytes(b"\xff\xfe{}")
    _load(env.ckpt)


def _generate_with(prompt, **kw) -> Callable:
    def run(env: Env) -> None:
        params = kw.pop("params", dinfer_rt.SamplingParams(gen_length=4, block_length=4))
        dinfer_rt.LLM(env.ckpt, backend="cpu").generate(prompt, params, **kw)

    return run


def _kv_past_memory(env: Env) -> None:
    env.config(max_sequence_length=10**15)
    big = 2**40  # positions: 2 layers x K and V x 4 heads x 12 dims x 4 bytes each = 768 TiB
    params = dinfer_rt.SamplingParams(gen_length=big, block_length=big)
    dinfer_rt.LLM(env.ckpt, backend="cpu").generate([[7, 8]], params)


def _mask_token_unknown(env: Env) -> None:
    cfg = json.loads((env.ckpt / "config.json").read_text())
    del cfg["mask_token_id"]
    (env.ckpt / "config.json").write_text(json.dumps(cfg))
    env.tokenizer_config(mask_token="<|MASK|>")
    _load(env.ckpt)


def _template_text_unknown(env: Env) -> None:
    env.tokenizer_config(chat_template="{{ bos_token }}# {{ messages[0]['content'] }}<|eot_id|>")
    dinfer_rt.LLM(env.ckpt, backend="cpu").generate("ab", dinfer_rt.SamplingParams(gen_length=4, block_length=4))


class _DeviceBackend:
    """Just enough of a device backend for ``loader.auto_dtype`` (no GPU here)."""

    def device(self) -> torch.device:
        return torch.device("cuda")


def _auto_dtype_of(env: Env, value: str) -> None:
    from dinfer_rt.loader import auto_dtype
    from dinfer_rt.model_spec import parse_spec

    auto_dtype(parse_spec(env.config(torch_dtype=value)), _DeviceBackend())


CASES += [
    # ------------------------------------------------------------------ a loading / API probe (this round)
    Case("weights-not-a-regular-file", _fifo_weights, "model.safetensors: is not a regular file"),
    Case(
        "header-offsets-not-integers",
        _header_entry(data_offsets=["0", "192"]),
        "corrupt safetensors header entry for tensor 'model.transformer.ln_f.weight' (needs dtype, shape: a list of "
        "non-negative integers",
    ),  # fmt: skip
    Case(
        "header-negative-offset",
        _header_entry(data_offsets=[-4, 188]),
        "corrupt safetensors header entry for tensor 'model.transformer.ln_f.weight'",
    ),  # fmt: skip
    Case(
        "header-shape-negative",
        _header_entry(shape=[-48]),
        "corrupt safetensors header entry for tensor 'model.transformer.ln_f.weight'",
    ),  # fmt: skip
    Case("index-not-utf8", _index_not_utf8, "model.safetensors.index.json: not a valid safetensors index (not UTF-8"),
    Case(
        "quantization-config-not-object",
        lambda env: _load(env.config(quantization_config="gptq")),
        "config.json: quantization_config must be an object",
    ),
    Case(
        "gptq-desc-act-not-bool",
        lambda env: _load(env.config(quantization_config={"quant_method": "gptq", "bits": 4, "desc_act": "false"})),
        "quantization_config: desc_act 'false' must be true or false",
    ),
    Case(
        "bos-token-not-in-tokenizer",
        lambda env: _load(env.tokenizer_config(bos_token="BOS")),
        "tokenizer_config.json: field 'bos_token' = 'BOS' is not a token of",
    ),
    Case("mask-token-not-in-tokenizer", _mask_token_unknown, "field 'mask_token' = '<|MASK|>' is not a token of"),
    Case(
        "chat-template-text-unknown",
        _template_text_unknown,
        "the chat template writes text the tokenizer does not know (prompt 0 alone encodes)",
    ),
    Case(
        "generate-flag-not-bool",
        _generate_with([[7, 8]], allow_mask_in_prompt="no"),
        "generate: allow_mask_in_prompt must be True or False, got str 'no'",
    ),
    Case("empty-prompt-named", _generate_with(["ab", " "]), "prompt 1 is an empty prompt"),
    Case("empty-id-prompt-named", _generate_with([[7], []]), "prompt 1 is an empty list of token ids"),
    Case(
        "default-block-length-named",
        _generate_with(["ab"], params=dinfer_rt.SamplingParams(gen_length=10)),
        "gen_length 10 is not a multiple of block_length 40 (the default: no block_length was set)",
    ),
    Case("kv-cache-past-memory", _kv_past_memory, "the KV cache for 1 row(s) x"),
    Case(
        "auto-dtype-names-the-field",
        lambda env: _auto_dtype_of(env, "float8"),
        "config.json: field 'torch_dtype' = 'float8' (unknown dtype 'float8'",
    ),
    Case(
        "load-model-argument-type",
        lambda env: _load(env.ckpt, backend=5),
        "load_model: backend must be a backend name or None, got int 5",
    ),
    Case(
        "load-model-passes-a-string",
        lambda env: _load(env.ckpt, disable_passes="cse"),
        "load_model: disable_passes must be a list of pass names, got str 'cse'",
    ),
    Case("load-model-empty-path", lambda env: dinfer_rt.load_model(""), "load_model: path is empty ('')"),
    Case(
        "forward-takes-a-tensor",
        lambda env: dinfer_rt.load_model(env.ckpt, backend="cpu").forward([[7, 8]]),
        "input_ids must be a [batch, length] integer tensor, got list",
    ),
]


def _serve(env: Env, *args: str) -> None:
    """``dinfer-rt serve`` on a free port, bounded: refused before it loads, or it exits by itself
    after 20 s (then the case fails: exit 0 is no error)."""
    env.cli("serve", "--port", "0", "--shutdown-after-s", "20", *args)


def _with_env(env: Env, **variables: str) -> None:
    """Set environment variables and load a model (the default model where DINFER_MODEL is set)."""
    for name, value in variables.items():
        env.monkeypatch.setenv(name, value)
    plugins.registry.cache_clear()
    dinfer_rt.LLM(None if "DINFER_MODEL" in variables else env.ckpt, backend="cpu")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gives_one_line_naming_the_problem(case, tmp_path, monkeypatch):
    with pytest.raises(DinferError) as e:
        case.run(Env(tmp_path, monkeypatch))
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert case.message in msg, msg


def _table_rows() -> list[list[str]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("|") and len(cells) == 3 and re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            rows.append(cells)
    return rows


def test_the_table_in_docs_lists_exactly_these_cases_and_messages():
    rows = {cells[0].strip("`"): cells for cells in _table_rows()}
    assert set(rows) == {c.id for c in CASES}
    for c in CASES:
        assert f"`{c.message}`" == rows[c.id][2].replace("\\|", "|"), c.id


def test_every_test_the_table_points_to_exists():
    """The rows handled elsewhere name a test function; each must exist in that file."""
    import ast

    named = re.findall(r"`(tests/[a-z_]+\.py)::([a-z0-9_]+)`", TABLE.read_text())
    assert len(named) > 10
    for file, func in named:
        tree = ast.parse((ROOT / file).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert func in defined, f"{file}::{func}"
