"""The loss of each source of a blend (``data.paths`` with several prefixes), training and
validation: when the loss jumps, which corpus did it.

A blend's samples carry ``source`` (their dataset's position in ``data.paths``). The entrypoint's
forward step returns its first loss's per-sample sums ([b]) beside its sum and count
(``LossSums``). ``SourceLosses.wrap`` adds those sums, and each sample's token count (its loss
mask's row sum: this rank's share under context parallelism), into per-source totals on the
device. The totals ride in the step's one all-reduce (``pack``; counted on the ranks that report
metrics), so a source's loss is its summed loss over its summed tokens across the world:
token-weighted, and the sources' losses weighted by their tokens add up to the step's. A source
with no tokens in a step has no value that step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megatron.parallel.state import ParallelState

PREFIX = "lm loss by source/"


def source_names(prefixes: list[str]) -> list[str]:
    """Each prefix's file name, with its position where two share one."""
    names = [os.path.basename(p) for p in prefixes]
    return [f"{n}.{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


class SourceLosses:
    def __init__(self, prefixes: list[str], state: ParallelState):
        self.names = source_names(prefixes)
        self.state = state
        self.reset()

    @property
    def size(self) -> int:
        """The figures ``pack`` adds to the step's all-reduce."""
        return 2 * len(self.names)

    def reset(self) -> None:
        n, device = len(self.names), self.state.device
        self.totals = torch.zeros(2, n, dtype=torch.float64, device=device)  # loss, tokens

    def wrap(self, forward_step: Callable[[Any, dict[str, Tensor]], Any]) -> Callable:
        """``forward_step``, its per-sample loss sums added to the totals on the way out."""

        def forward(model: Any, batch: dict[str, Tensor]) -> Any:
            out = forward_step(model, batch)
            first = next(iter(out.values())) if isinstance(out, dict) else ()
            if len(first) == 3 and "source" in batch:
                sums = first[2].detach()
                tokens = batch["loss_mask"].sum(-1)
                self.totals[0].index_add_(0, batch["source"], sums.to(torch.float64))
                self.totals[1].index_add_(0, batch["source"], tokens.to(torch.float64))
            return out

        return forward

    def pack(self) -> Tensor:
        """The totals as 1-D fp64 figures for the step's all-reduce: zeros on a rank whose
        metrics do not count (the TP ranks hold copies of the same loss)."""
        flat = self.totals.reshape(-1)
        return flat if self.state.reports_metrics else torch.zeros_like(flat)

    def finish(self, figures: list[float]) -> dict[str, float | None]:
        """From the world's sums of ``pack``: each source's token-weighted loss."""
        n = len(self.names)
        loss, tokens = figures[:n], figures[n:]
        return {
            f"{PREFIX}{name}": (s / t if t else None)
            for name, s, t in zip(self.names, loss, tokens, strict=True)
        }
