"""The loss as the library forms it, and the step's one sum over the world.

A forward step returns each loss's sum and count (tokens or samples), ``LossSums``; an
entrypoint never divides. ``micro_batch_loss`` makes each loss its micro-batch's mean, the loop
divides by the step's micro-batches, and the gradient sync and ``StepReduction`` average over
the model's replicas (``ParallelState.replicas``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron.parallel.state import ParallelState

# {loss name: (sum over the micro-batch, its count of tokens or samples)}; a third element, the
# per-sample sums [b], lets a blend's loss be split by source (``source_losses``).
LossSums = dict[str, tuple[Tensor, Tensor | int] | tuple[Tensor, Tensor | int, Tensor]]


def micro_batch_loss(losses: LossSums) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's loss to backpropagate, the sum of each loss's mean, and those means,
    detached, as its metrics."""
    means = {name: total / count for name, (total, count, *_) in losses.items()}
    return sum(means.values()), {name: mean.detach() for name, mean in means.items()}


class StepReduction:
    """A step's metrics summed over its micro-batches (``add``), packed with the exit flags into
    this rank's share of the step's one sum over the world (``pack``: it rides in the optimizer
    step's all-reduce and host sync, an evaluation's in its own), and that sum read (``unpack``).
    """

    def __init__(self, state: ParallelState):
        self.state = state
        self.sums: dict[str, Tensor] = {}
        self.count = 0  # micro-batches added
        self.extra_size = 0  # figures ``pack`` appended after the metrics

    def add(self, metrics: dict[str, Tensor], count: int = 1) -> None:
        """``metrics``: one micro-batch's, or their sums over ``count`` micro-batches."""
        for name, value in metrics.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.count += count

    def pack(self, flags: Sequence[float], extra: Tensor | None = None) -> Tensor:
        """The metrics' means over the micro-batches, counted on one rank of each replica (the
        others add zeros), then ``extra`` (1-D fp64 figures whose own owner says who counts
        them: the MoE layers' ``RoutingStats``), then the exit policy's ``local_flags()``,
        counted on every rank.

        1-D fp64 on the device, built without waiting for it: ``torch.full`` passes the host
        flags as kernel arguments, where a copy from pageable memory would synchronise.
        """
        values = [(v / self.count).reshape(1).to(torch.float64) for v in self.sums.values()]
        if not self.state.reports_metrics:
            values = [torch.zeros_like(v) for v in values]
        if extra is not None:
            values.append(extra)
        self.extra_size = 0 if extra is None else extra.numel()
        device = self.state.device
        held = [torch.full((1,), flag, dtype=torch.float64, device=device) for flag in flags]
        return torch.cat([*values, *held])

    def unpack(self, totals: Sequence[float]) -> tuple[dict[str, float], list[float], list[float]]:
        """From the world's sums of ``pack``: the metrics averaged over the replicas (the same on
        every rank, as the log windows that checkpoints carry must be), the flags summed over
        ranks (for ``ExitPolicy.reason``), and ``extra``'s sums."""
        n, extra = len(self.sums), self.extra_size
        metrics, figures, flags = totals[:n], totals[n : n + extra], totals[n + extra :]
        replicas = self.state.replicas
        means = {name: total / replicas for name, total in zip(self.sums, metrics, strict=True)}
        return means, list(flags), list(figures)
