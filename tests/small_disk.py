"""A real small or read-only disk for tests: a tmpfs mounted in a private mount namespace.

``run_on_small_disk(argv, mount, size)`` runs ``argv`` with a fresh tmpfs of ``size`` bytes at
``mount`` (read-only with ``read_only=True``), seen only by that command and its children. It
needs user namespaces (``unshare --user --map-root-user --mount``); where the machine forbids
them, ``SKIP_REASON`` says why and the tests that need one skip.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence


def _probe() -> str | None:
    """None when a tmpfs can be mounted here, else the reason it cannot."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    with tempfile.TemporaryDirectory() as mount:
        probe = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]
        probe.append(f"mount -t tmpfs -o size=64k tmpfs {shlex.quote(mount)}")
        done = subprocess.run(probe, capture_output=True, text=True)
    if done.returncode:
        return f"cannot mount a tmpfs in a user namespace: {done.stderr.strip()}"
    return None


SKIP_REASON = _probe()


def run_on_small_disk(
    argv: Sequence[str],
    mount: str,
    size: int,
    read_only: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: str | None = None,
) -> subprocess.CompletedProcess:
    """``argv`` with a ``size``-byte tmpfs at ``mount`` (created if missing), stdout and stderr
    captured as text. ``read_only`` mounts it read-only."""
    os.makedirs(mount, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    script = f'mount -t tmpfs -o {options} tmpfs {shlex.quote(mount)} && exec "$@"'
    command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"]
    return subprocess.run(
        command + list(argv),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=cwd,
    )
