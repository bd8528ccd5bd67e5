"""Writing files where the user points, so that an interrupt or a crash never leaves a half-written
one behind.

A regular file (or a path that does not exist yet) is written to a temporary file beside it and
renamed into place (atomic on POSIX), keeping an existing file's permission bits. A symlink is
written through to its target (the link stays a link). Anything else that exists (a FIFO, a
character device such as ``/dev/null``, ``/dev/stdout`` or another alias of an open descriptor)
is written directly, as a shell redirection would; ``-`` is standard output. A folder is refused
(:func:`check_output_file` says so before any computation).
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

from dinfer_rt.errors import DinferError

STDOUT = "-"
# Paths that are (or lead through) aliases of this process's open descriptors: /dev/stdout ->
# /proc/self/fd/1. Renaming over them would replace the alias, or the file the shell opened.
_DESCRIPTOR_ALIASES = ("/proc/", "/dev/fd/", "/dev/stdin", "/dev/stdout", "/dev/stderr")


def _link_chain(path: Path) -> list[str]:
    """``path`` and every link on the way to its target, as absolute paths."""
    chain = [os.path.abspath(path)]
    for _ in range(40):  # the kernel's own bound on nested links
        if not os.path.islink(chain[-1]):
            break
        chain.append(os.path.abspath(os.path.join(os.path.dirname(chain[-1]), os.readlink(chain[-1]))))
    return chain


def _is_descriptor_alias(path: Path) -> bool:
    """Whether ``path`` or any link on the way to its target is a ``/proc`` or ``/dev/fd`` alias."""
    return any(p.startswith(_DESCRIPTOR_ALIASES) for p in _link_chain(path))


def _own_descriptor(path: Path) -> int | None:
    """The descriptor of this process that ``path`` names (``/dev/stdout`` -> 1, ``/dev/fd/N``,
    ``/proc/self/fd/N``), or None. Written through that descriptor, the output continues at its
    offset instead of a second one that would overwrite what the process writes there next."""
    named = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
    for p in _link_chain(path):
        if p in named:
            return named[p]
        for prefix in ("/dev/fd/", "/proc/self/fd/", f"/proc/{os.getpid()}/fd/"):
            if p.startswith(prefix) and p[len(prefix) :].isdigit():
                return int(p[len(prefix) :])
    return None


def _mode_for_new_file() -> int:
    """What ``open(path, "w")`` would give a new file: 0o666 less the umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _fail(what: str, path: Path, e: OSError) -> DinferError:
    return DinferError(f"cannot write {what} {path}: {e.strerror or e}")


def check_output_file(path: str | Path, what: str) -> Path | str:
    """Refuse, before any computation, a destination that cannot be written: a folder, a
    missing or unwritable parent folder, or an existing non-regular file not open for writing.
    ``-`` (standard output) is always fine. Returns the path (``-`` as the string)."""
    if str(path) == STDOUT:
        return STDOUT
    path = Path(path)
    if path.is_dir():
        raise DinferError(f"{what} {path} is a folder; give a file path (or - for standard output)")
    if path.exists() and (not path.is_file() or _is_descriptor_alias(path)):
        if not os.access(path, os.W_OK):
            raise DinferError(f"{what} {path} is not writable")
        return path
    target = Path(os.path.realpath(path))  # a symlink (even a dangling one) is written at its target
    check_writable_dir(target.parent, f"{what} folder")
    return path


def write_text_atomic(path: str | Path, text: str, what: str = "output") -> Path | str:
    """Write ``text`` where ``path`` points (see the module docstring); an unwritable destination
    or a folder is an error naming the path and ``what`` it was for. Returns the path written."""
    if str(path) == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
        return STDOUT
    path = Path(path)
    try:
        st = os.stat(path)  # follows links: what the user's path points at
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise _fail(what, path, e) from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise DinferError(f"cannot write {what} {path}: it is a folder; give a file path (or - for standard output)")
    if st is not None and (not stat.S_ISREG(st.st_mode) or _is_descriptor_alias(path)):
        return _write_directly(path, text, what)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    return _write_replacing(path, target, text, what, st)


def _write_directly(path: Path, text: str, what: str) -> Path:
    """A FIFO, a device or a descriptor alias: written as it is, through this process's own
    descriptor where the path names one (``/dev/stdout``), else opened for appending."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        fd = _own_descriptor(path)
        if fd is not None:
            data = text.encode()
            while data:
                data = data[os.write(fd, data) :]
            return path
        with open(path, "a") as fh:
            fh.write(text)
    except OSError as e:
        raise _fail(what, path, e) from None
    return path


def _write_replacing(path: Path, target: Path, text: str, what: str, st: os.stat_result | None) -> Path:
    """Temporary file beside ``target``, the existing file's mode (owner too, where allowed), rename."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:
        raise _fail(what, path, e) from None
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            os.fchmod(fh.fileno(), stat.S_IMODE(st.st_mode) if st is not None else _mode_for_new_file())
            if st is not None and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                try:
                    os.fchown(fh.fileno(), st.st_uid, st.st_gid)
                except OSError:  # not permitted: the replacement belongs to whoever wrote it
                    pass
        os.replace(tmp, target)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _fail(what, path, e) from None
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
