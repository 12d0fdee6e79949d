"""Interleaved 1F1B: each stage holds v model chunks, so the pipeline has p * v virtual stages.

Chunk c on stage s is virtual stage ``c * p + s``: for p = 2, v = 2 and 8 layers, stage 0 holds
layers 0-1 and 4-5, stage 1 layers 2-3 and 6-7. Activations go round the ring v times; the last
stage's chunk c feeds stage 0's chunk c + 1. The bubble (idle over busy time) shrinks from
(p - 1) / m to (p - 1) / (m * v), for v times the p2p traffic.

Each stage runs m * v forward units and as many backward units, numbered by virtual step k.
Micro-batches go through the chunks in groups of p (so m must be a multiple of p): forward
unit k is micro-batch ``(k // (p * v)) * p + k % p`` on chunk ``(k % (p * v)) // p``; backward
unit k is the same micro-batch on the chunks in reverse order. On stage s of p:

    warm-up    min((p - s - 1) * 2 + (v - 1) * p, m * v) forward units (all of them if m == p)
    steady     one forward unit, then one backward unit, each followed by its own exchange
    cool-down  the remaining backward units

In flight (as ``schedules``): stage s holds at most one more micro-batch chunk than its warm-up
count, m * v at most. The receive decisions follow Megatron-LM's interleaved schedule; the ones
that cross the ring's seam assume the ideal clock in which stage s runs its forward unit k at
tick k + s and its backward unit k at tick k + p - 1 - s.

Each steady tick posts two exchanges on every stage: the forward's (its output on, the next
input in), then the backward's (its input gradient back, the next gradient in). Both ends of
every link therefore post their transfers in the same order, which is the order NCCL matches by.

Waits are deferred (as Megatron-LM's overlap_p2p_comm): an exchange is started, not waited on;
a received activation is waited for just before the forward that reads it, a gradient just
before its backward, and sends two exchanges later (the same kind's exchange of the next tick)
or at the end of the schedule (the exchange holds each sent tensor until then). Waiting for
everything at each exchange would stall a stage on the next gradient, or on its neighbour's
receive, although its next forward is ready. A stage waits only for a tensor its next unit
reads, which its neighbour produces earlier in the schedule's dependency order, or for sends its
neighbour posted the receives of a tick before, so no deadlock can arise.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from megatron.parallel.pipeline.p2p import (
    ActivationSpec,
    PendingExchange,
    PipelineGroup,
    start_exchange,
)
from megatron.parallel.pipeline.schedules import (
    BackwardHook,
    Chunk,
    ChunkRunner,
    LossScale,
    ScheduleResult,
)

# A new exchange first waits for the sends of the exchange this many before it: late enough that
# they are complete by then, early enough to bound the sent tensors held.
SEND_LAG = 2


def interleaved_one_f_one_b(
    chunks: list[Chunk],
    batches: Iterator[Any],
    num_microbatches: int,
    pipe: PipelineGroup,
    spec: ActivationSpec,
    scale_loss: LossScale | None = None,
    forward_only: bool = False,
    before_backward: BackwardHook | None = None,
) -> ScheduleResult:
    """Run ``num_microbatches`` through this stage's ``chunks`` (virtual stages c * p + s); the
    other arguments as ``one_f_one_b``'s (``forward_only``: every unit is a warm-up forward)."""
    if pipe.size < 2:
        raise ValueError("an interleaved pipeline needs at least 2 stages")
    if num_microbatches % pipe.size:
        raise ValueError(
            f"{num_microbatches} micro-batches is not a multiple of the pipeline size {pipe.size}"
        )
    runner = ChunkRunner(chunks, batches, pipe, scale_loss, before_backward)
    schedule = _Interleaved(runner, num_microbatches, pipe, spec)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        return schedule.run(forward_only)


