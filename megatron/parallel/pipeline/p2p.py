"""Point-to-point communication between neighbouring pipeline stages.

Stages form a ring: stage s sends activations forward to stage s + 1 and receives their
gradients back from it. The ring closes (the last stage's next is stage 0) because an
interleaved pipeline hands the last stage's output of chunk c to stage 0's chunk c + 1.

Every exchange is one ``torch.distributed.batch_isend_irecv`` of fixed-shape tensors
(micro-batch x sequence x hidden, known in advance, so no shape is ever exchanged). The 1F1B
helpers wait for all of it before returning; ``start_exchange`` returns the transfers still
pending, so a schedule can wait for a received activation only before the forward that reads it,
for a gradient only before its backward, and for its sends only at the end (a send completes
only once the receiver has posted, so waiting for it early makes every exchange a rendezvous).
Batching a stage's sends with its receives is what keeps 1F1B free of deadlock where a send
completes only once its receiver posts (NCCL): two neighbours that both send and then both
receive, separately, would each wait for the other forever.

Matching. Between two ranks, messages of one direction are matched in the order they were
posted. With two stages, a rank's prev and next are the same peer, so one direction carries both
activations and gradients. Every exchange therefore posts activations before gradients on both
sides (sends: to next, then to prev; receives: from prev, then from next), and tags them apart
(gloo honours tags; NCCL ignores them and relies on that order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

# Tags that keep a stage pair's activations and gradients apart when both flow the same way.
ACTIVATION_TAG = 0
GRADIENT_TAG = 1


@dataclass(frozen=True)
class PipelineGroup:
    """One pipeline: this process's stage and its ring neighbours (global ranks, for p2p).

    For 8 ranks as ``[dp=2, pp=4]`` the pipelines are [0 1 2 3] and [4 5 6 7]; rank 5 is stage 1
    with prev_rank 4 and next_rank 6, and rank 7 (the last stage) has next_rank 4.
    """

    group: dist.ProcessGroup | None
    rank: int  # this process's stage, 0 .. size - 1
    size: int
    prev_rank: int  # global rank of stage (rank - 1) % size
    next_rank: int  # global rank of stage (rank + 1) % size

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @classmethod
    def from_ranks(
        cls, ranks: list[int], group: dist.ProcessGroup | None, rank: int
    ) -> PipelineGroup:
        """The pipeline through global ``ranks`` (stage order), as seen from global ``rank``."""
        stage = ranks.index(rank)
        size = len(ranks)
        return cls(group, stage, size, ranks[(stage - 1) % size], ranks[(stage + 1) % size])


@dataclass(frozen=True)
class ActivationSpec:
    """The shape, dtype and device of every tensor that crosses a stage boundary."""

    shape: tuple[int, ...]  # [micro_batch, seq, hidden]
    dtype: torch.dtype
    device: torch.device


class PendingExchange:
    """An exchange whose transfers may still be under way; it holds every tensor it sends or
    receives until they are complete.

    ``activation()`` and ``gradient()`` wait for one receive and return its buffer (None where
    nothing was asked, or on a second call); ``wait_sends()`` waits for the sends. Where the
    backend completes a batch as a whole (NCCL returns one request for it), each of them waits
    for the whole exchange.
    """

    def __init__(self, ops: dict[str, dist.P2POp]):
        # ops by role: "next" and "prev" (sends), "activation" and "gradient" (receives), posted
        # in that order (see "Matching" in the module docstring).
        self._ops = ops  # keeps each transfer's dense tensor alive until waited on
        requests = dist.batch_isend_irecv(list(ops.values())) if ops else []
        if len(requests) == len(ops):
            self._requests = {role: [request] for role, request in zip(ops, requests)}
        else:
            self._requests = {role: requests for role in ops}

    def _wait(self, role: str) -> Tensor | None:
        for request in self._requests.pop(role, []):
            request.wait()
        op = self._ops.pop(role, None)  # complete: the exchange need hold its tensor no longer
        return None if op is None else op.tensor

    def activation(self) -> Tensor | None:
        """The activation from the previous stage, once it has arrived."""
        return self._wait("activation")

    def gradient(self) -> Tensor | None:
        """The gradient from the next stage, once it has arrived."""
        return self._wait("gradient")

    def wait_sends(self) -> None:
        """Wait until every tensor this exchange sent has been received."""
        self._wait("next")
        self._wait("prev")

    def wait(self) -> tuple[Tensor | None, Tensor | None]:
        """Wait for the whole exchange; return (from_prev, from_next)."""
        from_prev, from_next = self.activation(), self.gradient()
        self.wait_sends()
        return from_prev, from_next


def start_exchange(
    pipe: PipelineGroup,
    spec: ActivationSpec,
    send_next: Tensor | None = None,
    send_prev: Tensor | None = None,
    recv_prev: bool = False,
    recv_next: bool = False,
) -> PendingExchange:
    """Post sends to / receives from the neighbours at once; return them still pending.

    ``send_next`` is an activation for the next stage, ``send_prev`` a gradient for the previous
    one; the activation received from the previous stage and the gradient from the next arrive
    in fresh buffers, where asked. Every exchange must eventually be waited on in full.
    """
    # Activations before gradients on both sides: see "Matching" in the module docstring.
    ops = {}
    if send_next is not None:
        ops["next"] = _op(dist.isend, send_next, pipe.next_rank, pipe, ACTIVATION_TAG)
    if send_prev is not None:
        ops["prev"] = _op(dist.isend, send_prev, pipe.prev_rank, pipe, GRADIENT_TAG)
    if recv_prev:
        ops["activation"] = _op(dist.irecv, _empty(spec), pipe.prev_rank, pipe, ACTIVATION_TAG)
    if recv_next:
        ops["gradient"] = _op(dist.irecv, _empty(spec), pipe.next_rank, pipe, GRADIENT_TAG)
    return PendingExchange(ops)


def _exchange(pipe: PipelineGroup, spec: ActivationSpec, **transfers) -> tuple[Tensor | None, ...]:
    """``start_exchange``, waited on in full; return (from_prev, from_next)."""
    return start_exchange(pipe, spec, **transfers).wait()


def _empty(spec: ActivationSpec) -> Tensor:
    return torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)


def _op(fn: Callable, tensor: Tensor, peer: int, pipe: PipelineGroup, tag: int) -> dist.P2POp:
    # Transfers read or fill the storage directly: autograd must not see them, and the tensor
    # must be dense (a copy, if needed, lives in the op until the exchange has waited).
    return dist.P2POp(fn, tensor.detach().contiguous(), peer, pipe.group, tag)


def recv_forward(pipe: PipelineGroup, spec: ActivationSpec) -> Tensor | None:
    """The input activation from the previous stage (None on the first stage)."""
    return None if pipe.is_first else _exchange(pipe, spec, recv_prev=True)[0]


def send_forward(pipe: PipelineGroup, spec: ActivationSpec, output: Tensor | None) -> None:
    """The output activation to the next stage (nothing on the last stage)."""
    if not pipe.is_last:
        _exchange(pipe, spec, send_next=output)


def recv_backward(pipe: PipelineGroup, spec: ActivationSpec) -> Tensor | None:
    """The gradient of this stage's output from the next stage (None on the last stage)."""
    return None if pipe.is_last else _exchange(pipe, spec, recv_next=True)[1]


def send_backward(pipe: PipelineGroup, spec: ActivationSpec, input_grad: Tensor | None) -> None:
    """The gradient of this stage's input to the previous stage (nothing on the first stage)."""
    if not pipe.is_first:
        _exchange(pipe, spec, send_prev=input_grad)


def send_forward_recv_backward(
    pipe: PipelineGroup, spec: ActivationSpec, output: Tensor | None
) -> Tensor | None:
    """Steady 1F1B: this forward's output goes next, the gradient of an earlier one comes back."""
    return None if pipe.is_last else _exchange(pipe, spec, send_next=output, recv_next=True)[1]


def send_backward_recv_forward(
    pipe: PipelineGroup, spec: ActivationSpec, input_grad: Tensor | None
) -> Tensor | None:
    """Steady 1F1B: this backward's input gradient goes back, the next input comes in."""
    return None if pipe.is_first else _exchange(pipe, spec, send_prev=input_grad, recv_prev=True)[0]
