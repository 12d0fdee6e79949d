"""One pipeline stage inside the training loop: its model chunks as the schedules call them, the
step's micro-batches through 1F1B (or interleaved 1F1B), and the tied embedding's gradient.

The entrypoint's ``forward_step(model, batch)`` runs unchanged on every chunk: it is handed a
``ChunkView`` of the stage's model that passes the received activation and the chunk index on
to the model, and says through ``computes_loss`` whether this chunk ends in the loss (the last
stage's last chunk). There forward_step returns its loss sums, which the loop's ``loss_of`` turns
into the micro-batch's loss and metrics; on every other chunk the activation for the next stage.

Metrics exist on the last stage only. Every stage returns one value per metric name (zeros
before the last stage), so the loop's world all-reduce has the same length everywhere and sums
exactly the last stage's values; the names are sent from the last stage once per kind of run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron.config.model import ModelConfig
from megatron.parallel.pipeline.interleaved import interleaved_one_f_one_b
from megatron.parallel.pipeline.p2p import ActivationSpec
from megatron.parallel.pipeline.schedules import (
    BackwardHook,
    LossScale,
    ScheduleResult,
    one_f_one_b,
)
from megatron.parallel.state import ParallelState

# As megatron.training.loop's (which imports this module): the loop's batch, forward_step, and
# loss_of (a micro-batch's loss and metrics from forward_step's loss sums).
Batch = dict[str, Tensor]
ForwardStep = Callable[[Any, Batch], Any]
LossOf = Callable[[Any], tuple[Tensor, dict[str, Tensor]]]


class ChunkView:
    """The stage's model as model chunk ``chunk`` sees it: calls get ``hidden`` (the activation
    from the previous stage, None where the chunk reads the batch) and ``chunk`` added; every
    other attribute (``training``, ``binary_task``, ...) is the model's."""

    def __init__(self, model: nn.Module, chunk: int, hidden: Tensor | None, computes_loss: bool):
        self.model, self.chunk, self.hidden = model, chunk, hidden
        self.computes_loss = computes_loss

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, hidden=self.hidden, chunk=self.chunk, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def activation_spec(
    cfg: ModelConfig,
    micro_batch_size: int,
    state: ParallelState,
    sequence_parallel: bool,
    dtype: torch.dtype,
) -> ActivationSpec:
    """What crosses a stage boundary: [micro_batch, seq / cp (/ tp with sequence parallelism),
    hidden] in the model's dtype."""
    seq = cfg.seq_length // state.cp_size
    seq = seq // state.tp_size if sequence_parallel else seq
    return ActivationSpec((micro_batch_size, seq, cfg.hidden_size), dtype, state.device)


def allreduce_tied_grads(model: nn.Module, state: ParallelState) -> None:
    """Sum the gradients of the tied word embedding's two copies (first and last stage), in
    place in ``main_grad`` (else ``.grad``), so both copies take the same step. Call after the
    schedule and before the DP sync: the DP shards of the two stages' buffers differ."""
    if state.embedding_group is None:
        return
    for param in model.parameters():
        if getattr(param, "pipeline_tied", False):
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            dist.all_reduce(grad, group=state.embedding_group)


class PipelineStage:
    """Runs micro-batches through this stage's chunks with the pipeline schedule."""

    def __init__(
        self,
        model: nn.Module,
        forward_step: ForwardStep,
        state: ParallelState,
        spec: ActivationSpec,
    ):
        self.model, self.forward_step, self.state, self.spec = model, forward_step, state, spec
        self.num_chunks = model.num_chunks
        self.names: dict[bool, list[str]] = {}  # metric names per kind of run (forward_only)

    def _chunk(self, chunk: int, loss_of: LossOf, metrics: list[dict[str, Tensor]]) -> Callable:
        """Chunk ``chunk`` as the schedules call it: ``(hidden, batch) -> output``; a chunk that
        computes the loss returns ``loss_of`` its loss sums, and their metrics go into
        ``metrics``."""
        computes_loss = self.state.is_last_stage and chunk == self.num_chunks - 1

        def run(hidden: Tensor | None, batch: Batch) -> Tensor:
            output = self.forward_step(ChunkView(self.model, chunk, hidden, computes_loss), batch)
            if not computes_loss:
                return output
            loss, values = loss_of(output)
            metrics.append(values)
            return loss

        return run

    def run(
        self,
        batches: Iterator[Batch],
        num_micro: int,
        loss_of: LossOf,
        scale_loss: LossScale | None = None,
        before_backward: BackwardHook | None = None,
        forward_only: bool = False,
    ) -> tuple[dict[str, Tensor], ScheduleResult]:
        """``num_micro`` micro-batches from ``batches`` (on the device), forward and backward
        (backpropagating ``scale_loss(loss_of(loss sums))``, calling ``before_backward(chunk,
        microbatch)`` before each backward) or ``forward_only``: the metrics summed over them
        (zeros before the last stage), and the schedule's record."""
        metrics: list[dict[str, Tensor]] = []
        chunks = [self._chunk(c, loss_of, metrics) for c in range(self.num_chunks)]
        pipe = self.state.pipeline
        args = (batches, num_micro, pipe, self.spec, scale_loss, forward_only, before_backward)
        if self.num_chunks > 1:
            result = interleaved_one_f_one_b(chunks, *args)
        else:
            result = one_f_one_b(chunks[0], *args)
        names = self._metric_names(metrics, forward_only)
        sums = {name: torch.zeros((), device=self.state.device) for name in names}
        for values in metrics:
            for name, value in values.items():
                sums[name] = sums[name] + value.detach().float()
        return sums, result

    def _metric_names(self, metrics: list[dict[str, Tensor]], forward_only: bool) -> list[str]:
        """The last stage's metric names, known to every stage of the pipeline; the first run
        of each kind sends them (one host sync)."""
        if forward_only not in self.names:
            names = [list(metrics[0])] if metrics else [None]
            last = self.state.pp_ranks[-1]
            dist.broadcast_object_list(names, src=last, group=self.state.pp_group)
            self.names[forward_only] = names[0]
        return self.names[forward_only]
