"""Files that appear under their final name only when complete, and durable once renamed; and
what to tell the user when storage refuses a write."""

from __future__ import annotations

import errno
import os
import shutil
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

# Errors by which storage refuses a write, whatever the data: the user's fix for each.
_REFUSALS = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space",
    errno.EROFS: "make it writable",
    errno.EACCES: "make it writable",
}


def refusal(err: BaseException) -> tuple[str, str] | None:
    """(storage's reason, e.g. "no space left on device"; the user's fix) when ``err`` is storage
    refusing a write (full, over quota, read-only, not permitted); None for any other error."""
    if isinstance(err, OSError) and err.errno in _REFUSALS:
        return os.strerror(err.errno).lower(), _REFUSALS[err.errno]
    return None


def free_bytes(path: str) -> int:
    """Bytes free to this user on the file system of ``path``, or of its nearest existing parent
    (a directory that could not be created)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def mib(n: int) -> str:
    """``n`` bytes as MiB for a message: ``2.1 MiB``."""
    return f"{n / 2**20:.1f} MiB"


def fsync_path(path: str) -> None:
    """fsync a file, or a directory (which makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)``, fsync, rename onto ``path``, fsync its directory: ``path`` is either
    absent or complete, and stays so through a power loss.

    Host and pid go in the temporary name: several nodes may write into one shared directory.
    """
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(os.path.dirname(path) or ".")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_contents(path: str, contents: str | bytes) -> None:
    """``contents`` (text as UTF-8) as the whole file ``path``, through ``write_atomic``."""
    data = contents.encode("utf-8") if isinstance(contents, str) else contents
    write_atomic(path, lambda tmp: Path(tmp).write_bytes(data))


def write_durable(path: str, data: bytes | Iterable[bytes | memoryview]) -> None:
    """Write ``data`` (the bytes, or the file's pieces in order) to a new file at ``path`` and
    fsync it before returning."""
    with open(path, "wb") as f:
        for piece in [data] if isinstance(data, bytes) else data:
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
