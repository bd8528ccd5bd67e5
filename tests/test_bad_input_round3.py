"""Reliability round 3 (issue #42, items 1, 3, 5, 7, 8), one test per input class, parametrised
over its cases:

- the server answers every client mistake with OpenAI's JSON error body (400, or 404 / 405 / 413
  where HTTP says so), never a 500 or a stall; neutral default values are accepted (one real
  server process for the module, driven by raw HTTP and the official ``openai`` client);
- files are written where the user points: a real symlink, FIFO, ``/dev/stdout``, ``-``;
- boolean ``DINFER_*`` variables take only 0 / 1 / true / false; ``DINFER_PLUGINS`` and
  ``DINFER_MODEL`` errors name the variable without echoing a long value in full;
- precision schedules take ``--dtype``'s spellings.

The API / CLI rows with a one-line message are cases of ``tests/test_bad_input_table.py``; the
server rows are the second table of ``docs/bad-inputs.md``, kept equal to SERVER_CASES here."""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch

import dinfer_rt
from dinfer_rt import envs, plugins
from dinfer_rt.errors import DinferError
from dinfer_rt.files import check_output_file, write_text_atomic
from dinfer_rt.precision import PrecisionSchedule
from dinfer_rt.testing.serving import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "bad-inputs.md"
LIMIT = 4 * 1024 * 1024  # the default --max-request-bytes


# ---------------------------------------------------------------------------------------- server


@dataclass(frozen=True)
class Call:
    id: str
    method: str
    path: str
    body: object  # bytes: sent as they are; else JSON-encoded (json.dumps escapes lone surrogates)
    status: int
    param: str | None
    message: str  # a fragment the error message must contain


SERVER_CASES = [
    Call("untokenisable-prompt", "POST", "/v1/completions", {"prompt": "ab C"}, 400, "prompt",
         "'prompt' 'ab C' has text the tokenizer does not know: [' ', 'C']"),
    Call("lone-surrogate-prompt", "POST", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt",
         r"has text the tokenizer does not know: ['\ud800'] (lone surrogates)"),
    Call("untokenisable-chat-content", "POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "x Y"}]}, 400,
         "messages[1].content", "'messages[1].content' 'x Y' has text the tokenizer does not know: [' ', 'Y']"),
    Call("prompt-longer-than-the-model", "POST", "/v1/completions", {"prompt": "a" * 3_000_000}, 400, "prompt",
         "'prompt' is 3000000 characters: at least 200000 tokens, past the max model length 64"),
    Call("body-past-max-request-bytes", "POST", "/v1/completions", {"prompt": "a" * (LIMIT + 10)}, 413, None,
         f"this server accepts at most {LIMIT} (--max-request-bytes)"),
    Call("integer-past-digit-limit", "POST", "/v1/completions", b'{"prompt": "ab", "seed": ' + b"9" * 5000 + b"}",
         400, None, "not valid JSON: Exceeds the limit (4300 digits)"),
    Call("nesting-too-deep", "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None,
         "not valid JSON: nested too deeply"),
    Call("engine-setting-in-a-request", "POST", "/v1/completions", {"prompt": "ab", "sync_every": 1000}, 400,
         "sync_every", "'sync_every' is an engine setting, not a request field"),
    Call("factor-overflows", "POST", "/v1/completions", {"prompt": "ab", "strategy": "factor", "factor": 1e39},
         400, "factor", "factor 1e+39 must be in (0, 1000000]"),
    Call("top-logprobs-past-20", "POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "ab"}], "logprobs": True, "top_logprobs": 21}, 400,
         "top_logprobs", "'top_logprobs' must be in [0, 20], got 21"),
    Call("response-format-json", "POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "ab"}], "response_format": {"type": "json_object"}}, 400,
         "response_format", "is not supported by this server (only None or {'type': 'text'})"),
    Call("long-model-name", "POST", "/v1/completions", {"prompt": "ab", "model": "m" * 10_000}, 404, "model",
         "... (10002 characters) does not exist"),
    Call("unknown-route", "GET", "/v1/nope", None, 404, None, "no such endpoint: GET /v1/nope"),
    Call("wrong-method", "GET", "/v1/completions", None, 405, None, "method not allowed: GET /v1/completions"),
]  # fmt: skip

