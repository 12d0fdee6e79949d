"""Profiling windows of iterations, one file per rank: torch.profiler traces
(``logging.profile_steps``) and CUDA allocator snapshots (``logging.memory_snapshot_steps``).

Both go to ``<logging.tensorboard_dir>/profile``, else ``<checkpoint.save>/profile`` (the config
checks refuse a window with neither). Off, ``Profiling.step`` is two comparisons: no tensor, no
host sync.
"""

from __future__ import annotations

import os

import torch

from megatron.config.schema import Config
from megatron.errors import ConfigError
from megatron.logging import log


def _inside(window: list[int] | None, iteration: int) -> bool:
    return window is not None and window[0] <= iteration <= window[1]


class Profiling:
    """The loop calls ``step`` as each iteration starts and ``close`` when it ends; a window runs
    from its first iteration's start to the start of the iteration after its last (so its last
    iteration's evaluation, logging and save are in it), or to ``close``. A run resumed inside a
    window profiles the rest of it."""

    def __init__(self, cfg: Config, rank: int, device: torch.device) -> None:
        lg = cfg.logging
        self._trace_steps, self._memory_steps = lg.profile_steps, lg.memory_snapshot_steps
        if self._memory_steps is not None and device.type != "cuda":
            raise ConfigError(
                f"logging.memory_snapshot_steps records the CUDA allocator and this run is on "
                f"{device.type}; set it to null, or run on GPUs"
            )
        self._dir = os.path.join(lg.tensorboard_dir or cfg.checkpoint.save or "", "profile")
        self._rank, self._device = rank, device
        self._profiler: torch.profiler.profile | None = None
        self._recording = False

    def step(self, iteration: int) -> None:
        """Iteration ``iteration`` (1-based, as logged) starts."""
        trace = _inside(self._trace_steps, iteration)
        if self._profiler is not None:
            if trace:
                self._profiler.step()  # a ProfilerStep# marker per iteration, for the plugin
            else:
                self._stop_trace()
        elif trace:
            self._start_trace()
        memory = _inside(self._memory_steps, iteration)
        if memory != self._recording:
            self._start_memory() if memory else self._stop_memory()

    def close(self) -> None:
        """The run ends: what is still recording is written now."""
        if self._profiler is not None:
            self._stop_trace()
        if self._recording:
            self._stop_memory()

    def _start_trace(self) -> None:
        # Kineto prints "profiler_start/stop" on every rank's stderr, between our log lines; its
        # levels put those above its errors, so only "off" (6) quiets them. Read at first use.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # The plugin's file name (<worker>.<ns>.pt.trace.json.gz) is a Chrome trace too, so one
        # file serves chrome://tracing, Perfetto and TensorBoard; a later window gets its own.
        # gzip: the JSON shrinks about tenfold, and all three read it as it is.
        handler = torch.profiler.tensorboard_trace_handler(
            self._dir, f"rank{self._rank}", use_gzip=True
        )
        # A schedule that always records: it only makes step() mark iterations; stop() saves.
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=lambda _: torch.profiler.ProfilerAction.RECORD,
            on_trace_ready=handler,
            record_shapes=True,
        )
        self._profiler.start()

    def _stop_trace(self) -> None:
        self._profiler.stop()
        self._profiler = None
        log.info("profiler trace written under %s", self._dir)

    def _start_memory(self) -> None:
        # Bounded: each entry keeps its stack trace, a few KB.
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._recording = True

    def _stop_memory(self) -> None:
        os.makedirs(self._dir, exist_ok=True)
        path = os.path.join(self._dir, f"rank{self._rank}.memory_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        self._recording = False
        log.info("CUDA memory snapshot written to %s", path)
