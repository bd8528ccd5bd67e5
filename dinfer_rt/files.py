"""Writing files so that an interrupt or a crash never leaves a half-written one behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dinfer_rt.errors import DinferError


def write_text_atomic(path: str | Path, text: str, what: str = "output") -> Path:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place (atomic on
    POSIX). An unwritable destination is an error naming the path and ``what`` it was for."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise DinferError(f"cannot write {what} {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise DinferError(f"cannot write {what} {path}: {e.strerror or e}") from None
        raise
    return path


def check_writable_dir(path: str | Path, what: str) -> Path:
    """Create ``path`` if needed and prove a file can be written there, before any compute."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise DinferError(f"{what} {path} is not a writable folder: {e.strerror or e}") from None
    return path
