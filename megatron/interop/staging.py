"""Output directories that appear under their final name only when complete.

Export and import write everything into a hidden sibling (``.NAME.tmp-<hex>``) and rename it
onto the final name last; a failure or a kill leaves the final name untouched. An existing,
non-empty output is refused rather than overwritten: it may hold the user's files.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator

from megatron.atomic_file import fsync_path
from megatron.errors import ConfigError


def check_output(path: str, flag: str = "--output") -> None:
    """ConfigError unless ``path`` is absent or an empty directory."""
    if os.path.isdir(path) and not os.listdir(path):
        return
    if os.path.exists(path):
        raise ConfigError(f"{flag} {path} already exists and is not empty; choose a new directory")


@contextlib.contextmanager
def staged(path: str, flag: str = "--output") -> Iterator[str]:
    """Yield a fresh directory beside ``path``; on success it is renamed onto ``path``."""
    check_output(path, flag)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(
        parent, f".{os.path.basename(os.path.abspath(path))}.tmp-{secrets.token_hex(6)}"
    )
    os.makedirs(tmp)
    try:
        yield tmp
        fsync_path(tmp)
        # An empty directory at ``path`` is replaced by the rename; anything else was refused.
        os.replace(tmp, path)
        fsync_path(parent)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
