"""Expert parallelism: each rank holds a share of the experts, and token rows travel to the EP
rank that holds their expert and back.

``expert_param`` keeps this EP rank's experts of a parameter holding all E (the expert axis split
over the EP group as the TP axis is over TP); such parameters carry ``expert_parallel = True``,
which the gradient sync (their own replicas: the expert-data-parallel group) and the norm read.

An EP group of ``ep`` ranks splits E experts into ``ep`` runs of E / ep (rank r holds experts
[r E / ep, (r + 1) E / ep)). Each rank's rows arrive grouped by global expert (``dispatch.plan``),
so the rows for rank r are one contiguous run. Per MoE layer, forward::

    counts [E] -> all-to-all -> received [ep, E / ep]   what each source sends each local expert
    rows [n, h] -> all-to-all (variable splits) -> [m, h], by source, within it by local expert
    regroup by local expert (a permutation)     -> [m, h] for the grouped GEMM

and ``combine`` undoes the last two: the inverse permutation, then the reverse all-to-all. Backward
is the same exchanges reversed (``_AllToAll``): two all-to-alls of rows forward and two backward,
one of counts forward. The split sizes are read on the host (they size the receive buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron.parallel.layers import InitMethod
from megatron.parallel.state import ParallelState


def is_expert(param: Tensor) -> bool:
    """Whether ``param`` holds experts that expert parallelism splits."""
    return getattr(param, "expert_parallel", False)


def expert_param(
    full_shape: tuple[int, ...], tp_dim: int, state: ParallelState, init: InitMethod
) -> nn.Parameter:
    """All E experts' matrices drawn in fp32 (as every rank draws them), this EP rank's E / ep
    of them and this TP rank's slice kept."""
    full = init(torch.empty(full_shape, dtype=torch.float32, device=state.device))
    held = full_shape[0] // state.ep_size  # experts per EP rank
    per = full_shape[tp_dim] // state.tp_size
    mine = full.narrow(0, state.ep_rank * held, held).narrow(tp_dim, state.tp_rank * per, per)
    param = nn.Parameter(mine.clone())
    param.tp_split_dim, param.expert_parallel = tp_dim, True
    return param


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send), h] -> [sum(recv), h]: ``send[i]`` rows to rank i of ``group``, ``recv[i]``
    from it. Backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


@dataclass(frozen=True)
class Exchange:
    """How one layer's rows went out, so ``combine`` can bring them back."""

    send: list[int]  # rows this rank sent to each EP rank
    recv: list[int]  # rows it received from each
    order: Tensor  # [m]: received rows regrouped by local expert
    group: dist.ProcessGroup


def dispatch(
    rows: Tensor, counts: Tensor, group: dist.ProcessGroup
) -> tuple[Tensor, Tensor, Exchange]:
    """``rows`` [n, h] grouped by global expert, ``counts`` [E] of them per expert -> this rank's
    experts' rows [m, h] grouped by local expert, their counts [E / ep], and the exchange."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [ep * E / ep]: by source, expert
    received = received.view(ep, -1)  # [ep, E / ep]
    # One host read of both split lists: they size the buffers of the exchange.
    sizes = torch.stack([counts.view(ep, -1).sum(1), received.sum(1)]).tolist()
    send, recv = sizes
    arrived = _AllToAll.apply(rows, send, recv, group)  # [m, h], by source, then local expert
    local = torch.arange(received.shape[1], device=rows.device).repeat(ep)  # [ep * E / ep]
    expert_of_row = torch.repeat_interleave(local, received.reshape(-1), output_size=sum(recv))
    order = torch.argsort(expert_of_row, stable=True)  # [m]: by local expert, then source
    return arrived.index_select(0, order), received.sum(0), Exchange(send, recv, order, group)


def combine(rows: Tensor, exchange: Exchange) -> Tensor:
    """This rank's experts' outputs [m, h] grouped by local expert -> the outputs of the rows it
    sent [n, h], in ``dispatch``'s input order."""
    # ``order`` is a permutation: every row is written, none needs zeroing first.
    back = rows.new_empty(rows.shape).index_copy(0, exchange.order, rows)  # by source again
    return _AllToAll.apply(back, exchange.recv, exchange.send, exchange.group)
