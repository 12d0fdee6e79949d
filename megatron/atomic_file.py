"""Files that appear under their final name only when complete, and durable once renamed."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable


def fsync_path(path: str) -> None:
    """fsync a file, or a directory (which makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)``, fsync, rename onto ``path``: ``path`` is either absent or complete.

    Host and pid go in the temporary name: several nodes may write into one shared directory.
    """
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
