"""The step's routing figures, and the expert bias that balances from them.

Each MoE layer adds, per training micro-batch, its tokens per expert, its dropped assignments and
its auxiliary and z losses to ``RoutingStats`` (device tensors, no sync). ``pack`` lays them out
as one fp64 vector that rides in the step's one all-reduce; ``finish`` reads the world's sums:
the metrics, and (``moe_router_enable_expert_bias``) each held layer's bias moved by
``rate * sign(mean count - count)``, from the same sums on every rank, so every rank holds the
same bias.

What counts once: counts come from each rank that routes tokens of its own (every CP rank and,
under sequence parallelism, every TP rank; else TP rank 0), the dropped assignments and the
losses from TP rank 0 (the TP ranks hold the same values; a CP rank holds its share of them).

The losses' gradients: each layer attaches its losses to its output (``attach_losses``), seeded
in backward with ``backward_scale``, the factor the loop's loss gets (1 / micro-batches, x CP,
x the fp16 loss scale): the losses' gradients then come with the layer's own backward, on
whichever pipeline stage holds it, normalised exactly as the LM loss's sum and count are.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megatron.parallel.state import ParallelState


class _AttachLosses(torch.autograd.Function):
    """Identity on ``x`` forward; backward passes x's gradient and seeds ``losses`` with
    ``scale`` (their gradient as terms of the step's loss)."""

    @staticmethod
    def forward(ctx, x: Tensor, losses: Tensor, scale: Tensor | float) -> Tensor:
        ctx.scale = scale
        ctx.shape, ctx.dtype, ctx.device = losses.shape, losses.dtype, losses.device
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        seed = torch.ones(ctx.shape, dtype=ctx.dtype, device=ctx.device) * ctx.scale
        return grad, seed, None


class RoutingStats:
    """One per model: the figures of the MoE layers of ``moe_layers`` (global indices, over every
    pipeline stage; this rank fills those it holds)."""

    def __init__(self, cfg, state: ParallelState, sequence_parallel: bool):
        self.layers = [i for i, moe in enumerate(cfg.moe_layers) if moe]
        self.slot = {index: slot for slot, index in enumerate(self.layers)}
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.aux_on, self.z_on = cfg.moe_aux_loss_coeff > 0, cfg.moe_z_loss_coeff > 0
        self.drops = cfg.moe_expert_capacity_factor is not None
        self.bias_rate = cfg.moe_router_bias_update_rate
        self.counts_here = (sequence_parallel and state.tp_size > 1) or state.tp_rank == 0
        self.losses_here = state.tp_rank == 0
        self.routers: dict[int, nn.Module] = {}  # held layer -> its router, with expert_bias
        self.backward_scale: Tensor | float = 1.0
        n, device = len(self.layers), state.device
        self.losses = torch.zeros(2, dtype=torch.float64, device=device)  # aux, z
        self.counts = torch.zeros(n, self.num_experts, dtype=torch.float64, device=device)
        self.dropped = torch.zeros(n, dtype=torch.float64, device=device)

    def reset(self) -> None:
        """Zero the sums in place (the loop calls it at the start of each training step)."""
        for sums in (self.losses, self.counts, self.dropped):
            sums.zero_()

    def record(
        self, index: int, counts: Tensor, dropped: Tensor, aux: Tensor | None, z: Tensor | None
    ) -> None:
        """Layer ``index``'s micro-batch: tokens per expert it routed [E], its dropped
        assignments [], and its losses (detached by the caller; None where off)."""
        slot = self.slot[index]
        if self.counts_here:
            self.counts[slot] += counts
        if self.losses_here:
            self.dropped[slot] += dropped
            for i, loss in enumerate((aux, z)):
                if loss is not None:
                    self.losses[i] += loss.to(torch.float64)

    def attach_losses(self, x: Tensor, losses: Tensor) -> Tensor:
        """``x`` with ``losses`` (a scalar) joined to its backward (see the module's doc)."""
        return _AttachLosses.apply(x, losses, self.backward_scale)

    def pack(self) -> Tensor:
        """This rank's figures, 1-D fp64: the losses, the counts per (layer, expert), the drops."""
        return torch.cat([self.losses, self.counts.reshape(-1), self.dropped])

    def finish(self, totals: list[float], micro_batches: int, replicas: int) -> dict[str, float]:
        """From the world's sums of ``pack``: the step's metrics (the losses as the loss is
        averaged, over the micro-batches and the replicas; per layer the tokens-per-expert
        imbalance, max over mean, and the dropped assignments), and the expert biases moved."""
        n, experts = len(self.layers), self.num_experts
        # Host floats: the counts are exact integers in fp64.
        counts = [totals[2 + slot * experts : 2 + (slot + 1) * experts] for slot in range(n)]
        metrics = {}
        if self.aux_on:
            metrics["moe aux loss"] = totals[0] / (micro_batches * replicas)
        if self.z_on:
            metrics["moe z loss"] = totals[1] / (micro_batches * replicas)
        for slot, index in enumerate(self.layers):
            mean = sum(counts[slot]) / experts
            metrics[f"moe imbalance/layer_{index}"] = max(counts[slot]) / max(mean, 1e-12)
            if self.drops:
                metrics[f"moe dropped/layer_{index}"] = totals[2 + n * experts + slot]
        for index, router in self.routers.items():
            row = counts[self.slot[index]]
            mean = sum(row) / experts
            step = [self.bias_rate * ((c < mean) - (c > mean)) for c in row]  # rate * sign
            bias = router.expert_bias
            bias.add_(torch.tensor(step, dtype=torch.float32).to(bias.device, non_blocking=True))
        return metrics


def routing_stats(model: nn.Module) -> RoutingStats | None:
    """The model's ``RoutingStats``, or None for a dense model."""
    return getattr(model, "routing", None)
