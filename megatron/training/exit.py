"""When to save and stop: the exit signal, ``training.exit_interval`` and
``training.exit_duration_in_mins``, decided by every rank at the same iteration.

The signal handler only records that the signal came, so a signal is never lost, whenever it
arrives: during a step, an evaluation, a save, or the setup before the first step. Once per
iteration every rank's flags are summed in one all-reduce, so a signal delivered to any one rank
makes every rank save at the same iteration and exit 0: ``ExitPolicy.contribution`` is a rank's
share (the step's metrics, any per-rank figures such as its memory, then its flags), which rides
in the optimizer step's own all-reduce and host sync (and, on an evaluation iteration, in the
evaluation's, so that a signal that came during it is acted on at once); ``ExitPolicy.split_sums``
reads the sums and ``reason`` decides.

The signal must come early enough for the iteration in flight plus the save: a scheduler's
SIGTERM is followed by SIGKILL after its grace time (SLURM: ``KillWait``, 30 s by default), so
the scripts ask for an early warning and deliver it to the workers themselves (docs/slurm.md).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from types import FrameType

import torch
from torch import Tensor

from megatron.config.schema import TrainingConfig
from megatron.parallel.state import ParallelState


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
        """Reinstate the handler that was there before."""
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

    def contribution(
        self, metrics: dict[str, Tensor], state: ParallelState, per_rank: Sequence[float] = ()
    ) -> Tensor:
        """This rank's share of a sum over the world: ``metrics``, ``per_rank``, ``local_flags()``.

        The metrics come from TP rank 0 of each DP replica alone (TP ranks hold the same values,
        the others contribute zeros); the flags, which may differ between ranks, from every rank.
        Each ``per_rank`` value (host floats: this rank's memory, say) gets a world_size-long
        block holding it in slot ``state.rank`` and zeros elsewhere, so the sum carries every
        rank's value to every rank with no collective of its own.
        A 1-D fp64 tensor on the device, built without waiting for it: ``torch.full`` and the
        slot's fill pass host numbers as kernel arguments, where a copy from pageable memory
        would synchronise.
        """
        values = [v.reshape(1).to(torch.float64) for v in metrics.values()]
        if state.tp_rank != 0:
            values = [torch.zeros_like(v) for v in values]
        blocks = torch.zeros(
            len(per_rank), state.world_size, dtype=torch.float64, device=state.device
        )
        for block, value in zip(blocks, per_rank):
            block[state.rank] = value
        flags = [
            torch.full((1,), flag, dtype=torch.float64, device=state.device)
            for flag in self.local_flags()
        ]
        return torch.cat([*values, blocks.reshape(-1), *flags])

    def split_sums(
        self, names: Sequence[str], sums: Sequence[float], state: ParallelState, per_rank: int = 0
    ) -> tuple[dict[str, float], list[list[float]], list[float]]:
        """The world's sums of ``contribution``: the metrics ``names`` averaged over DP, the
        ``per_rank`` figures as one list each (index: global rank), and the flags summed over
        ranks (for ``reason``).

        Every rank gets the same means, so a log window filled with them, which checkpoints
        carry, is the same on every rank.
        """
        *totals, signal_seen, out_of_time = sums
        world, start = state.world_size, len(totals) - per_rank * state.world_size
        means = {
            name: total / state.dp_size for name, total in zip(names, totals[:start], strict=True)
        }
        ranks = [list(totals[start + i * world : start + (i + 1) * world]) for i in range(per_rank)]
        return means, ranks, [signal_seen, out_of_time]
