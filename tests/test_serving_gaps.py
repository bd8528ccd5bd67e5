"""Issue #40 (serving), four gaps closed:

- the data-parallel front (``workers.ReplicaPool``) refuses a request past ``max_model_len`` with
  the in-process engine's message, K/V bytes included (each replica reports its bytes per
  position when ready);
- the front admits per replica the rows its KV pool holds (``--kv-cache-memory`` may hold fewer
  than ``max_num_seqs``) + ``max_queue``, not ``max_num_seqs + max_queue``;
- chat logprobs ``bytes`` are a token's raw bytes, so byte tokens that split a multi-byte
  character join back into its UTF-8 (their text alone is U+FFFD);
- the KV-budget rows of ``docs/bad-inputs.md`` (ids ``kv:...``) are these cases, message for message.

One ``ReplicaPool`` (two replicas of the embedded model, a budget of 1.5 rows each) serves the
replica cases; one ``serve --data-parallel-size 2`` checks the 429 a client sees.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import dinfer_rt
from dinfer_rt.engine import Engine, QueueFull
from dinfer_rt.errors import DinferError, GenerationError
from dinfer_rt.kv_pool import kv_row_bytes
from dinfer_rt.loader import default_model_path
from dinfer_rt.openai_protocol import choice_logprobs
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.testing.serving import ServerProcess
from dinfer_rt.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "bad-inputs.md"
PARAMS = SamplingParams(strategy="threshold", block_length=8)  # gen_length 40
EMBEDDED_ROW = 2 * 6 * 65 * 6 * 32 * 4  # K and V x 6 layers x 65 positions x 6 KV heads x head_dim 32 x fp32
BUDGET = EMBEDDED_ROW + EMBEDDED_ROW // 2  # holds one pool row
LONG = [7] * 30  # + 40 generated = 70 > the embedded model's 64


@pytest.fixture(scope="module")
def model():
    return dinfer_rt.load_model(backend="cpu")


@pytest.fixture(scope="module")
def replicas():
    """Two replica processes, each allowed 8 rows by max_num_seqs but one by its KV budget (contiguous
    rows: a paged pool's rows are table rows, and its budget bounds blocks instead)."""
    from dinfer_rt.workers import ReplicaPool

    load = {"path": str(default_model_path()), "backend": "cpu"}
    engine = {"max_num_seqs": 8, "kv_cache_memory": BUDGET, "prefix_cache_bytes": 0, "kv_block_size": 0}
    pool = ReplicaPool(2, load, engine, max_queue=1, timeout=180)
    try:
        yield pool
    finally:
        pool.close()
        pool.shutdown()


def _engine_refusal(model, prompt: list[int]) -> str:
    engine = Engine(model, max_num_seqs=1, prefix_cache_bytes=0)
    try:
        with pytest.raises(GenerationError) as e:
            engine.check_request(prompt, PARAMS, None)
        return str(e.value)
    finally:
        engine.release()


# ---------------------------------------------------------------- 1. the replicas' admission names the K/V bytes


def test_replicas_refuse_a_request_past_the_model_length_as_the_engine_does_naming_its_kv_bytes(replicas, model):
    assert kv_row_bytes(model.spec, model.dtype, 65) == EMBEDDED_ROW
    assert replicas.kv_bytes_per_position == EMBEDDED_ROW // 65
    with pytest.raises(GenerationError) as e:
        replicas.submit(LONG, PARAMS)
    got = str(e.value)
    assert got == _engine_refusal(model, LONG)
    per = EMBEDDED_ROW // 65
    assert f"(its K/V would need 630.0 KiB, {70 * per} bytes: 70 positions x {per} bytes; " in got
    assert not replicas.inflight  # refused before it was routed


# ---------------------------------------------------------------- 2. capacity follows the KV pool rows


def test_the_replica_front_admits_each_replicas_kv_pool_rows_plus_max_queue(replicas, model):
    assert replicas.kv_rows == [1, 1] and replicas.capacities == [2, 2] and replicas.capacity == 4
    assert replicas.kv_pool_bytes == 2 * EMBEDDED_ROW and replicas.kv_pool_rows == 2
    prompts = [[7 + i, 8, 9] for i in range(4)]
    reqs = [replicas.submit(p, PARAMS) for p in prompts]  # not stepped: all four stay in flight
    assert replicas.load == [2, 2]
    with pytest.raises(QueueFull) as e:  # max_num_seqs (8) + max_queue would have admitted 18
        replicas.submit([7, 8, 9], PARAMS)
    msg = str(e.value)
    assert msg == (
        "every replica is full (each admits its KV pool rows + max_queue 1 requests): "
        "replica 0 holds 2 of 2 (1 rows), replica 1 holds 2 of 2 (1 rows)"
    )
    while not all(r.done for r in reqs):
        replicas.step()
    offline = dinfer_rt.LLM(model).generate(prompts, PARAMS)
    for req, want in zip(reqs, offline):
        assert req.error is None and req.output_ids == want.token_ids
    assert replicas.load == [0, 0]
    again = replicas.submit([7, 8, 9], PARAMS)  # room again once they finished
    while not again.done:
        replicas.step()


def test_the_replica_front_routes_a_batch_whole_or_not_at_all(replicas):
    """``ReplicaPool.submit_many``: a batch past the replicas' room is ``QueueFull`` with nothing
    routed (loads, routing counts and requests in flight unchanged); one that fits is placed whole."""
    assert replicas.load == [0, 0]
    served = list(replicas.served)
    with pytest.raises(QueueFull, match="no room for a batch of 5 requests: every replica is full"):
        replicas.submit_many([[7 + i, 8, 9] for i in range(5)], PARAMS)
    assert replicas.load == [0, 0] and replicas.served == served and not replicas.inflight
    reqs = replicas.submit_many([[7 + i, 8, 9] for i in range(4)], PARAMS)
    assert replicas.load == [2, 2] and sum(replicas.served) == sum(served) + 4
    with pytest.raises(QueueFull):
        replicas.submit_many([[7, 8, 9]], PARAMS)
    while not all(r.done for r in reqs):
        replicas.step()
    assert all(r.error is None for r in reqs) and replicas.load == [0, 0]


def test_an_aborted_request_hands_its_replicas_room_back_at_once_and_only_once(replicas):
    """A client that goes away: ``ReplicaPool.abort`` gives its room back before the replica's
    engine drops the row (its next step), so a full front admits the next request at once; the
    abort's finish, when it comes, does not give the room back a second time."""
    assert replicas.load == [0, 0]
    reqs = [replicas.submit([7 + i, 8, 9], PARAMS) for i in range(4)]  # not stepped: the front is full
    with pytest.raises(QueueFull):
        replicas.submit([7, 8, 9], PARAMS)
    gone = reqs[0]
    replicas.abort(gone.id)
    replicas.abort(gone.id)  # a second abort (both of an answer's paths may ask) changes nothing
    assert sum(replicas.load) == 3 and not gone.done
    late = replicas.submit([11, 8, 9], PARAMS)  # admitted beside the cancelled row, not a QueueFull
    with pytest.raises(QueueFull):
        replicas.submit([7, 8, 9], PARAMS)
    while not all(r.done for r in reqs + [late]):
        replicas.step()
    assert gone.finish_reason == "abort"
    assert all(r.error is None and r.finish_reason != "abort" for r in reqs[1:] + [late])
    assert replicas.load == [0, 0] and not replicas.inflight


def test_served_replicas_answer_a_batch_past_their_kv_rows_with_a_400_naming_them():
    """``serve --data-parallel-size 2 --kv-cache-memory`` (one row each) ``--max-queue 1``: a
    completions batch of 4 prompts fits (2 x (1 row + 1 queued)), one of 5 can never fit: a 400
    naming ``prompt`` and the replicas' rows, and nothing is routed to either replica."""
    s = ServerProcess(
        "--data-parallel-size", "2", "--max-num-seqs", "8", "--max-queue", "1",
        "--kv-cache-memory", str(BUDGET), "--kv-block-size", "0", "--strategy", "threshold", "--block-length", "8",
        "--gen-length", "8", "--no-prefix-cache", cwd=ROOT, lifetime=240,
    )  # fmt: skip
    try:
        url = s.url + "/v1/completions"
        model = httpx.get(s.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "max_tokens": 8}
        fits = httpx.post(url, json={**body, "prompt": [[7 + i, 8] for i in range(4)]}, timeout=120)
        assert fits.status_code == 200, fits.text
        assert len(fits.json()["choices"]) == 4
        served = [r["served"] for r in httpx.get(s.url + "/health").json()["replicas"]]
        full = httpx.post(url, json={**body, "prompt": [[7 + i, 8] for i in range(5)]}, timeout=120)
        assert full.status_code == 400, full.text  # max_num_seqs (8) + max_queue would have admitted 18
        err = full.json()["error"]
        assert err["param"] == "prompt", err
        assert "at most 4 requests at once (2 replicas x (1 KV pool rows + max_queue 1))" in err["message"], err
        assert [r["served"] for r in httpx.get(s.url + "/health").json()["replicas"]] == served
        # the replicas' pools in /metrics; a request too long for a row is told its K/V bytes
        assert s.metric("dinfer_kv_pool_rows") == 2 and s.metric("dinfer_kv_pool_bytes") == 2 * EMBEDDED_ROW
        long = httpx.post(url, json={**body, "prompt": [7] * 60, "max_tokens": 3}, timeout=60)  # 60 + 8 > 64
        per = EMBEDDED_ROW // 65
        assert long.status_code == 400, long.text
        assert f"(its K/V would need 612.0 KiB, {68 * per} bytes: 68 positions x {per} bytes; " in long.text
        assert s.metric("dinfer_prefix_cache_approximate") == 0
        s.proc.terminate()
        s.proc.wait(timeout=60)
        log = s.proc.stdout.read()
        assert "dinfer-rt prefix cache: off (--no-prefix-cache / --prefix-cache-bytes 0)" in log, log[-2000:]
    finally:
        s.stop()


# ---------------------------------------------------------------- 3. logprobs bytes are the token's raw bytes


def _byte_level(folder: Path) -> Tokenizer:
    """GPT-2-style byte-level BPE: every byte a piece, one merge ("a", "b"); a special token with
    a non-ASCII character (its bytes are its UTF-8, not table-mapped)."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["ab"] = len(vocab)
    tok = HF(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|né|>"])
    return _save(tok, folder)


def _byte_fallback(folder: Path) -> Tokenizer:
    """Sentencepiece-style: ``<0xNN>`` byte pieces for characters outside the vocabulary."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "a": 258, "b": 259}
    tok = HF(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _save(tok, folder)


def _save(tok, folder: Path) -> Tokenizer:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    return Tokenizer(folder, tok.get_vocab_size())


@pytest.mark.parametrize("make", [_byte_level, _byte_fallback], ids=["byte-level-bpe", "byte-fallback"])
def test_logprobs_bytes_of_byte_tokens_join_into_the_split_characters(make, tmp_path):
    tok = make(tmp_path / "tok")
    text = "abé😀"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    split = [t for t in ids if tok.decode([t]) == "\ufffd"]
    assert len(split) >= 6, "é and 😀 must each be split into byte tokens for this test"
    tops = [[(t, -0.5), (ids[0], -1.5)] for t in ids]  # alternatives: the token itself and the first one
    content = choice_logprobs(tok, True, ids, [-0.5] * len(ids), tops)["content"]
    # sentencepiece: "▁" is a space, the one its Metaspace pre-tokenizer puts before the text
    lead = b" " if make is _byte_fallback else b""
    assert b"".join(bytes(c["bytes"]) for c in content) == lead + text.encode()
    for c, t in zip(content, ids):
        assert c["token"] == tok.decode([t], skip_special_tokens=False)  # still a string, U+FFFD when split
        assert [a["bytes"] for a in c["top_logprobs"]] == [c["bytes"], content[0]["bytes"]]
    assert [content[i]["bytes"] for i in range(len(ids)) if ids[i] in split] == [
        [b] for b in "é😀".encode()
    ]  # one byte each
    # a token that is whole text: its bytes are its text's UTF-8 (sentencepiece: "▁" a space)
    whole = [c for c in content if c["token"] != "\ufffd"]
    assert all(bytes(c["bytes"]).strip() == c["token"].encode().strip() for c in whole)
    if make is _byte_fallback:  # a word after a space keeps it, so the bytes join into the text
        words = tok.encode("ab ab")
        joined = b"".join(tok.token_bytes(t) for t in words)
        assert joined == b" ab ab" and tok.decode(words) == "ab ab"


@pytest.mark.parametrize("bad", [-1, "5", None, 1.0, True])
def test_token_bytes_refuses_what_is_no_token_id(bad, model):
    from dinfer_rt.errors import TokenizerError

    with pytest.raises(TokenizerError, match=f"token_bytes: token_id must be an int >= 0, got {bad!r}"):
        model.tokenizer.token_bytes(bad)


def test_a_special_tokens_bytes_are_its_text_not_byte_mapped(tmp_path):
    tok = _byte_level(tmp_path / "tok")
    special = tok.token_id("<|né|>")
    assert tok.token_bytes(special) == "<|né|>".encode()  # é is also a byte-level piece character (0xE9)
    assert tok.token_bytes(tok.vocab_size + 3) == f"<|id:{tok.vocab_size + 3}|>".encode()


def test_the_embedded_tokenizers_bytes_are_unchanged(model):
    tok = model.tokenizer
    for t in range(tok.vocab_size):
        assert tok.token_bytes(t) == tok.decode([t], skip_special_tokens=False).encode(), t


# ---------------------------------------------------------------- 4. docs/bad-inputs.md's kv: rows


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable  # (pytest request) -> None; raises the error under test
    message: str


def _request_past_the_pool(request) -> None:
    model = request.getfixturevalue("model")
    block = kv_row_bytes(model.spec, model.dtype, 4)
    Engine(model, max_num_seqs=2, kv_cache_memory=5 * block, prefix_cache_bytes=0).submit([7] * 20, PARAMS)


def _budget(model_fixture: str, **fields) -> Callable:
    def run(request) -> None:
        Engine(request.getfixturevalue(model_fixture), max_num_seqs=4, **fields)

    return run


def _fraction(request) -> None:
    request.getfixturevalue("monkeypatch").setattr(dinfer_rt.engine, "available_memory", lambda device: 1_000_000)
    Engine(request.getfixturevalue("model"), kv_cache_memory_fraction=0.001, kv_block_size=0)


def _serve(request) -> None:
    from dinfer_rt.cli import main

    capsys = request.getfixturevalue("capsys")
    argv = ["serve", "--port", "0", "--shutdown-after-s", "20", "--kv-cache-memory", "1KiB", "--kv-block-size", "0"]
    assert main(argv) == 2
    raise DinferError(capsys.readouterr().err.strip().removeprefix("error: "))


def _serve_flags(*argv: str) -> Callable:
    def run(request) -> None:
        from dinfer_rt.cli import main

        capsys = request.getfixturevalue("capsys")
        assert main(["serve", "--port", "0", "--shutdown-after-s", "20", *argv]) == 2
        raise DinferError(capsys.readouterr().err.strip().removeprefix("error: "))

    return run


def _engine_args(**fields) -> Callable:
    def run(request) -> None:
        from dinfer_rt.engine_args import EngineArgs

        EngineArgs.build(**fields)

    return run


def _replicas(request) -> None:
    request.getfixturevalue("replicas").submit(LONG, PARAMS)


CASES = [
    Case(
        "kv:budget-below-two-blocks",
        _budget("model", kv_cache_memory=1024),
        "the KV-cache budget of 1024 bytes (1.0 KiB; kv_cache_memory, --kv-cache-memory) holds 0 KV blocks: a paged "
        "pool needs 2 blocks (one is the trash block) of 36864 bytes (36.0 KiB: blocks of 4 positions "
        "(--kv-block-size) x 6 layers x K and V x 6 KV heads x head_dim 32 x 4 bytes (float32)); raise "
        "--kv-cache-memory (or --kv-cache-memory-fraction) to at least 73728 bytes",
    ),
    Case(
        "kv:request-past-the-pool",
        _request_past_the_pool,
        "prompt (20 tokens) + 40 generated = 60 tokens need 15 KV blocks of 4 positions (540.0 KiB, 552960 bytes) "
        "but the whole KV pool holds 4 (144.0 KiB); raise --kv-cache-memory (or --kv-cache-memory-fraction), or "
        "shorten the prompt or gen_length",
    ),
    Case(
        "kv:budget-below-one-row",
        _budget("model", kv_cache_memory=1024, kv_block_size=0),
        "the KV-cache budget of 1024 bytes (1.0 KiB; kv_cache_memory, --kv-cache-memory) holds no pool row: "
        "one row needs 599040 bytes (585.0 KiB: 65 positions (max_model_len 64 + 1 scratch) x 6 layers x K and V x "
        "6 KV heads x head_dim 32 x 4 bytes (float32)); raise --kv-cache-memory (or --kv-cache-memory-fraction) "
        "to at least 599040 bytes, or lower --max-model-len (64)",
    ),
    Case(
        "kv:fraction-below-one-row",
        _fraction,
        "the KV-cache budget of 1000 bytes (1000 B; kv_cache_memory_fraction 0.001 (--kv-cache-memory-fraction) "
        "of 1000000 bytes free) holds no pool row: one row needs 599040 bytes",
    ),
    Case(
        "kv:serve-budget-below-one-row",
        _serve,
        "serve: the KV-cache budget of 1024 bytes (1.0 KiB; kv_cache_memory, --kv-cache-memory) holds no pool row",
    ),
    Case(
        "kv:prefix-cache-unknown-mode",
        _engine_args(prefix_cache="yes"),
        "EngineArgs: prefix_cache must be one of auto, approximate (--prefix-cache), got 'yes'",
    ),
    Case(
        "kv:prefix-cache-approximate-but-off",
        _engine_args(prefix_cache="approximate", prefix_cache_bytes=0),
        "EngineArgs: prefix_cache 'approximate' contradicts prefix_cache_bytes 0 (the cache off; --prefix-cache "
        "approximate, --no-prefix-cache / --prefix-cache-bytes 0); give one of them",
    ),
    Case(
        "kv:serve-prefix-cache-approximate-and-off",
        _serve_flags("--prefix-cache", "approximate", "--no-prefix-cache"),
        "serve: --no-prefix-cache contradicts --prefix-cache approximate; give one of them",
    ),
    Case(
        "kv:replicas-request-past-max-model-len",
        _replicas,
        "prompt (30 tokens) + 40 generated = 70 tokens exceeds the max model length 64 (its K/V would need "
        "630.0 KiB, 645120 bytes: 70 positions x 9216 bytes; a KV pool row holds 64 positions, 576.0 KiB)",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kv_budget_bad_input_gives_one_line_naming_the_numbers(case, request):
    with pytest.raises(DinferError) as e:
        case.run(request)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert case.message in msg, msg


def test_the_docs_table_lists_exactly_these_kv_cases():
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("|") and len(cells) == 3 and re.fullmatch(r"`kv:[a-z0-9-]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[2]
    assert set(rows) == {c.id for c in CASES}
    for c in CASES:
        assert rows[c.id] == f"`{c.message}`", c.id


SERVER_WIDE = [
    ("precision-schedule", {"strategy": "threshold", "cache": "dual", "precision_schedule": "int8@0.5,fp32"}),
    ("guidance", {"strategy": "low_confidence", "cache": "none", "cfg_scale": 1.0}),
]


@pytest.mark.parametrize("name, knobs", SERVER_WIDE, ids=[n for n, _ in SERVER_WIDE])
def test_a_server_wide_schedule_or_guidance_answers_as_offline_and_a_request_cannot_name_it(name, knobs):
    """``serve --precision-schedule`` / ``--cfg-scale`` run for every request, answered as
    ``LLM.generate`` with the same settings; the field in a request body is a 400 naming it (it
    would otherwise be ignored: a different answer than the client asked for)."""
    from dinfer_rt.demo import task

    knobs = {**knobs, "block_length": 8, "gen_length": 16}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in knobs.items()]
    letters = [it.letters for it in task.heldout(3)]
    want = [o.text for o in dinfer_rt.LLM().generate(letters, SamplingParams(**knobs))]
    s = ServerProcess(*flags, "--no-prefix-cache", cwd=ROOT, lifetime=120)
    try:
        assert s.chats(letters, max_tokens=16) == want
        field = "precision_schedule" if "precision_schedule" in knobs else "cfg_scale"
        body = {"messages": [{"role": "user", "content": letters[0]}], field: knobs[field]}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    finally:
        s.stop()


def test_a_chat_template_that_does_not_parse_stops_the_server_at_start_up(tmp_path):
    """It loaded, then every chat request was a 400 blaming the client's ``messages``."""
    import shutil

    from dinfer_rt.server import ServeConfig, build_app

    folder = tmp_path / "broken"
    shutil.copytree(default_model_path(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% for %}"}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    broken = dinfer_rt.load_model(folder, backend="cpu")  # completions alone never render it: it loads
    with pytest.raises(DinferError, match="serve: .*tokenizer_config.json: chat_template does not parse") as e:
        build_app(broken, SamplingParams(), ServeConfig(max_num_seqs=1), engine_thread=False)
    assert str(e.value).endswith("(fix it, or pick another with --chat-template-name)")
