"""Learning rate per optimizer step: linear warmup, then cosine or linear decay (Megatron's rule).

With ``n`` optimizer steps taken (skipped steps do not count), warmup ``W``, decay end ``D``:

    n <= W (and W > 0):  lr = init + (max - init) * n / W
    constant style:      lr = max
    n > D:               lr = min
    otherwise:           ratio = (n - W) / (D - W),  lr = min + (max - min) * coeff  with
                         coeff = 0.5 * (1 + cos(pi * ratio))  (cosine)  or  1 - ratio  (linear)

The first step therefore runs at ``init`` (0 by default) when there is a warmup, as in Megatron.
"""

from __future__ import annotations

import math
from typing import Any

from megatron.config.schema import OptimizerConfig


class LRSchedule:
    """The learning rate as a function of the optimizer steps taken so far."""

    def __init__(
        self,
        max_lr: float,
        min_lr: float,
        warmup_iters: int,
        decay_iters: int,
        decay_style: str,
        warmup_init: float = 0.0,
    ):
        if decay_style not in ("cosine", "linear", "constant"):
            raise ValueError(f"unknown decay style {decay_style!r}")
        if decay_style != "constant" and not 0 <= warmup_iters < decay_iters:
            raise ValueError(f"need 0 <= warmup_iters={warmup_iters} < decay_iters={decay_iters}")
        self.max_lr, self.min_lr, self.warmup_init = max_lr, min_lr, warmup_init
        self.warmup_iters, self.decay_iters = warmup_iters, decay_iters
        self.decay_style = decay_style
        self.num_steps = 0

    @classmethod
    def from_config(cls, cfg: OptimizerConfig) -> LRSchedule:
        """The schedule of a resolved optimizer section (``lr_decay_iters`` filled in)."""
        return cls(
            cfg.lr,
            cfg.min_lr,
            cfg.lr_warmup_iters,
            cfg.lr_decay_iters,
            cfg.lr_decay_style,
            cfg.lr_warmup_init,
        )

    def lr_at(self, step: int) -> float:
        """The learning rate once ``step`` optimizer steps have been taken."""
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.warmup_init + (self.max_lr - self.warmup_init) * step / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_iters:
            return self.min_lr
        ratio = (step - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = 1.0 - ratio
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    @property
    def lr(self) -> float:
        """The learning rate for the next optimizer step."""
        return self.lr_at(self.num_steps)

    def step(self) -> float:
        """Count one successful optimizer step; return the learning rate for the next one."""
        self.num_steps += 1
        return self.lr

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers: the step count, plus the settings it was taken under (for a warning)."""
        return {
            "num_steps": self.num_steps,
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_iters": self.warmup_iters,
            "decay_iters": self.decay_iters,
            "decay_style": self.decay_style,
            "warmup_init": self.warmup_init,
        }

    def load_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """Resume the step count; the current config's settings win over the saved ones, which
        are returned where they differ (the caller says so, once for the run)."""
        self.num_steps = int(state["num_steps"])
        return {k: v for k, v in state.items() if k != "num_steps" and getattr(self, k) != v}
