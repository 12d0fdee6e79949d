"""Files that appear under their final name only when complete, and durable once renamed."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path


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


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