NEUTRAL = [
    ("completions", {"logprobs": None}),
    ("completions", {"logit_bias": {}}),
    ("completions", {"logit_bias": None}),
    ("completions", {"stream_options": {}}),
    ("completions", {"stream_options": {"include_usage": False}}),
    ("chat/completions", {"logprobs": False}),
    ("chat/completions", {"top_logprobs": 0}),
    ("chat/completions", {"response_format": {"type": "text"}}),
    ("chat/completions", {"tools": []}),
    ("chat/completions", {"tool_choice": "none"}),
    ("chat/completions", {"top_p": 1.0, "frequency_penalty": 0, "presence_penalty": 0.0}),
]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--strategy", "threshold", "--block-length", "8", "--gen-length", "8", cwd=ROOT, lifetime=240)
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield s
    s.stop()


def _send(server, call: Call) -> httpx.Response:
    body = call.body if isinstance(call.body, bytes) or call.body is None else json.dumps(call.body).encode()
    headers = {"content-type": "application/json"}
    return httpx.request(call.method, server.url + call.path, content=body, headers=headers, timeout=60)


@pytest.mark.parametrize("call", SERVER_CASES, ids=[c.id for c in SERVER_CASES])
def test_a_client_mistake_is_an_openai_error_never_a_500(server, call):
    r = _send(server, call)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert r.status_code == call.status == err["code"], err
    assert err["param"] == call.param, err
    assert call.message in err["message"], err
    assert len(err["message"]) < 600 and "\n" not in err["message"]  # one line, no huge echo
    if r.status_code == 405:
        assert r.headers["allow"] == "POST"


def test_the_openai_client_sees_a_400_naming_the_field(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model="dinfer-rt-embedded", prompt="Hello world")
    assert e.value.body["param"] == "prompt" and "'H'" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # (the client cannot send a lone surrogate: raw HTTP above)
        server.client.chat.completions.create(
            model="dinfer-rt-embedded",
            messages=[{"role": "system", "content": "ab"}, {"role": "user", "content": "a!"}],
        )
    assert e.value.body["param"] == "messages[1].content" and "['!']" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        server.client.with_options(base_url=server.url + "/v2").models.list()


