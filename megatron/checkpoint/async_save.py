"""The training loop's saves: written inline, or copied to host memory and written in a thread.

With ``checkpoint.async_save``, ``Checkpointer.save`` waits for the previous save, copies this
rank's share of the state into host buffers, and returns to training; a thread then writes,
fsyncs, renames and moves ``latest`` (``save.write_and_publish``). The copies are what
keep the checkpoint exact while training goes on mutating the live tensors. On CUDA the buffers
are pinned and the copies queued on the current stream: the thread waits on an event, so the loop
does not wait for the device. The thread's only collectives run on the gloo group kept for
checkpoints (``save.coordination_group``), which the loop never uses, and the next
save waits for it first, so two saves never interleave their collectives.

An error in the background is raised by the next ``save`` or by ``wait`` (the loop calls it on
every exit), on every rank: ``write_and_publish`` fails on all ranks alike (a full or read-only
disk as the same one-line StorageError, its temporary directory removed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megatron.checkpoint.save import (
    SaveJob,
    capture,
    coordination_group,
    save_checkpoint,
    write_and_publish,
)
from megatron.checkpoint.train_state import TrainState
from megatron.config.schema import Config
from megatron.parallel.state import ParallelState


class HostBuffers:
    """Host copies of the tensors a save writes, reused from one save to the next.

    The files are written straight from them (``streamed_file.write_tensors``): the state is
    copied once, so a background save holds about one state's worth of host memory, pinned only
    for CUDA tensors. Reuse is safe because a save starts only after the previous one has finished.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}
        self._cuda = False

    def take(self, key: str, tensor: Tensor) -> Tensor:
        """A host copy of ``tensor`` in the buffer kept for ``key`` (queued, for CUDA tensors)."""
        tensor = tensor.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[key] = buf
        buf.copy_(tensor, non_blocking=tensor.is_cuda)
        self._cuda |= tensor.is_cuda
        return buf

    def ready(self) -> Callable[[], None] | None:
        """Waits until the copies queued so far have landed (None: they already have)."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event.synchronize


class Checkpointer:
    """Saves of one run; ``record`` receives each save's timings (a metrics line).

    ``save_blocking_ms`` is the time ``save`` kept the loop from training (waiting for the
    previous save included); ``save_total_ms`` runs until the checkpoint was published. A
    background save's line is recorded when it is waited for: at the next save or at exit.
    """

    def __init__(self, async_save: bool, record: Callable[[dict[str, Any]], None]):
        self.async_save = async_save
        self.record = record
        self._buffers = HostBuffers()
        self._thread: threading.Thread | None = None
        self._outcome: dict[str, Any] = {}  # the pending save's iteration, timings or error

    def save(
        self, save_dir: str, train: TrainState, cfg: Config, state: ParallelState, vocab_size: int
    ) -> None:
        """Checkpoint ``train`` at its iteration (collective; the arguments of
        ``save_checkpoint``)."""
        start = time.perf_counter()
        self.wait()
        iteration = train.progress.iteration
        if not self.async_save:
            save_checkpoint(save_dir, train, cfg, state, vocab_size)
            ms = 1000 * (time.perf_counter() - start)
            self.record({"iteration": iteration, "save_blocking_ms": ms, "save_total_ms": ms})
            return
        group = coordination_group(state)
        job = capture(save_dir, train, cfg, state, vocab_size, take=self._buffers.take)
        job.ready = self._buffers.ready()
        outcome: dict[str, Any] = {"iteration": iteration}
        self._thread = threading.Thread(
            target=_write, args=(job, group, start, outcome), name="checkpoint-writer", daemon=True
        )
        self._thread.start()
        self._outcome = outcome
        outcome["save_blocking_ms"] = 1000 * (time.perf_counter() - start)

    def wait(self) -> None:
        """Block until the background save (if any) has finished; record its timings, or raise
        its error."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread, outcome = None, self._outcome
        if "error" in outcome:
            raise outcome["error"]
        keys = ("iteration", "save_blocking_ms", "save_total_ms")
        self.record({k: outcome[k] for k in keys})


def _write(job: SaveJob, group: Any, start: float, outcome: dict[str, Any]) -> None:
    """The background half of a save; its total time, or its error, go into ``outcome``."""
    try:
        write_and_publish(job, group)
        outcome["save_total_ms"] = 1000 * (time.perf_counter() - start)
    except BaseException as e:  # raised on the training thread by Checkpointer.wait
        outcome["error"] = e
