"""One run per checkpoint directory: rank 0 holds ``<checkpoint.save>/run.lock`` while it lives.

Two runs saving into one directory would interleave their iterations and move ``latest`` under
each other. The lock file is created exclusively (``O_EXCL``) and names its holder: the job
(``SLURM_JOB_ID``), the host and the pid. A thread refreshes its mtime every ``refresh_s`` so
that a run on any host can tell a live holder from a gone one. The holder is stale when the file
has not been refreshed for ``stale_after_s`` (``parallel.heartbeat_grace_s``: a run that silent
is as lost as a silent peer), when it is an earlier attempt of this same job (requeued), or, on
the holder's own host, when its pid is gone. A stale lock is taken over with a warning; a live
one refuses the run with one line naming it. The name matches neither ``iter_*`` nor
``latest``, so checkpoint listing never sees it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatron.errors import ConfigError
from megatron.logging import log
from megatron.parallel.state import ParallelState

LOCK_NAME = "run.lock"


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: enough for a person (and another host) to find the run."""

    job: str | None
    host: str
    pid: int

    @classmethod
    def this_process(cls) -> Holder:
        return cls(os.environ.get("SLURM_JOB_ID"), socket.gethostname(), os.getpid())

    def __str__(self) -> str:
        job = f"job {self.job}, " if self.job else ""
        return f"{job}host {self.host}, pid {self.pid}"

    def is_gone(self) -> bool:
        """Known to be gone: same host and no such pid, or an earlier attempt of this SLURM job
        (requeued: a job id is never reused for another job)."""
        me = Holder.this_process()
        if self.job is not None and self.job == me.job:
            return True
        if self.host != me.host:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # it exists, as another user
        return False


class RunLock:
    """The lock file of one save directory, held by this process until ``release()``."""

    def __init__(self, path: str, stale_after_s: float):
        self.path = path
        self.refresh_s = min(10.0, stale_after_s / 4)  # four refreshes per stale period
        self.holder = Holder.this_process()
        self._inode = self._take(stale_after_s)
        self._released = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="run-lock", daemon=True)
        self._thread.start()

    def _take(self, stale_after_s: float) -> int:
        """Create the lock (O_EXCL: atomic on local and network file systems), or take over a
        stale one; returns the inode now at ``path``, ours."""
        for _ in range(3):  # a lock released or taken over meanwhile: look again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(asdict(self.holder), f)
                    return os.fstat(f.fileno()).st_ino
            try:
                found, age, inode = self._read()
            except FileNotFoundError:
                continue
            if age <= stale_after_s and not found.is_gone():
                raise ConfigError(
                    f"checkpoint.save={os.path.dirname(self.path)} is in use by another run "
                    f"({found}; {LOCK_NAME} refreshed {age:.0f} s ago): stop that run, or give "
                    "this one another checkpoint.save"
                )
            if self._remove_stale(inode):
                log.warning(
                    "checkpoint.save=%s: taking over the lock of a run that is gone (%s; last "
                    "refreshed %.0f s ago)",
                    os.path.dirname(self.path),
                    found,
                    age,
                )
        raise ConfigError(
            f"checkpoint.save={os.path.dirname(self.path)}: {LOCK_NAME} keeps changing hands, so "
            "another run is starting there: stop it, or give this one another checkpoint.save"
        )

    def _read(self) -> tuple[Holder, float, int]:
        """(holder, seconds since its last refresh, inode) of the lock now at ``path``."""
        with open(self.path, encoding="utf-8") as f:
            stat = os.fstat(f.fileno())
            try:
                found = Holder(**json.load(f))
            except (ValueError, TypeError):  # being written by a starting run, or foreign
                found = Holder(None, "unknown", -1)
        return found, time.time() - stat.st_mtime, stat.st_ino

    def _remove_stale(self, inode: int) -> bool:
        """Remove the stale lock, and only it: it is moved aside first, so that a lock another
        starting run put in its place meanwhile is put back, not deleted. True if removed."""
        aside = f"{self.path}.stale-{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False  # another starting run removed it
        ours = os.stat(aside).st_ino == inode
        if not ours:
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        os.remove(aside)
        return ours

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                os.utime(self.path)
            except OSError as err:
                log.warning("checkpoint lock %s could not be refreshed: %s", self.path, err)

    def release(self) -> None:
        """Stop refreshing and remove the lock if it is still ours; safe to call twice and
        from any thread."""
        if not self._released.acquire(blocking=False):
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.remove(self.path)
        except FileNotFoundError:
            pass
        except OSError:  # the disk turned read-only: the lock stays, and its pid is gone next run
            pass


class NoLock:
    """What ranks other than 0, and runs with no checkpoint.save, hold: nothing to release."""

    def release(self) -> None:
        pass


NO_LOCK = NoLock()


def hold_save_dir(
    save_dir: str | None, stale_after_s: float, state: ParallelState
) -> RunLock | NoLock:
    """Take ``save_dir``'s lock on rank 0; every rank raises the same refusal if it is held."""
    lock: RunLock | NoLock = NO_LOCK
    refusal = None
    if save_dir and state.is_first:
        try:
            os.makedirs(save_dir, exist_ok=True)
            lock = RunLock(os.path.join(save_dir, LOCK_NAME), stale_after_s)
        except ConfigError as err:
            refusal = err
        except OSError as err:
            refusal = ConfigError(
                f"checkpoint.save={save_dir}: cannot create {LOCK_NAME} there ({err.strerror}); "
                "give a writable directory"
            )
    if save_dir and state.world_size > 1:
        # Every rank must learn rank 0's answer, or the others would go on alone.
        refused = torch.tensor([float(refusal is not None)], device=state.device)
        dist.all_reduce(refused)
        if refused.item() and refusal is None:
            refusal = ConfigError(f"checkpoint.save={save_dir} is refused (see rank 0's message)")
    if refusal is not None:
        raise refusal
    return lock
