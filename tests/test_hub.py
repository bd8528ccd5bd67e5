"""Hub ids for ``--model``: resolution through huggingface_hub's own cache and download code.

The hub cache is written by the tests in huggingface_hub's exact layout
(``models--ORG--NAME/{blobs,refs,snapshots/<commit>}``, snapshot files as relative symlinks to
blobs named by their git / sha256 hashes) from the embedded model. Downloads are tested against a
bounded HTTP server on 127.0.0.1 that speaks the parts of the hub's API that ``snapshot_download``
calls (``HF_ENDPOINT``): repo info, the recursive tree listing and ``resolve`` (HEAD and GET).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from dinfer_rt.errors import ConfigError
from dinfer_rt.hub import HUB_FILES, is_hub_id, resolve_model

EMBEDDED = Path(__file__).resolve().parents[1] / "dinfer_rt" / "demo" / "model"
REPO = "acme/letters"
MAIN = "0123456789abcdef0123456789abcdef01234567"
V2 = "fedcba9876543210fedcba9876543210fedcba98"
# v2's template omits the "=" the embedded model's prompts end with: a different prompt, so a
# different answer shows which snapshot a run read.
V2_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] | trim }}{% endfor %}"
ARGS = ["generate", "abcd", "--json", "--gen-length", "40", "--block-length", "40", "--steps", "10"]


def _model_files(template: str | None = None) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in EMBEDDED.iterdir() if p.name != "training.json"}
    if template is not None:
        cfg = json.loads(files["tokenizer_config.json"]) | {"chat_template": template}
        files["tokenizer_config.json"] = json.dumps(cfg).encode()
    return files


def _blob_name(name: str, data: bytes) -> str:
    """The blob's name in the cache: its LFS sha256 for weights, its git blob sha1 otherwise."""
    if name.endswith((".safetensors", ".bin")):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_hub_cache(cache: Path, repo: str, snapshots: dict[str, dict[str, bytes]], refs: dict[str, str]) -> Path:
    """A repo in huggingface_hub's cache layout; returns its storage folder."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    for commit, files in snapshots.items():
        for name, data in files.items():
            blob = storage / "blobs" / _blob_name(name, data)
            blob.parent.mkdir(parents=True, exist_ok=True)
            if not blob.exists():
                blob.write_bytes(data)
            link = storage / "snapshots" / commit / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref, commit in refs.items():
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return storage


@pytest.fixture
def hf_home(tmp_path):
    """A private HF_HOME holding acme/letters at main and at tag v2."""
    home = tmp_path / "hf"
    write_hub_cache(home / "hub", REPO, {MAIN: _model_files(), V2: _model_files(V2_TEMPLATE)}, {"main": MAIN, "v2": V2})
    return home


def run_cli(args: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "DINFER_"))}
    full = {**base, "DINFER_BACKEND": "cpu", "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "dinfer_rt", *args], capture_output=True, text=True, timeout=120, env=full, cwd=cwd
    )


@pytest.fixture(scope="module")
def folder_texts() -> list[str]:
    """What the embedded model folder answers to ARGS (the reference every hub run must equal)."""
    return _texts(run_cli([*ARGS, "--model", str(EMBEDDED)], {}))


def _offline(home: Path) -> dict[str, str]:
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def _texts(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line)["text"] for line in proc.stdout.splitlines()]


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The command failed with exactly one ``error:`` line and no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_hub_ids_are_told_apart_from_paths():
    assert is_hub_id("acme/letters") and is_hub_id("inclusionAI/LLaDA2.0-mini") and is_hub_id("JetLM/SDAR-8B-Chat")
    for path in ("letters", "./acme/letters", "/abs/path", "a/b/c", "../x", "acme/..", "~/m", "acme/", "acme/x."):
        assert not is_hub_id(path), path


@pytest.mark.parametrize(
    "typed",
    [
        "https://huggingface.co/GSAI-ML/LLaDA-8B-Instruct",  # Path() folded it to 'https:/huggingface.co/...'
        "hf.co/GSAI-ML/LLaDA-8B-Instruct/tree/main",
        "GSAI-ML/LLaDA-8B-Instruct/",
        " GSAI-ML/LLaDA-8B-Instruct",
    ],
)
def test_a_mistyped_hub_id_is_named_with_the_id_it_looks_like(typed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        resolve_model(typed)
    assert str(e.value) == (
        f"--model {typed!r} is no folder here, and it looks like the hub id 'GSAI-ML/LLaDA-8B-Instruct': "
        "write it as ORG/NAME (no URL, spaces or trailing slash)"
    )


def test_generate_by_hub_id_equals_the_folder_run(hf_home, folder_texts):
    hub = run_cli([*ARGS, "--model", REPO], _offline(hf_home))
    assert _texts(hub) == folder_texts


def test_revision_picks_its_snapshot(hf_home, tmp_path, folder_texts):
    v2_folder = tmp_path / "v2"
    v2_folder.mkdir()
    for name, data in _model_files(V2_TEMPLATE).items():
        (v2_folder / name).write_bytes(data)
    want = _texts(run_cli([*ARGS, "--model", str(v2_folder)], {}))
    assert want != folder_texts  # the two snapshots really answer differently
    assert _texts(run_cli([*ARGS, "--model", REPO, "--revision", "v2"], _offline(hf_home))) == want


def test_resolution_returns_the_snapshot_folder(hf_home, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    storage = hf_home / "hub" / "models--acme--letters"
    assert resolve_model(REPO, download_dir=hf_home / "hub") == storage / "snapshots" / MAIN
    assert resolve_model(REPO, "v2", hf_home / "hub") == storage / "snapshots" / V2
    assert resolve_model(REPO, V2, hf_home / "hub") == storage / "snapshots" / V2  # a commit as the revision
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))  # HF_HOME's cache, as the env sets it
    assert resolve_model(REPO) == storage / "snapshots" / MAIN
    assert (storage / "snapshots" / MAIN / "model.safetensors").is_symlink()  # the layout is the real one


def test_a_local_folder_wins_over_the_hub_id(hf_home, tmp_path, monkeypatch):
    """The cache holds acme/letters too: the folder ./acme/letters is still what loads."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    assert resolve_model(REPO) == hf_home / "hub" / "models--acme--letters" / "snapshots" / MAIN
    shutil.copytree(EMBEDDED, tmp_path / "acme" / "letters")
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO) == Path(REPO)
    assert resolve_model(tmp_path / "acme" / "letters") == tmp_path / "acme" / "letters"


