"""Sequence parallelism beyond the mappings: the parameters it makes partial, and its dropout.

With ``parallel.sequence_parallel`` the activations between the TP regions (LayerNorms, dropouts,
residual adds) are split along the sequence over the TP group (Korthikanti et al. 2022; the
all-gathers and reduce-scatters are in ``mappings``). Two things follow:

- A replicated parameter applied to split activations (a LayerNorm's weight and bias, a
  row-parallel bias) gets from each rank only the gradient of that rank's tokens (as QK norms,
  at any TP size, get that of the rank's heads: they are flagged alike). Such a parameter
  carries ``sequence_parallel = True`` (besides having no ``tp_split_dim``: it stays replicated),
  and ``allreduce_sequence_parallel_grads`` sums those gradients over TP after backward, before
  clipping, so every rank then holds the full, identical gradient.
- Dropout on split activations must drop what the unsplit model drops: every rank draws the full
  mask from the shared generator, exactly as the unsplit path does, and keeps its own slice,
  as bools: one byte per element saved for backward, as the estimate counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.parallel.state import ParallelState


def sequence_group(state: ParallelState, enabled: bool) -> dist.ProcessGroup | None:
    """The group activations are split over along the sequence: the TP group when sequence
    parallelism is on and TP > 1, else None (nothing is split)."""
    return state.tp_group if enabled and state.tp_size > 1 else None


def mark_sequence_parallel(*params: Tensor) -> None:
    """Flag ``params`` (a LayerNorm's, a row-parallel bias) as used on sequence-split
    activations, so their gradients are summed over TP after backward."""
    for param in params:
        param.sequence_parallel = True


def is_sequence_parallel(param: Tensor) -> bool:
    """Whether ``param`` is replicated but sees only this rank's slice of the sequence."""
    return getattr(param, "sequence_parallel", False)


def allreduce_sequence_parallel_grads(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum the flagged parameters' gradients over ``group`` (TP), in place: one flat all-reduce.

    Reads and writes ``main_grad`` (DataParallel's fp32 buffer) where a parameter has one, else
    ``.grad``. A no-op without flagged parameters (sequence parallelism off) or with one rank.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = []
    for param in model.parameters():
        if param.requires_grad and is_sequence_parallel(param):
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grads.append(grad)
    if not grads:
        return
    # The flagged parameters lie scattered through the DP buffer: one flat copy, so that the
    # dozens of small LayerNorm gradients cost one collective.
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(summed.view_as(grad))


class _MaskedScale(torch.autograd.Function):
    """``x * mask * scale`` for a bool ``mask`` and a Python float ``scale``, saving only the
    mask: one byte per element for backward, as the fused CUDA dropout saves, where multiplying
    by a float mask would save that mask in the model dtype.

    ``x * mask`` is exact (x or a zero of x's sign), so each element is rounded once, by the
    multiplication by ``scale``: the bits of ``x * m`` for the float mask ``m = mask * scale``
    that ``F.dropout``'s CPU path builds and multiplies by, forward and backward alike.
    """

    @staticmethod
    def forward(ctx, x: Tensor, mask: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return torch.mul(x, mask).mul_(scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None, None


def dropout_slice(x: Tensor, p: float, tp: int, rank: int) -> Tensor:
    """``F.dropout(full, p)``'s slice ``rank`` of ``tp`` along the sequence, where ``x`` is
    that slice [b, s / tp, h] of ``full`` [b, s, h] and ``p`` is in (0, 1).

    The full mask comes from the generator exactly as the unsplit model draws it (dropout of
    ones: the same draws as dropout of a tensor of that shape); the draw costs what the unsplit
    dropout costs, and only this rank's slice of it is kept, as bools, for backward.
    """
    s_local = x.shape[1]
    full = x.new_ones((x.shape[0], s_local * tp, *x.shape[2:]))  # [b, s, h]
    kept = F.dropout(full, p, True).narrow(1, rank * s_local, s_local) != 0
    # What the drawn mask holds where it keeps: 1 / (1 - p) in x's dtype, computed as
    # F.dropout's CPU path computes it (ones divided by 1 - p; CUDA's fused kernel rounds its
    # fp32 1 / (1 - p) to the same value), so that x * scale rounds to x * mask's bits.
    scale = torch.ones((), dtype=x.dtype).div_(1 - p).item()
    return _MaskedScale.apply(x, kept, scale)


def dropout(x: Tensor, p: float, training: bool, group: dist.ProcessGroup | None) -> Tensor:
    """``F.dropout`` of ``x``, which is this rank's sequence slice [b, s / tp, h] over ``group``
    (None: ``x`` is whole, plain dropout): the split model drops bit for bit what the unsplit
    one drops (``dropout_slice``)."""
    if group is None or not training or p == 0.0:
        return F.dropout(x, p, training)
    return dropout_slice(x, p, dist.get_world_size(group), dist.get_rank(group))
