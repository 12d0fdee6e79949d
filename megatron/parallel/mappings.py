"""The paper's tensor-parallel operators as autograd Functions.

``f`` (copy) opens a parallel region and ``g`` (reduce) closes it; scatter and gather move a tensor
between replicated and split along its last dimension. Each wrapper takes the TP group explicitly
and returns its input untouched when the group has one rank.

Sequence parallelism (Korthikanti et al. 2022) splits the activations between the TP regions
along the sequence, dimension 1 of ``[b, s, h]``. Its f is an all-gather along the sequence
(reduce-scatter backward) and its g a reduce-scatter (all-gather backward): each moves half the
bytes of an all-reduce, which is itself a reduce-scatter and an all-gather, so the wire carries
what it did. Scatter and gather along the sequence bridge to replicated tensors at the model's
ends. The collectives work on dimension 0, so ``[b, s, h]`` is laid out rank-major as
``[tp, b, s / tp, h]`` on the way in or out (one copy each).
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


def _seq_chunk(x: Tensor, tp: int) -> int:
    """Positions per rank when [b, s, ...] is split along the sequence over ``tp`` ranks."""
    if x.shape[1] % tp:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the TP size {tp}")
    return x.shape[1] // tp


def _split_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    chunk = _seq_chunk(x, dist.get_world_size(group))
    return x.narrow(1, dist.get_rank(group) * chunk, chunk).contiguous()


def all_gather_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[b, s / tp, h] on each rank -> [b, s, h], rank r's part at positions r * s / tp onwards.

    A plain function, not an autograd one: LinearWithGradReduce calls it inside its forward.
    """
    tp = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((tp * x.shape[0], *x.shape[1:]))  # [tp * b, s / tp, h], rank-major
    dist.all_gather_single(out, x, group=group)
    b, s_local = x.shape[:2]
    # [tp, b, s / tp, h] -> [b, tp, s / tp, h] -> [b, s, h]
    return out.view(tp, *x.shape).transpose(0, 1).reshape(b, tp * s_local, *x.shape[2:])


class _SumOnWait:
    """A reduce-scatter run as an all-to-all: ``wait`` waits for the exchange, then sums the
    ``received`` parts [tp, b, s / tp, h] over dim 0 into ``out``, as the reduce would have."""

    def __init__(self, work: dist.Work, received: Tensor, out: Tensor):
        self._work, self._received, self._out = work, received, out

    def wait(self) -> bool:
        self._work.wait()
        torch.sum(self._received, dim=0, out=self._out)
        return True


def reduce_scatter_seq_start(
    x: Tensor, group: dist.ProcessGroup
) -> tuple[Tensor, dist.Work | _SumOnWait]:
    """Start summing [b, s, h] over the group, keeping this rank's [b, s / tp, h] sequence slice.

    Returns the output buffer and the pending work (wait on it before reading the buffer);
    LinearWithGradReduce overlaps it with the weight-gradient matmul.
    """
    tp = dist.get_world_size(group)
    b, s_local, rest = x.shape[0], _seq_chunk(x, tp), x.shape[2:]
    # [b, s, h] -> [b, tp, s / tp, h] -> [tp, b, s / tp, h] -> [tp * b, s / tp, h], rank-major
    parts = x.reshape(b, tp, s_local, *rest).transpose(0, 1).reshape(tp * b, s_local, *rest)
    out = x.new_empty((b, s_local, *rest))
    if dist.get_backend(group) == "gloo":
        # gloo's reduce-scatter all-reduces the whole tensor and keeps a slice (a profile shows
        # one gloo:all_reduce per call): twice a ring's bytes, and on a 2-core machine as slow
        # as the all-reduce it was to replace. An all-to-all sends each rank only its part.
        received = torch.empty_like(parts)  # [tp * b, s / tp, h]: rank r sent part r here
        work = dist.all_to_all_single(received, parts, group=group, async_op=True)
        return out, _SumOnWait(work, received.view(tp, b, s_local, *rest), out)
    work = dist.reduce_scatter_single(out, parts, group=group, async_op=True)
    return out, work


def reduce_scatter_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum [b, s, h] over the group, keep this rank's [b, s / tp, h] sequence slice."""
    out, work = reduce_scatter_seq_start(x, group)
    work.wait()
    return out


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


class _Exchange(torch.autograd.Function):
    """``forward_fn(x, group)`` forward; ``backward_fn(grad, group)`` backward: the scatters and
    gathers below, each of which is the other's adjoint."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, forward_fn, backward_fn) -> Tensor:
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.backward_fn(grad, ctx.group), None, None, None


def copy_to_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """f: enter a parallel region (identity forward, all-reduce backward)."""
    return x if _size(group) == 1 else _Copy.apply(x, group)


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """g: leave a parallel region (all-reduce forward, in place; identity backward)."""
    return x if _size(group) == 1 else _Reduce.apply(x, group)


def scatter_to_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Split the last dimension across the group (gather backward)."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, _split_last, _gather_last)


def gather_from_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Concatenate every rank's last-dimension chunk (split backward)."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, _gather_last, _split_last)


def gather_seq_to_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sequence-parallel f: enter a parallel region from sequence-split activations (all-gather
    along the sequence forward; reduce-scatter of the partial input gradients backward)."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, all_gather_seq, reduce_scatter_seq)


def reduce_scatter_seq_from_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sequence-parallel g: leave a parallel region into sequence-split activations
    (reduce-scatter along the sequence forward; all-gather backward)."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, reduce_scatter_seq, all_gather_seq)


def scatter_seq(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Split a replicated [b, s, h] along the sequence (all-gather backward): the embedding end."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, _split_seq, all_gather_seq)


def gather_seq(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Replicate sequence-split activations for replicated consumers: all-gather forward; backward
    keeps this rank's slice of the gradient, which such consumers make whole on every rank."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, all_gather_seq, _split_seq)
