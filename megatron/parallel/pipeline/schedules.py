"""The 1F1B pipeline schedule (PipeDream-Flush), and what every schedule shares.

A stage's model chunk is a callable (an ``nn.Module``, say) called as ``chunk(hidden, batch)``:
``hidden`` is the activation received from the previous stage, or None on the pipeline's first
chunk (which reads the micro-batch instead); ``batch`` is the micro-batch, which every chunk may
read (the last one needs its labels). The pipeline's last chunk returns the micro-batch's scalar
loss, every other chunk an activation of the schedule's fixed shape.

One optimizer step's micro-batches are the schedule's micro-batches. Each stage runs every
micro-batch forward, then backward from the gradient the next stage sends back; parameter
gradients accumulate across micro-batches as autograd does by default (``.grad``, or the
caller's hooks). The last stage backpropagates ``scale_loss(loss)``: the caller divides by the
number of micro-batches, multiplies by an fp16 loss scale, or both. No optimizer work is done.

1F1B on stage s of p with m micro-batches (F = forward, B = backward, numbers = micro-batches):

    warm-up    min(p - s - 1, m) forwards, each output sent on
    steady     the remaining ones: forward one, then backward the oldest in flight
    cool-down  the backwards of the warm-up micro-batches

    p = 3, m = 4, one tick per forward or backward:

        tick     0  1  2  3  4  5  6  7  8  9  10 11
        stage 0  F0 F1 F2       B0 F3 B1    B2    B3
        stage 1     F0 F1    B0 F2 B1 F3 B2    B3
        stage 2        F0 B0 F1 B1 F2 B2 F3 B3

In flight: a micro-batch is in flight on a stage from the start of its forward until its
backward ends (its activations are held). Stage s of p (counting from 0) holds at most
``min(p - s, m)`` in flight: its warm-up forwards plus the one the steady state forwards before
each backward. ``max_in_flight`` counts it from the events a schedule records, and
``bubble_fraction`` measures the idle time that (p - 1) / m predicts.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from megatron.parallel.pipeline.p2p import (
    ActivationSpec,
    PipelineGroup,
    recv_backward,
    recv_forward,
    send_backward,
    send_backward_recv_forward,
    send_forward,
    send_forward_recv_backward,
)

LossScale = Callable[[Tensor], Tensor]
Chunk = Callable[[Tensor | None, Any], Tensor]  # (hidden, batch) -> activation or loss
# Called with (chunk, micro-batch) just before that backward runs: e.g. to let the data-parallel
# gradient sync start on each chunk's last backward of the step.
BackwardHook = Callable[[int, int], None]


@dataclass(frozen=True)
class Event:
    """One forward ("F") or backward ("B") of one micro-batch through one model chunk.

    ``start`` and ``end`` are ``time.perf_counter()`` seconds (one clock for every process on a
    machine), around the computation only: waiting for a peer is not part of an event.
    """

    kind: Literal["F", "B"]
    chunk: int
    microbatch: int
    start: float
    end: float


@dataclass
class ScheduleResult:
    """What a schedule returns on each stage."""

    # The last stage's per-micro-batch losses (detached, unscaled, in micro-batch order);
    # empty on every other stage, so the caller broadcasts or all-reduces them over the pipeline.
    losses: list[Tensor] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)  # this stage's, in execution order


def max_in_flight(events: list[Event]) -> int:
    """The most micro-batch chunks held at once: forwards begun whose backward has not ended."""
    held = most = 0
    for event in events:
        held += 1 if event.kind == "F" else -1
        most = max(most, held)
    return most


def bubble_fraction(events_per_stage: list[list[Event]]) -> float:
    """Idle time over busy time, summed over the stages of one pipeline (one schedule run).

    The step spans the first event's start to the last event's end on any stage; what a stage
    does not spend computing in it is idle. With forward and backward times equal on every
    stage and free communication, 1F1B gives (p - 1) / m and interleaved 1F1B (p - 1) / (m * v).
    Timestamps compare across processes of one machine only.
    """
    events = [e for stage in events_per_stage for e in stage]
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return (len(events_per_stage) * span - busy) / busy


class ChunkRunner:
    """Runs forwards and backwards of this stage's chunks and records them.

    Fetches micro-batches from the iterator when a chunk first needs them, and forgets each once
    this stage's last chunk has read it.
    """

    def __init__(
        self,
        chunks: list[Chunk],
        batches: Iterator[Any],
        pipe: PipelineGroup,
        scale_loss: LossScale | None,
        before_backward: BackwardHook | None = None,
    ):
        self.chunks, self.batches, self.pipe = chunks, batches, pipe
        self.scale_loss, self.before_backward = scale_loss, before_backward
        self.fetched: dict[int, Any] = {}  # micro-batch index -> micro-batch
        self.num_fetched = 0
        self.result = ScheduleResult()

    def is_last_chunk(self, chunk: int) -> bool:
        """True on the chunk that computes the loss: the last stage's last chunk."""
        return self.pipe.is_last and chunk == len(self.chunks) - 1

    def is_first_chunk(self, chunk: int) -> bool:
        """True on the chunk that reads the micro-batch: the first stage's first chunk."""
        return self.pipe.is_first and chunk == 0

    def forward(self, chunk: int, microbatch: int, hidden: Tensor | None) -> Tensor:
        """The chunk's output (the loss on the last chunk). A received ``hidden`` is made a leaf
        that requires grad, so backward leaves its gradient in ``hidden.grad``."""
        while self.num_fetched <= microbatch:
            self.fetched[self.num_fetched] = next(self.batches)
            self.num_fetched += 1
        if chunk == len(self.chunks) - 1:
            batch = self.fetched.pop(microbatch)
        else:
            batch = self.fetched[microbatch]
        if hidden is not None and torch.is_grad_enabled():
            hidden.requires_grad_()
        start = time.perf_counter()
        output = self.chunks[chunk](hidden, batch)
        self.result.events.append(Event("F", chunk, microbatch, start, time.perf_counter()))
        if self.is_last_chunk(chunk):
            self.result.losses.append(output.detach())
        return output

    def backward(
        self,
        chunk: int,
        microbatch: int,
        hidden: Tensor | None,
        output: Tensor,
        output_grad: Tensor | None,
    ) -> Tensor | None:
        """Backpropagate one forward; return the gradient of its input (None on the first chunk).

        ``output_grad`` is None on the last chunk, whose output is the loss.
        """
        if self.before_backward is not None:
            self.before_backward(chunk, microbatch)
        start = time.perf_counter()
        if output_grad is None:
            loss = output if self.scale_loss is None else self.scale_loss(output)
            torch.autograd.backward(loss)
        else:
            torch.autograd.backward(output, grad_tensors=output_grad)
        self.result.events.append(Event("B", chunk, microbatch, start, time.perf_counter()))
        return None if hidden is None else hidden.grad