def test_revision_with_a_local_folder_is_refused():
    with pytest.raises(ConfigError, match="--revision 'v2' applies to hub ids"):
        resolve_model(EMBEDDED, "v2")


def _no_safetensors_repo(home: Path) -> None:
    files = {k: v for k, v in _model_files().items() if not k.endswith(".safetensors")}
    files["pytorch_model.bin"] = b"pickle"
    write_hub_cache(home / "hub", "acme/pickles", {MAIN: files}, {"main": MAIN})


@pytest.mark.parametrize(
    "model, extra, expect",
    [
        (
            "acme/nothing",
            [],
            [
                "'acme/nothing'",
                "revision 'main'",
                "is not in the Hugging Face cache",
                "nor a local folder",
                "HF_HUB_OFFLINE is set",
                "network",
            ],
        ),
        (
            REPO,
            ["--revision", "v9"],
            ["'acme/letters'", "revision 'v9'", f"cached: main -> {MAIN}, v2 -> {V2}", "HF_HUB_OFFLINE"],
        ),
        ("acme/pickles", [], ["'acme/pickles'", "revision 'main'", "no *.safetensors", "never loads .bin"]),
    ],
    ids=["repo-not-cached", "revision-not-cached", "no-safetensors"],
)
def test_offline_errors_are_one_line(hf_home, model, extra, expect, monkeypatch):
    _no_safetensors_repo(hf_home)
    if model == "acme/nothing":  # one case through the real environment variables and a fresh process
        line = _one_error_line(run_cli([*ARGS, "--model", model, *extra], _offline(hf_home)))
    else:
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
        line = _main_error_line([*ARGS, "--model", model, *extra])
    for part in expect:
        assert part in line, line