@pytest.mark.parametrize("endpoint, extra", NEUTRAL, ids=[f"{e}-{'-'.join(x)}" for e, x in NEUTRAL])
def test_neutral_values_clients_send_by_default_are_accepted(server, endpoint, extra):
    body = {"prompt": "ab"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "ab"}]}
    r = httpx.post(f"{server.url}/v1/{endpoint}", json={**body, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_the_openai_client_with_its_neutral_arguments_is_answered(server):
    r = server.client.chat.completions.create(
        model="dinfer-rt-embedded", messages=[{"role": "user", "content": "ab"}], logprobs=False,
        response_format={"type": "text"}, tool_choice="none", tools=[], logit_bias={}, top_p=1,
    )  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("path", ["/v1/completions/", "/v1/chat/completions/"])
def test_a_trailing_slash_is_redirected_to_the_route_keeping_the_method(server, path):
    """307 to the route without the slash, query kept, as FastAPI answers for its own routes (the
    generation endpoints are served ahead of FastAPI: ``asgi.py``); a client that follows it gets
    the answer."""
    body = {"prompt": "ab"} if path == "/v1/completions/" else {"messages": [{"role": "user", "content": "ab"}]}
    r = httpx.post(server.url + path + "?x=1", json=body, timeout=60)
    assert r.status_code == 307, r.text
    assert httpx.URL(server.url + path).join(r.headers["location"]) == httpx.URL(server.url + path[:-1] + "?x=1")
    r = httpx.post(server.url + path, json=body, timeout=60, follow_redirects=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_a_huge_request_does_not_hold_up_other_clients(server):
    """An 8 MB body (413) and a 3 MB prompt (400 from its length alone) while /health is polled:
    neither may stall the event loop (tokenising 3 MB took ~10 s on the loop before)."""
    answers: dict[str, int] = {}

    def big(name: str, chars: int) -> None:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a" * chars}, timeout=120)
        answers[name] = r.status_code

    threads = [threading.Thread(target=big, args=a) for a in (("8MB", 8_000_000), ("3MB", 3_000_000))]
    for t in threads:
        t.start()
    worst = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert answers == {"8MB": 413, "3MB": 400}
    assert worst < 1.0, f"/health took {worst:.2f} s during the huge requests"


def test_tokenising_releases_the_gil():
    """Tokenizer.encode must let other threads (a server's event loop) run while it works."""
    from dinfer_rt.loader import EMBEDDED_MODEL
    from dinfer_rt.tokenizer import Tokenizer

    tok = Tokenizer(EMBEDDED_MODEL, 61)
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.002)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    ids = tok.encode("abcdefghij" * 30_000)
    t1 = time.perf_counter()
    done.set()
    ticker.join()
    assert len(ids) == 300_000
    during = [t for t in ticks if t0 <= t <= t1]
    gaps = [b - a for a, b in zip([t0, *during], [*during, t1])]
    assert max(gaps) < max(0.25, (t1 - t0) / 4), f"encode took {t1 - t0:.2f} s, longest stall {max(gaps):.2f} s"


def test_the_server_table_in_docs_lists_exactly_these_cases():
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("|") and len(cells) == 4 and re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            rows[cells[0].strip("`")] = cells
    assert set(rows) == {c.id for c in SERVER_CASES}
    for c in SERVER_CASES:
        assert rows[c.id][2] == str(c.status), c.id
        assert rows[c.id][3] == f"`{c.message}`".replace("|", "\\|"), c.id


# ------------------------------------------------------------------------------------------ files


def test_a_symlink_is_written_through_and_the_target_keeps_its_mode(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target.name)
    write_text_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == target.name
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to("made-later.json")
    write_text_atomic(dangling, "x")
    assert dangling.is_symlink() and (tmp_path / "made-later.json").read_text() == "x"


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o755])
def test_replacing_a_regular_file_keeps_its_mode(tmp_path, mode):
    f = tmp_path / "out.jsonl"
    f.write_text("old")
    f.chmod(mode)
    write_text_atomic(f, "new")
    assert f.read_text() == "new" and stat.S_IMODE(f.stat().st_mode) == mode
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary file left


def test_a_new_file_gets_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "new.md", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.md").stat().st_mode) == 0o640


def test_a_fifo_is_written_directly(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_text_atomic(fifo, "through the pipe\n")
    reader.join(timeout=10)
    assert got == ["through the pipe\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_character_device_is_written_directly_and_never_replaced():
    write_text_atomic("/dev/null", "discarded")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    if os.path.exists("/dev/full"):
        with pytest.raises(DinferError, match="cannot write output /dev/full: No space left on device"):
            write_text_atomic("/dev/full", "x")
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


@pytest.mark.parametrize("stdout_is", ["file", "pipe"])
def test_dev_stdout_is_written_in_order_with_the_rest_of_the_output(tmp_path, stdout_is):
    code = (
        "from dinfer_rt.files import write_text_atomic; print('before', flush=True); "
        "write_text_atomic('/dev/stdout', 'through /dev/stdout\\n'); print('after')"
    )
    want = "before\nthrough /dev/stdout\nafter\n"
    if stdout_is == "file":
        out = tmp_path / "captured.txt"
        with open(out, "w") as fh:
            subprocess.run([sys.executable, "-c", code], stdout=fh, check=True, timeout=60)
        assert out.read_text() == want
    else:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
        assert r.stdout == want
    assert os.path.islink("/dev/stdout")


def test_dash_is_standard_output(capsys):
    assert write_text_atomic("-", "to stdout\n") == "-"
    assert capsys.readouterr().out == "to stdout\n"


@pytest.mark.parametrize("flag", ["eval", "validate-json", "validate-markdown"])
def test_a_folder_is_refused_before_any_computation(tmp_path, monkeypatch, capsys, flag):
    from dinfer_rt import cli
    from dinfer_rt.validation import runner

    def no_compute(*a, **k):
        raise AssertionError("computation started")

    monkeypatch.setattr(cli, "_llm", no_compute)
    monkeypatch.setattr(runner, "validate", no_compute)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "ab", "answer": "b"}\n')
    argv = {
        "eval": ["eval", "--data", str(data), "--output", str(tmp_path)],
        "validate-json": ["validate", "--backends", "cpu", "--json", str(tmp_path)],
        "validate-markdown": ["validate", "--backends", "cpu", "--markdown", str(tmp_path)],
    }[flag]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} is a folder; give a file path (or - for standard output)" in err
    assert tmp_path.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]


