"""Model names -> local folders: a folder on disk, or a hub id (``ORG/NAME``) fetched into the hub's cache.

vLLM and SGLang users type ``--model inclusionAI/LLaDA2.0-mini``; this module makes that work the
way those tools do, through the hub libraries' own download and cache code (so ``HF_HOME``,
``HF_HUB_CACHE``, ``HF_ENDPOINT``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` behave as users know them):

- A path that exists on disk always wins over a hub id of the same spelling.
- Only what dinfer-rt reads is downloaded (:data:`HUB_FILES`): configs, tokenizer files and
  ``*.safetensors`` with their index, never ``.bin`` / ``.pth`` pickles. dinfer-rt has its own model
  code, so no ``trust_remote_code`` is needed and no Python file from the repo is fetched or run.
- ``DINFER_USE_MODELSCOPE=true`` switches to ModelScope's ``snapshot_download`` and cache (the
  optional extra ``dinfer-rt[modelscope]``), as ``VLLM_USE_MODELSCOPE`` does.
- Every way a resolution can fail is one line naming the repo, the revision and what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dinfer_rt.errors import ConfigError

DINFER_USE_MODELSCOPE = "DINFER_USE_MODELSCOPE"
"""``true``/``1``: hub ids resolve through ModelScope instead of the Hugging Face hub."""

# The files dinfer-rt reads from a model repo (fnmatch patterns, as snapshot_download takes them).
HUB_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "additional_chat_templates/*.jinja",
    "*.safetensors",
    "*.safetensors.index.json",
)

# ORG/NAME as the hubs spell repo ids: letters, digits, '-', '_', '.'; no '..', no leading '.'.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_TRUE, _FALSE = ("1", "true"), ("0", "false", "")


def is_hub_id(text: str) -> bool:
    """True when ``text`` is spelled like a hub repo id (``ORG/NAME``), not like a path."""
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text and not text.endswith((".", "-"))


_HUB_URL = re.compile(r"(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co|modelscope\.cn/models)/", re.IGNORECASE)


def _near_hub_id(text: str) -> str | None:
    """The hub id a mistyped one stands for (a model page's URL, spaces around it, a trailing
    slash), or None: Path() would fold ``https://`` to ``https:/`` and name a missing folder."""
    near = _HUB_URL.sub("", text.strip(), count=1).rstrip("/")
    near = re.sub(r"/(?:tree|blob)/[^/]+(?:/.*)?$", "", near)  # a page of a branch or a file
    return near if near != text and is_hub_id(near) else None


