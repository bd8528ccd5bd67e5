"""Optional autotuning (``DINFER_AUTOTUNE=1``): a kernel's candidate launch configurations are
timed once per (kernel, shape bucket, arch, versions) and the winner is remembered on disk, so a
later process starts tuned. Without the flag, or for a key already measured, nothing is timed.

The cache is one JSON file per (arch, versions) under ``DINFER_TUNING_CACHE`` (default
``~/.cache/dinfer_rt/tuning``); a Triton, torch or dinfer-rt upgrade starts a fresh file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from dinfer_rt import envs
from dinfer_rt.errors import ConfigError


def default_cache_dir() -> Path:
    """``DINFER_TUNING_CACHE``, else ``~/.cache/dinfer_rt/tuning``; a value that is not a folder is
    refused by name (the cache files go inside it)."""
    value = envs.get(envs.DINFER_TUNING_CACHE)
    if not value:
        return Path.home() / ".cache" / "dinfer_rt" / "tuning"
    folder = Path(value).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"{envs.DINFER_TUNING_CACHE}={value!r} is not a folder: it names the folder the cache files go in"
        )
    return folder


class Autotuner:
    """Pick and remember the fastest launch configuration per shape bucket.

    ``sync`` waits for the device (``torch.cuda.synchronize`` on a GPU); ``clock`` is the timer
    (tests inject a fake one)."""

    def __init__(
        self,
        arch: str,
        versions: dict[str, str],
        cache_dir: Path | None = None,
        sync: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.perf_counter,
        iters: int = 5,
    ) -> None:
        tag = hashlib.sha1(json.dumps(sorted(versions.items())).encode()).hexdigest()[:12]
        self.path = (cache_dir or default_cache_dir()) / f"{arch}-{tag}.json"
        self.arch, self.versions, self.sync, self.clock, self.iters = arch, dict(versions), sync, clock, iters
        self.entries: dict[str, dict] = self._load()
        self.measured = 0  # configurations timed by this tuner (0 when every key was cached)
        self._unsaved = False  # a write failed (warned once)

    def _load(self) -> dict[str, dict]:
        """The cached winners; a cache file that cannot be read or is not this module's layout is
        re-tuned (and overwritten) with a warning naming it: a cache never stops a run."""
        try:
            data = json.loads(self.path.read_text())
        except (FileNotFoundError, NotADirectoryError):  # nothing tuned yet (a folder not made is _save's to name)
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            return self._discard(f"is unreadable ({type(e).__name__}: {e})")
        entries = data.get("entries") if isinstance(data, dict) else None
        if not isinstance(entries, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("config"), dict) for v in entries.values()
        ):
            return self._discard("is not an autotuning cache (no 'entries' of {'config': {...}})")
        return entries if data.get("versions") == self.versions else {}

    def _discard(self, why: str) -> dict:
        warnings.warn(f"autotuning cache {self.path} {why}: re-tuning, and it will be overwritten", stacklevel=3)
        return {}

    @staticmethod
    def key(kernel: str, bucket: Sequence) -> str:
        return f"{kernel}|{'x'.join(str(b) for b in bucket)}"

    def best(self, kernel: str, bucket: Sequence, candidates: Sequence[dict], run: Callable[[dict], object]) -> dict:
        """The cached winner for (kernel, bucket), else time every candidate (median of
        ``iters`` after a warm-up), store the fastest and return it."""
        key = self.key(kernel, bucket)
        if key in self.entries:
            return dict(self.entries[key]["config"])
        timings = []
        for cfg in candidates:
            run(cfg)
            self.sync()
            samples = []
            for _ in range(self.iters):
                start = self.clock()
                run(cfg)
                self.sync()
                samples.append(self.clock() - start)
            timings.append(sorted(samples)[len(samples) // 2])
            self.measured += 1
        i = min(range(len(candidates)), key=timings.__getitem__)
        self.entries[key] = {"config": dict(candidates[i]), "ms": timings[i] * 1e3, "candidates": len(candidates)}
        self._save()
        return dict(candidates[i])

    def _save(self) -> None:
        body = json.dumps({"arch": self.arch, "versions": self.versions, "entries": self.entries}, indent=1)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")  # atomic: concurrent workers
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only or full disk: the winner still serves this process
            if not self._unsaved:
                warnings.warn(
                    f"autotuning cache {self.path} cannot be written ({type(e).__name__}: {e}); tuned launch "
                    f"configurations are not remembered (set {envs.DINFER_TUNING_CACHE} to a writable folder)",
                    stacklevel=3,
                )
            self._unsaved = True
