"""The paper's tensor-parallel operators as autograd Functions.

``f`` (copy) opens a parallel region and ``g`` (reduce) closes it; scatter and gather move a tensor
between replicated and split along its last dimension. Each wrapper takes the TP group explicitly
and returns its input untouched when the group has one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _split_last(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    chunk = x.shape[-1] // dist.get_world_size(group)
    return x.narrow(-1, dist.get_rank(group) * chunk, chunk).contiguous()


def _gather_last(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _Copy(torch.autograd.Function):
    """f: identity forward; all-reduce of the gradient backward (in place on the incoming grad)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        # The incoming grad is a matmul's fresh input-gradient with no other reader, so reducing
        # it in place saves a copy of [b, s, h].
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    """g: all-reduce forward (in place on the input, marked dirty); identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _Scatter(torch.autograd.Function):
    """Keep this rank's chunk of the last dimension forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _gather_last(grad, ctx.group), None


class _Gather(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's gradient chunk backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _split_last(grad, ctx.group), None


def copy_to_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """f: enter a parallel region (identity forward, all-reduce backward)."""
    return x if _size(group) == 1 else _Copy.apply(x, group)


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """g: leave a parallel region (all-reduce forward, in place; identity backward)."""
    return x if _size(group) == 1 else _Reduce.apply(x, group)


def scatter_to_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Split the last dimension across the group (gather backward)."""
    return x if _size(group) == 1 else _Scatter.apply(x, group)


def gather_from_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Concatenate every rank's last-dimension chunk (split backward)."""
    return x if _size(group) == 1 else _Gather.apply(x, group)
