"""``TrainState``: what the loop trains, a checkpoint saves and a resume restores. The run's facts
(config, ``ParallelState``, vocabulary size) are not train state: they travel beside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from megatron.optim.lr_schedule import LRSchedule
from megatron.optim.optimizer import MainParamOptimizer
from megatron.parallel.random import RNGTracker
from megatron.training.metrics import LogWindow


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