def use_modelscope() -> bool:
    """``DINFER_USE_MODELSCOPE``: only ``0/1/true/false`` (any case); other values are refused."""
    raw = os.environ.get(DINFER_USE_MODELSCOPE, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    shown = raw if len(raw) <= 40 else raw[:40] + "..."
    raise ConfigError(f"{DINFER_USE_MODELSCOPE}={shown!r}: expected one of 0, 1, true, false")


def resolve_model(
    model: str | Path,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    *,
    what: str = "--model",
) -> Path:
    """The local folder ``model`` names: itself when it exists on disk (or is not spelled like a
    hub id, so the loader's "does not exist" error names it), else the snapshot of hub repo
    ``model`` at ``revision`` (default: ``main`` / ModelScope's default), downloaded into
    ``download_dir`` (default: the hub library's own cache) with a progress bar.
    ``what`` names where the value came from in messages (a flag or an environment variable)."""
    text = str(model)
    path = Path(text).expanduser()
    if not path.exists() and not is_hub_id(text) and (near := _near_hub_id(text)) is not None:
        raise ConfigError(
            f"{what} {text[:200]!r} is no folder here, and it looks like the hub id {near!r}: write it as "
            "ORG/NAME (no URL, spaces or trailing slash)"
        )
    if path.exists() or not is_hub_id(text):
        if revision is not None:
            raise ConfigError(
                f"--revision {revision!r} applies to hub ids (ORG/NAME), but {what} {text} is a local path: "
                "drop --revision, or check out that revision into the folder"
            )
        return path
    if download_dir is not None and not str(download_dir).strip():
        raise ConfigError(f"--download-dir {str(download_dir)!r} is empty: name a folder, or leave it out")
    if revision is not None and not revision.strip():
        raise ConfigError(f"--revision {revision!r} is empty: name a branch, tag or commit, or leave it out")
    _check_offline_env()
    if download_dir is not None:
        download_dir = Path(download_dir).expanduser()
        if download_dir.exists() and not download_dir.is_dir():
            raise ConfigError(f"--download-dir {download_dir} is not a folder")
    if download_dir is None and not use_modelscope():
        _check_cache_env()
    if use_modelscope():
        folder = _from_modelscope(text, revision, download_dir)
        check_snapshot(folder, text, revision or "master", "ModelScope")
    else:
        folder = _from_huggingface(text, revision, download_dir)
        check_snapshot(folder, text, revision, "the Hugging Face hub")
    return folder


def check_snapshot(folder: Path, repo: str, revision: str | None, source: str) -> None:
    """A downloaded snapshot must hold config.json and safetensors weights: a repo that ships only
    ``.bin`` / ``.pth`` pickles (which dinfer-rt never loads) is named as such. Offline, the hub was
    never asked: a file missing from the cached snapshot (or linking to a blob that is gone) is
    an incomplete download, named with the folder."""
    at = _at(repo, revision)
    dangling = sorted(f for f in folder.iterdir() if f.is_symlink() and not f.exists()) if folder.is_dir() else []
    if dangling:
        raise ConfigError(
            f"{at}: the cached snapshot file {dangling[0]} links to {os.readlink(dangling[0])}, which is missing "
            "(an interrupted download or a pruned cache): delete that snapshot folder and download again"
        )
    incomplete = (
        f"{at}: the cached snapshot {folder} has no {{}} (an incomplete download; offline, the hub was not asked): "
        "download it again online, or point --model at a complete folder"
    )
    if not (folder / "config.json").is_file():
        if _env_offline():
            raise ConfigError(incomplete.format("config.json"))
        raise ConfigError(f"{at} on {source} has no config.json: it is not a model repo dinfer-rt can load")
    if not any(folder.glob("*.safetensors")):
        pickles = any(folder.glob("*.bin")) or any(folder.glob("*.pth"))
        if _env_offline() and not pickles:
            raise ConfigError(incomplete.format("*.safetensors weights"))
        raise ConfigError(
            f"{at} on {source} has no *.safetensors weights (dinfer-rt never loads .bin/.pth pickles): "
            "convert the checkpoint to safetensors, or pick a revision or repo that ships them"
        )


def _at(repo: str, revision: str | None, default: str = "main") -> str:
    return f"model {repo!r} (revision {revision or default!r})"


# ---------------------------------------------------------------- Hugging Face


def _from_huggingface(repo: str, revision: str | None, download_dir: Path | None) -> Path:
    """``huggingface_hub.snapshot_download`` limited to :data:`HUB_FILES`, its errors made one line."""
    try:
        import huggingface_hub
        from huggingface_hub import utils as hf_errors  # the error classes, exported there since 0.14
    except ImportError:
        raise ConfigError(
            f"{_at(repo, revision)} is a hub id, and loading from the hub needs huggingface_hub: "
            "pip install 'dinfer-rt[hub]' (or pass a local folder)"
        ) from None
    from huggingface_hub import constants

    cache = Path(download_dir) if download_dir is not None else Path(constants.HF_HUB_CACHE)
    at = _at(repo, revision)
    try:
        folder = huggingface_hub.snapshot_download(
            repo, revision=revision, cache_dir=str(cache), allow_patterns=list(HUB_FILES)
        )
    except hf_errors.GatedRepoError:
        raise ConfigError(
            f"{at} is gated on the Hugging Face hub: accept its terms on the model page, then set HF_TOKEN "
            "(or run `hf auth login`) with a token of that account"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        token = " (HF_TOKEN is set: check it can read this repo)" if _hf_token_set() else ""
        raise ConfigError(
            f"{at} does not exist on the Hugging Face hub ({constants.ENDPOINT}), or is private{token}, and "
            "there is no local folder of that name: check the spelling, or set HF_TOKEN for a private repo"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise ConfigError(
            f"{at}: the repo exists but has no revision {revision or 'main'!r} (a branch, tag or commit): "
            "check --revision"
        ) from None
    except _incomplete_snapshot_error() as e:  # the cache's file listing says files are missing
        raise ConfigError(_incomplete(repo, revision, e)) from None
    except hf_errors.LocalEntryNotFoundError as e:
        raise ConfigError(_not_cached(repo, revision, cache, e)) from None
    except hf_errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise ConfigError(f"{at}: the Hugging Face hub answered HTTP {status}: {_first_line(e)}") from None
    except OSError as e:  # disk full, unwritable cache, a connection dropped mid-file
        raise ConfigError(f"{at}: download into {cache} failed: {_first_line(e)}") from None
    except ValueError as e:  # an id the library refuses (HFValidationError)
        raise ConfigError(f"{at}: not a valid Hugging Face repo id: {_first_line(e)}") from None
    except Exception as e:  # a proxy or protocol error of the HTTP client: still one line
        raise ConfigError(
            f"{at}: download from {constants.ENDPOINT} failed ({type(e).__name__}: {_first_line(e)}): "
            "check the network, a proxy or HF_ENDPOINT, or pass a local folder"
        ) from None
    if Path(folder).name == "snapshots":  # the cache's ref file named no commit: huggingface_hub joins ""
        ref = cache / ("models--" + repo.replace("/", "--")) / "refs" / (revision or "main")
        raise ConfigError(
            f"{at}: the Hugging Face cache's ref file {ref} names no commit (it is empty: an interrupted "
            "download): delete it and download again online, or pass --revision COMMIT"
        )
    return Path(folder)


def _incomplete_snapshot_error() -> tuple[type[Exception], ...]:
    """huggingface_hub's IncompleteSnapshotError (2.x: a cached snapshot its own tree listing
    shows to miss files, raised offline); older versions lack it and return the folder as is."""
    try:
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:
        return ()
    return (IncompleteSnapshotError,)


def _incomplete(repo: str, revision: str | None, error: Exception) -> str:
    """The line for a cached snapshot known to miss files: a dangling link or missing weights as
    :func:`check_snapshot` names them, else the missing files the library listed."""
    folder = Path(getattr(error, "snapshot_path", "") or ".")
    if folder.is_dir():
        check_snapshot(folder, repo, revision, "the Hugging Face hub")  # raises naming the file, when it can
    missing = re.search(r"are missing \((.*?)\)\.", str(error))
    why = "HF_HUB_OFFLINE is set" if _hf_offline() else f"the hub could not be reached ({_cause(error)})"
    return (
        f"{_at(repo, revision)}: the cached snapshot {folder} is incomplete (missing: "
        f"{missing.group(1) if missing else _first_line(error)}; an interrupted download or a pruned cache) and "
        f"{why}: download it again with network access, or point --model at a complete folder"
    )


def _hf_token_set() -> bool:
    return bool(os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"))


def _not_cached(repo: str, revision: str | None, cache: Path, error: Exception) -> str:
    """The one line for "not downloaded and the hub cannot be asked": which part is missing (the
    repo or this revision), which revisions the cache does hold, and how to get the files."""
    at = _at(repo, revision)
    offline = _hf_offline()
    why = "HF_HUB_OFFLINE is set" if offline else f"the hub could not be reached ({_cause(error)})"
    todo = (
        "run once with network access (unset HF_HUB_OFFLINE) or copy the model folder and pass its path"
        if offline
        else "check the network / HF_ENDPOINT, or pass a local folder"
    )
    storage = cache / ("models--" + repo.replace("/", "--"))
    if not storage.is_dir():
        return f"{at} is not in the Hugging Face cache {cache} (nor a local folder) and {why}: {todo}"
    held = _cached_revisions(storage)
    listed = ", ".join(held) if held else "none complete"
    return f"{at}: that revision is not in the Hugging Face cache {cache} (cached: {listed}) and {why}: {todo}"


def _hf_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cause(error: Exception) -> str:
    inner = error.__cause__ or error
    return f"{type(inner).__name__}: {_first_line(inner)}"


def _cached_revisions(storage: Path) -> list[str]:
    """``ref -> commit`` for every ref in the cache, then commits no ref names: whole commits, as
    ``--revision`` takes them; a ref whose snapshot is missing (an interrupted update) or whose
    file holds more than the commit (huggingface_hub reads it verbatim) is marked."""
    refs = storage / "refs"
    named: dict[str, tuple[str, str]] = {}
    if refs.is_dir():
        for ref in sorted(p for p in refs.rglob("*") if p.is_file()):
            try:
                raw = ref.read_text()
            except OSError:
                continue
            named[ref.relative_to(refs).as_posix()] = (raw.strip(), raw)
    snaps = storage / "snapshots"
    commits = sorted(p.name for p in snaps.iterdir()) if snaps.is_dir() else []
    rows = []
    for ref, (commit, raw) in named.items():
        note = ""
        if raw != commit:
            note = f" (refs/{ref} holds {raw!r:.60}: rewrite it with the commit alone)"
        elif commit not in commits:
            note = " (its snapshot is missing: an interrupted download)"
        rows.append(f"{ref} -> {commit}{note}")
    rows += [c for c in commits if c not in {commit for commit, _ in named.values()}]
    return rows


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:300] + "..."


# ---------------------------------------------------------------- ModelScope


def _from_modelscope(repo: str, revision: str | None, download_dir: Path | None) -> Path:
    """``modelscope.snapshot_download`` with the same file patterns, into ModelScope's cache
    (``MODELSCOPE_CACHE``, default ``~/.cache/modelscope/hub``) or ``download_dir``. ModelScope has
    no offline switch of its own: ``HF_HUB_OFFLINE=1`` reads its cache only (as vLLM does), and
    when modelscope.cn cannot be reached the cache is tried before giving up, like
    huggingface_hub does."""
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise ConfigError(
            f"{DINFER_USE_MODELSCOPE} is set and {_at(repo, revision, 'master')} is a hub id, but the modelscope "
            "package is not installed: pip install 'dinfer-rt[modelscope]' (or unset the variable)"
        ) from None
    at = _at(repo, revision, "master")
    kwargs: dict = {"allow_patterns": list(HUB_FILES)}
    if revision is not None:
        kwargs["revision"] = revision
    if download_dir is not None:
        kwargs["cache_dir"] = str(download_dir)
    offline = _env_offline()
    try:
        folder = snapshot_download(repo, local_files_only=offline, **kwargs)
    except Exception as e:  # modelscope raises its own classes (and requests' HTTPError around them)
        kinds = _exception_kinds(e)
        if offline:
            raise ConfigError(
                f"{at} is not in the ModelScope cache and HF_HUB_OFFLINE is set: run once with network access "
                f"(unset HF_HUB_OFFLINE) or pass a local folder ({type(e).__name__}: {_first_line(e)})"
            ) from None
        if kinds & {"NetworkError", "ConnectionError", "Timeout", "TimeoutError"}:
            try:  # unreachable: a cached snapshot still serves, as with huggingface_hub
                folder = snapshot_download(repo, local_files_only=True, **kwargs)
            except Exception:
                raise ConfigError(
                    f"{at}: ModelScope could not be reached and the model is not in its cache: check the network, "
                    "or unset DINFER_USE_MODELSCOPE to use the Hugging Face hub, or pass a local folder"
                ) from None
        else:
            raise ConfigError(f"{at} could not be fetched from ModelScope: {_modelscope_hint(e, kinds)}") from None
    if folder is None or not Path(folder).is_dir():
        raise ConfigError(f"{at}: ModelScope returned no folder ({folder!r})")
    return Path(folder)


_BOOLEAN_WORDS = {"", "1", "0", "true", "false", "yes", "no", "on", "off"}


def _check_offline_env() -> None:
    """``HF_HUB_OFFLINE`` must read as a boolean: huggingface_hub takes anything but 1 / ON / YES /
    TRUE as "online", so a typo would silently reach for the network."""
    raw = os.environ.get("HF_HUB_OFFLINE")
    if raw is not None and raw.lower() not in _BOOLEAN_WORDS:  # " 1" too: huggingface_hub strips nothing
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise ConfigError(f"HF_HUB_OFFLINE={shown!r} is not a boolean; use 1 (offline) or 0 (online)")


def _check_cache_env() -> None:
    """``HF_HUB_CACHE`` / ``HF_HOME`` set but blank: huggingface_hub reads ``Path("")``, the
    current folder, as the cache, and would fill it (as ``--download-dir ''`` would)."""
    for var in ("HF_HUB_CACHE", "HF_HOME"):
        raw = os.environ.get(var)
        if raw is not None and not raw.strip():
            raise ConfigError(
                f"{var} is set but empty ({raw!r}): the current folder would become the Hugging Face cache; "
                "unset it or name a folder"
            )


def _env_offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _exception_kinds(e: BaseException) -> set[str]:
    """Class names along ``e``'s cause chain (modelscope wraps its errors in requests' HTTPError)."""
    kinds: set[str] = set()
    seen = 0
    while e is not None and seen < 8:
        kinds.update(c.__name__ for c in type(e).__mro__)
        e, seen = e.__cause__ or e.__context__, seen + 1
    return kinds


def _modelscope_hint(e: BaseException, kinds: set[str]) -> str:
    text = f"{type(e).__name__}: {_first_line(e)}"
    if kinds & {"AuthenticationError", "PermissionDeniedError"}:
        return f"{text}: log in (`modelscope login`) with an account that can read the repo"
    if "NotExistError" in kinds:
        return f"{text}: check the repo id on modelscope.cn and --revision"
    return f"{text}: check the network, or unset DINFER_USE_MODELSCOPE to use the Hugging Face hub"