def _partial_snapshot(home: Path, link_to_missing_blob: bool) -> None:
    """acme/partial: main's snapshot has every file but the weights, or its weights link to a
    blob that is gone (an interrupted download, a pruned cache)."""
    files = _model_files()
    if not link_to_missing_blob:
        files = {k: v for k, v in files.items() if not k.endswith(".safetensors")}
    storage = write_hub_cache(home / "hub", "acme/partial", {MAIN: files}, {"main": MAIN})
    if link_to_missing_blob:
        for blob in (storage / "blobs").iterdir():
            if blob.name == _blob_name("model.safetensors", files["model.safetensors"]):
                blob.unlink()


@pytest.mark.parametrize("dangling", [False, True], ids=["weights-missing", "weights-link-dangling"])
def test_an_incomplete_cached_snapshot_is_named_with_its_folder(hf_home, dangling, monkeypatch):
    from huggingface_hub import constants

    _partial_snapshot(hf_home, dangling)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    line = _main_error_line([*ARGS, "--model", "acme/partial"])
    snapshot = str(hf_home / "hub" / "models--acme--partial" / "snapshots" / MAIN)
    assert "'acme/partial'" in line and snapshot in line, line
    if dangling:
        assert "model.safetensors links to" in line and "missing" in line, line
    else:
        assert "has no *.safetensors weights (an incomplete download" in line, line
    assert "on the Hugging Face hub" not in line, line  # the hub was never asked


def _main_error_line(argv: list[str]) -> str:
    """``dinfer-rt`` in this process (the hub is resolved before any model loads): its one error line."""
    import contextlib
    import io

    from dinfer_rt.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    proc = subprocess.CompletedProcess(argv, rc, "", err.getvalue())
    return _one_error_line(proc)


def test_download_dir_with_nothing_there_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    line = _main_error_line([*ARGS, "--model", REPO, "--download-dir", str(tmp_path / "dl")])
    assert str(tmp_path / "dl") in line and "'acme/letters'" in line


# ---------------------------------------------------------------- a hub on 127.0.0.1


class _Hub:
    """The hub's HTTP API for one repo (two commits), plus error answers for other repo names."""

    def __init__(self, files: dict[str, dict[str, bytes]], refs: dict[str, str]) -> None:
        self.files, self.refs, self.requests = files, refs, []

    def commit(self, rev: str) -> str | None:
        rev = unquote(rev)
        return self.refs.get(rev) or (rev if rev in self.files else None)


def _handler(hub: _Hub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest's output clean
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, status: int, code: str, head: bool = False):
            self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code}, head)

        def _route(self, head: bool):
            path = urlparse(self.path).path
            hub.requests.append((self.command, path))
            parts = [unquote(p) for p in path.strip("/").split("/")]
            api = parts[:2] == ["api", "models"]
            repo = "/".join(parts[2:4] if api else parts[0:2])
            if repo == "acme/gated":
                return self._error(401, "GatedRepo", head)
            if repo != REPO:
                return self._error(404, "RepoNotFound", head)
            if api and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                commit = hub.commit(parts[5])
                if commit is None:
                    return self._error(404, "RevisionNotFound", head)
                files = hub.files[commit]
                if parts[4] == "revision":
                    siblings = [{"rfilename": n} for n in files]
                    body = {"id": REPO, "sha": commit, "siblings": siblings, "private": False}
                else:
                    body = [
                        {"type": "file", "oid": _blob_name(n, d), "size": len(d), "path": n} for n, d in files.items()
                    ]
                return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
            if not api and len(parts) >= 5 and parts[2] == "resolve":
                commit = hub.commit(parts[3])
                if commit is None:
                    return self._error(404, "RevisionNotFound", head)
                name = "/".join(parts[4:])
                if name not in hub.files[commit]:
                    return self._error(404, "EntryNotFound", head)
                data = hub.files[commit][name]
                headers = {"X-Repo-Commit": commit, "ETag": f'"{_blob_name(name, data)}"'}
                return self._send(200, data, headers, head)
            return self._error(404, "RepoNotFound", head)

        def do_GET(self):
            self._route(head=False)

        def do_HEAD(self):
            self._route(head=True)

    return Handler


@pytest.fixture
def local_hub():
    files = {MAIN: _model_files(), V2: _model_files(V2_TEMPLATE)}
    for snap in files.values():  # what the loader must never fetch
        snap["pytorch_model.bin"] = b"a pickle"
        snap["modeling_letters.py"] = b"raise SystemExit('remote code ran')"
    hub = _Hub(files, {"main": MAIN, "v2": V2})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    yield hub
    server.shutdown()
    server.server_close()


