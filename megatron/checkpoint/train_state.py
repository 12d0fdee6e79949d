"""``TrainState``: what the loop trains, a checkpoint saves and a resume restores. The run's facts
(config, ``ParallelState``, vocabulary size) are not train state: they travel beside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from megatron.optim.lr_schedule import LRSchedule
from megatron.optim.optimizer import MainParamOptimizer
from megatron.parallel.random import RNGTracker


@dataclass
class LogWindow:
    """The iterations since the last training line: metric sums (each iteration's value already
    averaged over DP, so equal on every rank), seconds, skipped and non-finite steps. It travels
    in checkpoints, so a run resumed mid-window writes the lines of one that never stopped."""

    steps: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    skipped: int = 0
    nans: int = 0

    absent: dict[str, int] = field(default_factory=dict)  # steps a metric had no value (None)

    def add(
        self, values: dict[str, float | None], seconds: float, skipped: bool, nan: bool
    ) -> None:
        self.steps += 1
        for name, value in values.items():
            if value is None:
                self.absent[name] = self.absent.get(name, 0) + 1
            else:
                self.sums[name] = self.sums.get(name, 0.0) + value
        self.seconds += seconds
        self.skipped += skipped
        self.nans += nan

    def means(self) -> dict[str, float]:
        """Each metric's mean over the steps that had a value (a source with no tokens in a
        step has none)."""
        return {
            name: total / (self.steps - self.absent.get(name, 0))
            for name, total in self.sums.items()
        }


@dataclass
class Progress:
    """Where the run stands, the data position included; saved with every checkpoint (JSON)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iters: int = 0  # steps not applied: overflow or a non-finite gradient
    nan_iters: int = 0  # of those, the ones whose loss itself was not finite
    consecutive_skips: int = 0
    window: LogWindow = field(default_factory=LogWindow)  # iterations not logged yet
    # Global batches never trained on (``megatron.config.skip_list``): part of the data order.
    skip_batches: list[list[int]] = field(default_factory=list)
    rollbacks: int = 0  # loss spikes rolled back (training.max_rollbacks)
    recent_losses: list[float] = field(default_factory=list)  # the spike guard's window

    @classmethod
    def restore(cls, saved: dict[str, Any]) -> Progress:
        """From a checkpoint's progress; keys an older checkpoint lacks keep their defaults."""
        names = set(cls.__dataclass_fields__) - {"window"}
        counters = {k: v for k, v in saved.items() if k in names}
        return cls(**counters, window=LogWindow(**saved.get("window", {})))


@dataclass
class TrainState:
    """This rank's share of the training state.

    ``model``: its model (every chunk it holds, with virtual pipeline stages). ``optimizer``
    holds the loss scaler (``optimizer.scaler``). A weights-only load (fine-tuning, inference,
    export) needs only the model: the other parts may be None.
    """

    model: nn.Module
    optimizer: MainParamOptimizer | None = None
    schedule: LRSchedule | None = None
    tracker: RNGTracker | None = None
    progress: Progress = field(default_factory=Progress)
