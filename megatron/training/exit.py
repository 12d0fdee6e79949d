"""When to save and stop: the exit signal, ``training.exit_interval`` and
``training.exit_duration_in_mins``, decided by every rank at the same iteration.

The signal handler only records that the signal came, so a signal is never lost, whenever it
arrives: during a step, an evaluation, a save, or the setup before the first step. Once per
iteration every rank's flags (``ExitPolicy.local_flags``) are summed in the step's reduction
(``megatron.training.reduction``; again after an evaluation), so a signal delivered to any one
rank makes every rank save at the same iteration and exit 0; ``reason`` decides from the sums.

The signal must come early enough for the iteration in flight plus the save: a scheduler's
SIGTERM is followed by SIGKILL after its grace time (SLURM: ``KillWait``, 30 s by default), so
the scripts ask for an early warning and deliver it to the workers themselves (docs/slurm.md).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from types import FrameType

from megatron.config.schema import TrainingConfig


class ExitSignal:
    """Records delivery of the signal ``name`` until ``restore()`` reinstates the old handler."""

    def __init__(self, name: str):
        self.name = name
        self.signum = getattr(signal, name)
        self.received = False
        self._previous = signal.signal(self.signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def restore(self) -> None:
        signal.signal(self.signum, self._previous)


class ExitPolicy:
    """The reasons to save and stop; the time-dependent ones must be agreed across ranks."""

    def __init__(self, cfg: TrainingConfig, exit_signal: ExitSignal, start_time: float):
        self.cfg, self.signal, self.start_time = cfg, exit_signal, start_time

    def local_flags(self) -> list[float]:
        """This rank's view, as numbers to be summed over ranks: [signal seen, time is up]."""
        minutes = self.cfg.exit_duration_in_mins
        out_of_time = bool(minutes) and time.time() - self.start_time > 60 * minutes
        return [float(self.signal.received), float(out_of_time)]

    def reason(self, iteration: int, flags: Sequence[float]) -> str:
        """Why every rank stops after ``iteration`` ('' to go on); ``flags``: summed over ranks.

        Every rank gets the same answer: the interval is a function of the iteration, the rest
        comes from the all-reduced flags.
        """
        signal_seen, out_of_time = flags
        if signal_seen:
            return f"signal {self.signal.name}"
        if out_of_time:
            return f"training.exit_duration_in_mins={self.cfg.exit_duration_in_mins}"
        if self.cfg.exit_interval and iteration % self.cfg.exit_interval == 0:
            return f"training.exit_interval={self.cfg.exit_interval}"
        return ""