def _online(home: Path, hub: _Hub) -> dict[str, str]:
    return {"HF_HOME": str(home), "HF_ENDPOINT": hub.endpoint, "HF_HUB_ETAG_TIMEOUT": "5"}


def test_download_fetches_only_safetensors_and_configs(local_hub, tmp_path, folder_texts, monkeypatch):
    dl = tmp_path / "dl"
    proc = run_cli([*ARGS, "--model", REPO, "--download-dir", str(dl)], _online(tmp_path / "hf", local_hub))
    assert _texts(proc) == folder_texts
    fetched = {p.rsplit("/", 1)[-1] for m, p in local_hub.requests if "/resolve/" in p}
    assert fetched == {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"}
    snapshot = dl / "models--acme--letters" / "snapshots" / MAIN
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(fetched)
    assert (dl / "models--acme--letters" / "refs" / "main").read_text() == MAIN
    assert not (tmp_path / "hf" / "hub").exists()  # --download-dir replaces the default cache
    # offline afterwards, the download is found in the cache without asking the server
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = len(local_hub.requests)
    assert resolve_model(REPO, download_dir=dl) == snapshot and len(local_hub.requests) == before
    # huggingface_hub 2.x keeps the repo's file listing (trees/): a file missing from the snapshot
    # is then its IncompleteSnapshotError, which said "that revision is not in the cache"
    (snapshot / "tokenizer.json").unlink()
    with pytest.raises(ConfigError) as e:
        resolve_model(REPO, download_dir=dl)
    assert f"the cached snapshot {snapshot} is incomplete (missing: tokenizer.json;" in str(e.value), e.value
    (snapshot / "model.safetensors").resolve().unlink()  # a pruned blob: named as the dangling link
    with pytest.raises(ConfigError, match="model.safetensors links to .*, which is missing"):
        resolve_model(REPO, download_dir=dl)


def test_download_of_a_revision(local_hub, tmp_path):
    env = _online(tmp_path / "hf", local_hub)
    proc = run_cli(["ir", "--model", REPO, "--revision", "v2"], env)  # resolves, reads config.json, loads no weights
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hf" / "hub" / "models--acme--letters" / "snapshots" / V2 / "config.json").is_file()
    assert "Fetching" in proc.stderr or "Download" in proc.stderr  # huggingface_hub's progress bars are shown


@pytest.mark.parametrize(
    "model, extra, expect",
    [
        ("acme/missing", [], ["'acme/missing'", "revision 'main'", "does not exist", "no local folder", "HF_TOKEN"]),
        ("acme/gated", [], ["'acme/gated'", "revision 'main'", "gated", "HF_TOKEN"]),
        (REPO, ["--revision", "nope"], ["'acme/letters'", "revision 'nope'", "check --revision"]),
    ],
    ids=["missing-repo", "gated-without-token", "missing-revision"],
)
def test_online_errors_are_one_line(local_hub, tmp_path, model, extra, expect, monkeypatch):
    if model == "acme/missing":  # one case through the real environment variables and a fresh process
        line = _one_error_line(run_cli([*ARGS, "--model", model, *extra], _online(tmp_path / "hf", local_hub)))
    else:
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "ENDPOINT", local_hub.endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        line = _main_error_line([*ARGS, "--model", model, *extra, "--download-dir", str(tmp_path / "dl")])
    for part in expect:
        assert part in line, line


def test_hub_files_never_name_pickles_or_code():
    import fnmatch

    for name in ("pytorch_model.bin", "model.pth", "modeling_llada.py", "tokenization_dream.py", "README.md"):
        assert not any(fnmatch.fnmatch(name, pat) for pat in HUB_FILES), name
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "generation_config.json"):
        assert any(fnmatch.fnmatch(name, pat) for pat in HUB_FILES), name


# ---------------------------------------------------------------- ModelScope