def one_f_one_b(
    chunk: Chunk,
    batches: Iterator[Any],
    num_microbatches: int,
    pipe: PipelineGroup,
    spec: ActivationSpec,
    scale_loss: LossScale | None = None,
    forward_only: bool = False,
    before_backward: BackwardHook | None = None,
) -> ScheduleResult:
    """Run ``num_microbatches`` through this stage's ``chunk`` in the 1F1B order.

    ``forward_only`` (evaluation): every micro-batch is a warm-up forward, under ``no_grad``, and
    nothing runs backward. Every stage reads ``num_microbatches`` items from ``batches``.
    ``before_backward(chunk, microbatch)`` runs just before each backward.
    """
    run = ChunkRunner([chunk], batches, pipe, scale_loss, before_backward)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        return _one_f_one_b(run, num_microbatches, pipe, spec, forward_only)


def _one_f_one_b(run: ChunkRunner, m, pipe, spec, forward_only) -> ScheduleResult:
    warmup = m if forward_only else min(pipe.size - pipe.rank - 1, m)
    steady = m - warmup
    in_flight: deque[tuple[Tensor | None, Tensor]] = deque()  # (input, output), oldest first

    # Warm-up: forwards only, each output sent on as soon as it exists.
    for microbatch in range(warmup):
        hidden = recv_forward(pipe, spec)
        output = run.forward(0, microbatch, hidden)
        send_forward(pipe, spec, output)
        if not forward_only:
            in_flight.append((hidden, output))
    if forward_only:
        return run.result

    # Steady state: one forward, then the backward of the oldest micro-batch in flight. Each
    # send is paired with the receive that follows it, in one exchange (see p2p).
    hidden = recv_forward(pipe, spec) if steady else None
    for i in range(steady):
        output = run.forward(0, warmup + i, hidden)
        output_grad = send_forward_recv_backward(pipe, spec, output)
        in_flight.append((hidden, output))
        input_grad = run.backward(0, i, *in_flight.popleft(), output_grad)
        if i == steady - 1:
            send_backward(pipe, spec, input_grad)
        else:
            hidden = send_backward_recv_forward(pipe, spec, input_grad)

    # Cool-down: the backwards of the warm-up micro-batches.
    for microbatch in range(steady, m):
        output_grad = recv_backward(pipe, spec)
        input_grad = run.backward(0, microbatch, *in_flight.popleft(), output_grad)
        send_backward(pipe, spec, input_grad)
    return run.result