class _Interleaved:
    """The schedule's bookkeeping: per chunk, the inputs being received and the units in flight;
    every exchange started, for its sends to be waited on at the end."""

    def __init__(self, runner: ChunkRunner, m: int, pipe: PipelineGroup, spec: ActivationSpec):
        chunks = runner.chunks
        self.p, self.v, self.m = pipe.size, len(chunks), m
        self.pipe, self.spec = pipe, spec
        self.runner = runner
        # Exchanges bringing a chunk's next inputs / output gradients, oldest first.
        self.inputs: list[deque[PendingExchange]] = [deque() for _ in chunks]
        self.grads: list[deque[PendingExchange]] = [deque() for _ in chunks]
        self.exchanges: list[PendingExchange] = []
        self.in_flight: list[deque[tuple[Tensor | None, Tensor]]] = [deque() for _ in chunks]

    def chunk_of(self, k: int, forward: bool) -> int:
        chunk = (k % (self.p * self.v)) // self.p
        return chunk if forward else self.v - 1 - chunk

    def microbatch_of(self, k: int) -> int:
        return (k // (self.p * self.v)) * self.p + k % self.p

    def forward(self, k: int, keep: bool) -> Tensor | None:
        """Forward unit k; returns what goes to the next stage (None after the last chunk)."""
        chunk = self.chunk_of(k, forward=True)
        first = self.runner.is_first_chunk(chunk)
        hidden = None if first else self.inputs[chunk].popleft().activation()
        output = self.runner.forward(chunk, self.microbatch_of(k), hidden)
        if keep:
            self.in_flight[chunk].append((hidden, output))
        return None if self.runner.is_last_chunk(chunk) else output

    def backward(self, k: int) -> Tensor | None:
        """Backward unit k; returns what goes to the previous stage (None on the first chunk)."""
        chunk = self.chunk_of(k, forward=False)
        last = self.runner.is_last_chunk(chunk)
        output_grad = None if last else self.grads[chunk].popleft().gradient()
        hidden, output = self.in_flight[chunk].popleft()
        input_grad = self.runner.backward(chunk, self.microbatch_of(k), hidden, output, output_grad)
        return None if self.runner.is_first_chunk(chunk) else input_grad

    def start(
        self,
        send_next: Tensor | None = None,
        send_prev: Tensor | None = None,
        input_chunk: int | None = None,
        grad_chunk: int | None = None,
    ) -> None:
        """Start one exchange: send what is given, and receive the next input of
        ``input_chunk`` and the next output gradient of ``grad_chunk`` where given.

        Sends of the exchange before last (in the steady state, the same kind's exchange a tick
        earlier) are waited on first, so a stage holds the tensors of two exchanges' sends at
        most; by then their receivers have long posted, so this rarely blocks.
        """
        if len(self.exchanges) >= SEND_LAG:
            self.exchanges[-SEND_LAG].wait_sends()
        recv_prev, recv_next = input_chunk is not None, grad_chunk is not None
        pending = start_exchange(self.pipe, self.spec, send_next, send_prev, recv_prev, recv_next)
        self.exchanges.append(pending)
        if recv_prev:
            self.inputs[input_chunk].append(pending)
        if recv_next:
            self.grads[grad_chunk].append(pending)

    def finish(self) -> ScheduleResult:
        """Wait for the sends still pending: the schedule ends with every transfer complete."""
        for pending in self.exchanges[-SEND_LAG:]:
            pending.wait_sends()
        return self.runner.result

    def run(self, forward_only: bool) -> ScheduleResult:
        p, v, s, pipe = self.p, self.v, self.pipe.rank, self.pipe
        total = self.m * v
        if forward_only or self.m == p:
            warmup = total
        else:
            warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
        steady = 0 if forward_only else total - warmup

        # Warm-up: forward units only. Each exchange sends the output on and receives the
        # input of the next unit, unless that unit reads the micro-batch itself (chunk 0 of
        # stage 0). The last one also receives the first gradient when a steady state follows.
        if not pipe.is_first:
            self.start(input_chunk=0)
        for k in range(warmup):
            output = self.forward(k, keep=not forward_only)
            next_chunk = self.chunk_of(k + 1, forward=True)
            recv_prev = k + 1 < total and not (pipe.is_first and next_chunk == 0)
            recv_next = k == warmup - 1 and steady > 0 and not pipe.is_last
            self.start(
                send_next=output,
                input_chunk=next_chunk if recv_prev else None,
                grad_chunk=v - 1 if recv_next else None,
            )
        if forward_only:
            return self.finish()

        # Steady state: forward unit warmup + i, then backward unit i, each followed by its own
        # exchange. Sending the forward's output before the backward runs is what lets the next
        # stage start its forward a backward's time sooner (Megatron-LM's overlap_p2p_comm):
        # with one exchange per pair, a stage whose next input crosses the seam waits for the
        # sender's backward as well as its forward.
        for i in range(steady):
            k_forward = warmup + i
            output = self.forward(k_forward, keep=True)
            if pipe.is_first:
                # What arrives comes from the last stage, whose forward unit at this tick is
                # k_forward - (p - 1); its last chunk's output is the loss, not sent.
                sender_chunk = self.chunk_of(k_forward - (p - 1), forward=True)
                recv_prev, next_chunk = sender_chunk != v - 1, sender_chunk + 1
            else:
                recv_prev, next_chunk = True, self.chunk_of(k_forward + 1, forward=True)
            recv_prev = recv_prev and i < steady - 1  # the last forward unit has run
            self.start(send_next=output, input_chunk=next_chunk if recv_prev else None)

            input_grad = self.backward(i)
            if pipe.is_last:
                # Gradients come from stage 0, whose backward unit at this tick is i - (p - 1);
                # its first chunk has no input, so sends none.
                sender_chunk = self.chunk_of(i - (p - 1), forward=False)
                recv_next, grad_chunk = sender_chunk != 0, sender_chunk - 1
            else:
                recv_next, grad_chunk = True, self.chunk_of(i + 1, forward=False)
            self.start(send_prev=input_grad, grad_chunk=grad_chunk if recv_next else None)

        # Cool-down: the remaining backward units, each receiving the next unit's gradient
        # (none for the last stage's last chunk, whose gradient starts from the loss).
        if steady == 0 and not pipe.is_last:
            self.start(grad_chunk=v - 1)
        for k in range(steady, total):
            input_grad = self.backward(k)
            next_chunk = self.chunk_of(k + 1, forward=False)
            recv_next = k + 1 < total and not (pipe.is_last and next_chunk == v - 1)
            self.start(send_prev=input_grad, grad_chunk=next_chunk if recv_next else None)
        return self.finish()