class _FakeModelScope:
    """modelscope's ``snapshot_download`` with the signature of modelscope 1.40.2: ``(model_id,
    revision=, cache_dir=, allow_patterns=, local_files_only=)``, answering from ModelScope's
    legacy cache layout ``<cache>/models/ORG/NAME`` (which the real package reuses) and failing like
    it does without a network (a ``NetworkError``, a ``ConnectionError``)."""

    def __init__(self, cache: Path, network: bool) -> None:
        self.cache, self.network, self.calls = cache, network, []

    def snapshot_download(self, model_id, **kwargs):
        self.calls.append((model_id, kwargs))
        folder = Path(kwargs.get("cache_dir") or self.cache) / "models" / model_id
        if kwargs.get("local_files_only") or not self.network:
            if not folder.is_dir():
                error = ConnectionError if not kwargs.get("local_files_only") else FileNotFoundError
                raise type("NetworkError" if error is ConnectionError else "CacheNotFound", (error,), {})(
                    f"[E1020] {model_id}: no connection / not cached"
                )
            return str(folder)
        if model_id != REPO:
            raise type("NotExistError", (Exception,), {})(f"The model: {model_id} not exist")
        if not folder.exists():
            shutil.copytree(EMBEDDED, folder)
        return str(folder)


def _modelscope(monkeypatch, tmp_path, network: bool = True) -> _FakeModelScope:
    import types

    fake = _FakeModelScope(tmp_path / "ms", network)
    monkeypatch.setitem(sys.modules, "modelscope", types.SimpleNamespace(snapshot_download=fake.snapshot_download))
    monkeypatch.setenv("DINFER_USE_MODELSCOPE", "true")
    return fake


def test_modelscope_switch(monkeypatch, tmp_path):
    """DINFER_USE_MODELSCOPE=true calls modelscope's snapshot_download with the same file patterns,
    the revision and the download folder. The package is an optional extra, not installed in the
    test environment, so a stand-in with its signature answers (docs/models.md says what was
    checked against the real package by hand)."""
    fake = _modelscope(monkeypatch, tmp_path)
    got = resolve_model(REPO, "v1.0", tmp_path / "dl")
    assert got == tmp_path / "dl" / "models" / "acme" / "letters"
    want = {"allow_patterns": list(HUB_FILES), "revision": "v1.0", "cache_dir": str(tmp_path / "dl")}
    assert fake.calls == [(REPO, {"local_files_only": False, **want})]


def test_modelscope_offline_and_unreachable(monkeypatch, tmp_path):
    from huggingface_hub import constants

    fake = _modelscope(monkeypatch, tmp_path, network=False)
    with pytest.raises(ConfigError, match=r"'acme/letters' \(revision 'master'\): ModelScope could not be reached"):
        resolve_model(REPO)
    assert [c[1]["local_files_only"] for c in fake.calls] == [False, True]  # the cache was tried
    shutil.copytree(EMBEDDED, tmp_path / "ms" / "models" / "acme" / "letters")
    assert resolve_model(REPO) == tmp_path / "ms" / "models" / "acme" / "letters"  # unreachable: the cache serves
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fake.calls.clear()
    assert resolve_model(REPO) == tmp_path / "ms" / "models" / "acme" / "letters"
    assert [c[1]["local_files_only"] for c in fake.calls] == [True]  # offline: never asks the network
    with pytest.raises(ConfigError, match=r"'acme/other' \(revision 'master'\) is not in the ModelScope cache"):
        resolve_model("acme/other")


def test_modelscope_errors(monkeypatch, tmp_path):
    _modelscope(monkeypatch, tmp_path)
    with pytest.raises(ConfigError, match=r"'acme/x' \(revision 'master'\) could not be fetched from ModelScope.*"):
        resolve_model("acme/x")
    with pytest.raises(ConfigError, match="check the repo id on modelscope.cn"):
        resolve_model("acme/x")
    monkeypatch.setitem(sys.modules, "modelscope", None)  # not installed
    with pytest.raises(
        ConfigError, match=r"modelscope package is not installed: pip install 'dinfer-rt\[modelscope\]'"
    ):
        resolve_model("acme/x")
    monkeypatch.setenv("DINFER_USE_MODELSCOPE", "yes please")
    with pytest.raises(ConfigError, match="DINFER_USE_MODELSCOPE='yes please': expected one of 0, 1, true, false"):
        resolve_model("acme/x")


def test_without_huggingface_hub_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ConfigError, match=r"needs huggingface_hub: pip install 'dinfer-rt\[hub\]'"):
        resolve_model("acme/never-cached")