def test_check_output_file_accepts_what_can_be_written(tmp_path):
    assert check_output_file("-", "--output") == "-"
    assert check_output_file("/dev/stdout", "--output") == Path("/dev/stdout")
    assert check_output_file(tmp_path / "sub" / "new.jsonl", "--output") == tmp_path / "sub" / "new.jsonl"
    with pytest.raises(DinferError, match="is not a writable folder"):
        check_output_file("/proc/nope/out.jsonl", "--output")


def test_eval_output_to_dev_stdout_and_dash(tmp_path, capfd):
    """End to end: the per-item JSONL arrives on standard output, both spellings."""
    from dinfer_rt import cli

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "qwertyuiop", "answer": "x"}) + "\n")
    for target in ("/dev/stdout", "-"):
        argv = ["eval", "--data", str(data), "--output", target, "--json", "--strategy", "threshold"]
        assert cli.main(argv + ["--block-length", "8", "--gen-length", "8"]) == 0
        records = [json.loads(x) for x in capfd.readouterr().out.splitlines() if x.startswith('{"line"')]
        assert [r["prompt"] for r in records] == ["qwertyuiop"], target
    assert os.path.islink("/dev/stdout")


# ---------------------------------------------------------------------------- environment variables


@pytest.mark.parametrize("name", sorted(envs.BOOLEANS))
@pytest.mark.parametrize("value", ["yes", "on", "2", "maybe"])
def test_a_boolean_variable_refuses_other_values_naming_it(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    plugins.registry.cache_clear()
    with pytest.raises(DinferError) as e:
        plugins.registry()
    assert str(e.value) == f"{name}={value!r} is not a boolean; use 1, 0, true or false (any case)"


@pytest.mark.parametrize("value, want", [("1", True), ("TRUE", True), (" true ", True), ("0", False),
                                         ("False", False), ("", None)])  # fmt: skip
def test_a_boolean_variable_accepts_0_1_true_false_any_case(monkeypatch, value, want):
    for name, default in envs.BOOLEANS.items():
        monkeypatch.setenv(name, value)
        assert envs.flag(name) is (default if want is None else want), name


@pytest.mark.parametrize(
    "value, message",
    [
        (",,,", "DINFER_PLUGINS=',,,' names no plugin"),
        (" , ", "DINFER_PLUGINS=' , ' names no plugin"),
        ("x" * 5000, "DINFER_PLUGINS names plugin(s) not installed: " + "x" * 80 + "... (1 name(s), 5000 characters)"),
    ],
)
def test_dinfer_plugins_errors_name_the_variable(monkeypatch, value, message):
    monkeypatch.setenv("DINFER_PLUGINS", value)
    plugins.registry.cache_clear()
    with pytest.raises(DinferError) as e:
        plugins.registry()
    assert message in str(e.value) and len(str(e.value)) < 400


def test_a_long_dinfer_backend_is_not_echoed_in_full(monkeypatch):
    monkeypatch.setenv("DINFER_BACKEND", "x:" * 3000)
    with pytest.raises(DinferError) as e:
        plugins.select_backend()
    assert "from DINFER_BACKEND='x:x:" in str(e.value) and "... (6000 characters)" in str(e.value)
    assert len(str(e.value)) < 400


@pytest.mark.parametrize("kind", ["missing", "file", "long"])
def test_dinfer_model_errors_name_the_variable(tmp_path, monkeypatch, kind):
    import dinfer_rt

    value = {"missing": str(tmp_path / "nope"), "file": __file__, "long": "/x" * 3000}[kind]
    monkeypatch.setenv("DINFER_MODEL", value)
    with pytest.raises(DinferError) as e:
        dinfer_rt.LLM()
    msg = str(e.value)
    assert msg.startswith("DINFER_MODEL=") and len(msg) < 300, msg
    assert ("no such model folder" if kind != "file" else "is not a folder") in msg


# ----------------------------------------------------------------------------- precision spellings


@pytest.mark.parametrize(
    "last, dtype",
    [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("FLOAT32", torch.float32),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("float64", torch.float64),
        ("full", torch.bfloat16),
    ],
)
def test_a_precision_schedule_takes_the_dtype_spellings_of_dtype(last, dtype):
    from dinfer_rt.dtypes import resolve_dtype

    schedule = PrecisionSchedule.parse(f"int8@0.5,{last}")
    schedule.check_model(dtype, None)  # the last stage is the model's own precision
    other = torch.float16 if dtype != torch.float16 else torch.float32
    if last == "full":  # 'full' is whatever the model holds
        schedule.check_model(other, None)
        return
    assert resolve_dtype(last) == dtype  # the same spelling --dtype takes
    assert schedule.full == {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp64")
    with pytest.raises(DinferError, match="is not the model's dtype"):
        schedule.check_model(other, None)


# ---------------------------------------------------------------- Python API argument types (#42 item 6)

API_SLIPS = [
    (lambda: dinfer_rt.LLM(5), "LLM: model must be a path, a hub id, a loaded Model or None, got int 5"),
    (lambda: dinfer_rt.LLM(backend=5), "LLM: backend must be a backend name or None, got int 5"),
    (lambda: dinfer_rt.LLM(dtype=3.5), "LLM: dtype must be a dtype name, a torch.dtype or None, got float 3.5"),
    (lambda: dinfer_rt.LLM(tensor_parallel_size=0), "LLM: tensor_parallel_size must be an int >= 1, got 0"),
    (lambda: dinfer_rt.LLM(data_parallel_size=2.0), "LLM: data_parallel_size must be an int >= 1, got 2.0"),
    (lambda: dinfer_rt.LLM(check_weights="no"), "LLM: check_weights must be True or False, got str 'no'"),
    (  # a loaded model's loading arguments would be ignored: its answers were fp32's
        lambda: dinfer_rt.LLM(_loaded(), quantization="fp8"),
        "LLM: quantization='fp8': a loading argument, and this Model is already loaded (cpu, float32): "
        "pass its path instead, or give it to load_model",
    ),
    (  # ignored: one process splits nothing
        lambda: dinfer_rt.LLM(expert_parallel=True),
        "LLM: expert_parallel=True splits MoE experts over tensor-parallel ranks; it needs tensor_parallel_size > 1",
    ),
    (
        lambda: dinfer_rt.LLM(_loaded(), backend="reference", check_weights=False),
        "LLM: backend='reference', check_weights=False: loading arguments, and this Model is already loaded",
    ),
]


@functools.cache
def _loaded():
    return dinfer_rt.load_model(backend="cpu")


def test_python_api_type_slips_name_the_argument():
    """Each slip is refused before anything loads or any process starts (the docs table lists
    the same calls and messages)."""
    import multiprocessing

    table = TABLE.read_text()
    before = multiprocessing.active_children()
    for call, message in API_SLIPS:
        with pytest.raises(DinferError) as err:
            call()
        assert message in str(err.value) and f"`{message}`" in table
    assert multiprocessing.active_children() == before  # nothing fell back to starting workers
    llm = dinfer_rt.LLM()
    message = "generate: params must be a SamplingParams, got dict (SamplingParams(**that_dict) builds one)"
    with pytest.raises(DinferError, match=re.escape(message)):
        llm.generate("abc", {"strategy": "threshold"})
    assert f"`{message}`" in table


def test_ctrl_c_during_start_up_is_one_line_and_exit_130():
    """#42 item 2: a Ctrl-C while the command line still imports (torch: the first second of
    every command). Where a real signal lands in that second is up to the scheduler (and torch
    swallows one that lands in its numpy import), so the interrupt is raised at a fixed point:
    the import of ``dinfer_rt.cli``, which pulls in torch."""
    code = (
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'dinfer_rt.cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['dinfer-rt', 'generate', 'qwertyuiop']\n"
        "from dinfer_rt.console import main\n"
        "sys.exit(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130 and done.stderr == "interrupted\n" and done.stdout == "", done.stderr