def test_cli_resolves_once_and_keeps_the_hub_id(hf_home, monkeypatch):
    """``--model`` and ``DINFER_MODEL`` hub ids become the snapshot folder before the command
    runs (workers get a folder); the id is kept as the served model name."""
    from huggingface_hub import constants

    from dinfer_rt.cli import _resolve_model_args, build_parser

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    snapshots = hf_home / "hub" / "models--acme--letters" / "snapshots"
    a = build_parser().parse_args(["serve", "--model", REPO, "--revision", "v2"])
    _resolve_model_args(a)
    assert a.model == snapshots / V2 and a.hub_id == REPO
    monkeypatch.setenv("DINFER_MODEL", REPO)
    a = build_parser().parse_args(["eval"])
    _resolve_model_args(a)
    assert a.model == snapshots / MAIN and a.hub_id == REPO
    a = build_parser().parse_args(["ir", "--model", str(EMBEDDED)])
    _resolve_model_args(a)
    assert a.model == EMBEDDED and a.hub_id is None


def test_the_cached_list_names_whole_commits_and_marks_refs_that_cannot_load(hf_home, monkeypatch):
    """The list showed 12-character commits (which --revision does not take), a ref whose snapshot
    an interrupted update never wrote as if cached, and a hand-written ref with a newline
    (huggingface_hub reads the file verbatim) as loadable."""
    from huggingface_hub import constants

    storage = write_hub_cache(hf_home / "hub", "acme/refs", {MAIN: _model_files()}, {"main": V2})
    (storage / "refs" / "hand").write_text(MAIN + "\n")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    with pytest.raises(ConfigError) as e:
        resolve_model("acme/refs", revision="v9")
    assert (
        f"(cached: hand -> {MAIN} (refs/hand holds '{MAIN}\\n': rewrite it with the commit alone), "
        f"main -> {V2} (its snapshot is missing: an interrupted download))"
    ) in str(e.value), e.value
    assert resolve_model("acme/refs", revision=MAIN) == storage / "snapshots" / MAIN  # the commit it lists


def test_an_empty_ref_file_is_named(hf_home, monkeypatch):
    """refs/main with no commit in it (an interrupted download): huggingface_hub joins "" to the
    snapshots folder; the error names the ref file, not a missing config.json."""
    from huggingface_hub import constants

    storage = write_hub_cache(hf_home / "hub", "acme/refempty", {MAIN: _model_files()}, {"main": ""})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    line = _main_error_line([*ARGS, "--model", "acme/refempty"])
    assert f"ref file {storage / 'refs' / 'main'} names no commit" in line, line
    assert "--revision COMMIT" in line, line


def test_an_empty_revision_is_refused(hf_home, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    for revision in ("", "  "):
        line = _main_error_line([*ARGS, "--model", REPO, "--revision", revision])
        assert f"--revision {revision!r} is empty: name a branch, tag or commit" in line, line


def test_hf_hub_offline_must_be_a_boolean(hf_home):
    """huggingface_hub reads any value but 1/ON/YES/TRUE as online: a typo is named instead."""
    for value in ("maybe", " 1"):  # " 1": huggingface_hub strips nothing, so it would read online
        env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": value}
        line = _one_error_line(run_cli([*ARGS, "--model", "acme/nothing"], env))
        assert f"HF_HUB_OFFLINE={value!r} is not a boolean; use 1 (offline) or 0 (online)" in line, line
    ok = run_cli([*ARGS, "--model", REPO], {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "True"})
    assert ok.returncode == 0, ok.stderr  # a spelling huggingface_hub takes is fine


@pytest.mark.parametrize("var", ["HF_HUB_CACHE", "HF_HOME"])
def test_an_empty_hub_cache_variable_is_refused(var, tmp_path, monkeypatch):
    """huggingface_hub read ``HF_HUB_CACHE=''`` as the current folder and downloaded into it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(var, "")
    with pytest.raises(ConfigError, match=f"{var} is set but empty \\(''\\): the current folder would become"):
        resolve_model(REPO)
    assert not list(tmp_path.iterdir())


def test_an_empty_download_dir_is_refused(hf_home, monkeypatch):
    """``--download-dir ''`` made the current folder the hub cache without a word."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    line = _main_error_line([*ARGS, "--model", REPO, "--download-dir", ""])
    assert "--download-dir '' is empty; give a cache folder" in line, line
