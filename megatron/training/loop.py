"""The iteration loop: micro-batches -> forward/backward -> DP gradient sync -> unscale/check/
clip/step (with the metrics and exit flags in its all-reduce, and the iteration's one host sync at
its end) -> LR step -> evaluate -> log -> save.

``megatron.training.pretrain`` builds everything this loop needs and hands it over; nothing
here reads the launcher or builds a model.

With pipeline parallelism the step's micro-batches go through ``PipelineStage`` (1F1B, or
interleaved 1F1B with virtual stages) instead of one forward/backward each; the loss, metrics and
skip agreement come from the last stage, through the same world all-reduce.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron.checkpoint.async_save import Checkpointer
from megatron.checkpoint.train_state import LogWindow, Progress, TrainState
from megatron.config import skip_list
from megatron.config.schema import Config
from megatron.launch.heartbeat import Heartbeat
from megatron.logging import log
from megatron.models.moe.stats import routing_stats
from megatron.optim.optimizer import StepResult
from megatron.parallel.context_batch import split_batch
from megatron.parallel.data_parallel import DataParallel
from megatron.parallel.pipeline.stage import PipelineStage, allreduce_tied_grads
from megatron.parallel.sequence_parallel import allreduce_sequence_parallel_grads
from megatron.parallel.state import ParallelState
from megatron.training.exit import ExitPolicy
from megatron.training.metrics import MetricsLogger, gather_memory, memory_mb
from megatron.training.profiling import Profiling
from megatron.training.reduction import LossSums, StepReduction, micro_batch_loss
from megatron.training.source_losses import SourceLosses
from megatron.training.spike_guard import judge, roll_back
from megatron.training.stragglers import PhaseTimes, Straggler, find_stragglers

Batch = dict[str, Tensor]
# forward_step(model, batch) -> each loss's sum and count (``LossSums``), which the library
# normalises; on a pipeline chunk whose ``model.computes_loss`` is False: the activation for the
# next stage.
ForwardStep = Callable[[nn.Module, Batch], LossSums | Tensor]
# The training model (in eval mode) -> its downstream-task scores, ``eval/<task>/<metric>``; a
# collective over every rank.
Downstream = Callable[[nn.Module, ParallelState], dict[str, float]] | None
# The train and validation streams from where a progress says (after a rollback).
Reopen = Callable[[Progress], tuple[Iterator[Batch], Iterator[Batch] | None]]


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@dataclass
class TrainLoop:
    """The iteration loop and its bookkeeping; one instance per run. It trains ``train``, the
    state its checkpoints save."""

    cfg: Config
    state: ParallelState
    train: TrainState
    ddp: DataParallel
    metrics: MetricsLogger
    forward_step: ForwardStep
    num_micro: int
    vocab_size: int
    heartbeat: Heartbeat | None = None  # told the iteration, to say where a lost rank stopped
    stage: PipelineStage | None = None  # with pipeline parallelism: runs the schedule
    checkpointer: Checkpointer | None = field(default=None, init=False, repr=False)
    downstream: Downstream = None  # training.eval_tasks, every eval_tasks_interval iterations
    reopen: Reopen | None = None  # with the spike guard: the streams after a rollback
    train_samples: int | None = None  # the train split's size: skipped batches come out of it
    sources: SourceLosses | None = None  # a blend's: the loss of each source
    times: PhaseTimes = field(init=False, repr=False)
    hosts: list[str] = field(default_factory=list, init=False, repr=False)
    stages: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.times = PhaseTimes(self.state.rank)

    def logs_at(self, iteration: int) -> bool:
        t = self.cfg.training
        return iteration % self.cfg.logging.log_interval == 0 or iteration == t.train_iters

    def _for_backward(self, loss: Tensor | float) -> Tensor | float:
        """A micro-batch's loss as backward takes it: divided by the micro-batches (their mean)
        and times CP (exact at 1), since the gradient sync averages over DP x CP where the CP
        ranks' shares of a sample must add up; loss-scaled with fp16. Of 1.0: that factor."""
        return self.train.optimizer.scale_loss(loss * self.state.cp_size / self.num_micro)

    def _next_batch(self, data: Iterator[Batch]) -> Batch:
        """The next micro-batch on the device: this rank's share of it (``split_batch``)."""
        with self.times.data():
            batch = to_device(next(data), self.state.device)
            return split_batch(batch, self.state, self.cfg.model.type)

    def train_step(
        self, data: Iterator[Batch], policy: ExitPolicy
    ) -> tuple[StepResult, dict[str, float], dict[str, float], list[float]]:
        """One optimizer step over ``num_micro`` micro-batches: its result, the metrics averaged
        over the micro-batches and the replicas, this rank's memory figures when this step is
        logged ({} otherwise), and the exit flags summed over the world.

        Nothing here waits for the device but the optimizer's one host sync, after the step's
        last kernel; the metrics and the flags ride in the step's all-reduce and that sync.
        """
        self.ddp.zero_grad_buffer()
        step = StepReduction(self.state)
        routing = routing_stats(self.train.model)
        if self.sources is not None:
            self.sources.reset()
        if routing is not None:
            routing.reset()
            # The MoE losses' gradients: what backward multiplies the step's loss by.
            routing.backward_scale = self._for_backward(1.0)
        times = self.times
        if self.stage is not None:
            data_before = times.seconds["data"]
            with times.phase("compute"):
                step.add(self._pipeline_step(data), self.num_micro)
            # The schedule draws its micro-batches as it goes: their wait is data, not compute.
            times.seconds["compute"] -= times.seconds["data"] - data_before
        else:
            for i in range(self.num_micro):
                batch = self._next_batch(data)
                # Only the last micro-batch's backward all-reduces gradients over DP.
                last = i == self.num_micro - 1
                with times.phase("compute"):
                    with contextlib.nullcontext() if last else self.ddp.no_sync():
                        loss, values = micro_batch_loss(self.forward_step(self.train.model, batch))
                        self._for_backward(loss).backward()
                step.add(values)
        with times.phase("grad_sync"):
            self.ddp.finish_grad_sync()  # launches the buckets not launched yet, waits for all
            # Sequence parallelism: LayerNorm and row-parallel-bias gradients cover this rank's
            # slice of the sequence only (QK norms': its heads); one all-reduce over TP sums them
            # before clipping. Else no parameter is flagged: skip the scan.
            if self.cfg.parallel.sequence_parallel or self.cfg.model.qk_layernorm:
                allreduce_sequence_parallel_grads(self.train.model, self.state.tp_group)
        # A logged step's memory: host-side reads, after backward and before the update.
        logged = self.logs_at(self.train.progress.iteration + 1)
        memory = memory_mb(self.state.device, self.train.optimizer.state_bytes()) if logged else {}
        # The iteration's one host sync, after the step's last kernel: the metrics and this
        # rank's exit flags are summed over the world in the step's own all-reduce.
        extras = [x.pack() for x in (routing, self.sources) if x is not None]
        extra = torch.cat(extras) if extras else None
        with times.phase("optimizer"):
            result = self.train.optimizer.step(step.pack(policy.local_flags(), extra))
        times.steps += 1
        means, flags, figures = step.unpack(result.sums)
        if self.sources is not None:  # the figures' tail: none of them before every source
            figures, mine = figures[: -self.sources.size], figures[-self.sources.size :]
            means.update(self.sources.finish(mine))
        if routing is not None:  # the routing metrics, and the expert biases moved by them
            means.update(routing.finish(figures, self.num_micro, self.state.replicas))
        return result, means, memory, flags

    def _pipeline_step(self, data: Iterator[Batch]) -> dict[str, Tensor]:
        """The step's forwards and backwards through the pipeline schedule; the metrics summed
        over its micro-batches (zeros before the last stage).

        Each model chunk's last backward of the step all-reduces its gradients over DP while
        the schedule goes on; the bucket holding the tied word embedding waits until its two
        copies (first and last stage) have summed their gradients, then ``finish_grad_sync``
        launches it.
        """
        batches = (self._next_batch(data) for _ in range(self.num_micro))

        def sync_last(chunk: int, microbatch: int) -> None:
            self.ddp.sync_backward(microbatch == self.num_micro - 1)

        with self.ddp.no_sync():
            sums, _ = self.stage.run(
                batches, self.num_micro, micro_batch_loss, self._for_backward, sync_last
            )
        allreduce_tied_grads(self.train.model, self.state)
        return sums

    @torch.no_grad()
    def evaluate(
        self, data: Iterator[Batch], iters: int, policy: ExitPolicy
    ) -> tuple[dict[str, float], list[float]]:
        """``iters`` steps of evaluation on ``data``: the metrics averaged over them and the
        replicas, and the exit flags summed over the world (agreed after the evaluation, so a
        signal that came during it counts now); one all-reduce and one host sync."""
        self.train.model.eval()
        step = StepReduction(self.state)
        if self.sources is not None:
            self.sources.reset()
        if self.stage is not None:
            # The forward-only schedule, one step's micro-batches at a time.
            for _ in range(iters):
                batches = (self._next_batch(data) for _ in range(self.num_micro))
                sums, _ = self.stage.run(
                    batches, self.num_micro, micro_batch_loss, forward_only=True
                )
                step.add(sums, self.num_micro)
        else:
            for _ in range(iters * self.num_micro):
                batch = self._next_batch(data)
                step.add(micro_batch_loss(self.forward_step(self.train.model, batch))[1])
        self.train.model.train()
        local = step.pack(
            policy.local_flags(), None if self.sources is None else self.sources.pack()
        )
        if self.state.world_size > 1:
            # The means over the replicas, and the flags of every rank, so that all stop together.
            dist.all_reduce(local)
        # The evaluation's one host sync: its means are logged now.
        means, flags, figures = step.unpack(local.tolist())
        if self.sources is not None:
            losses = self.sources.finish(figures).items()
            means.update({name: value for name, value in losses if value is not None})
        return means, flags

    def _stragglers(self, per_rank: dict[str, list[float]], step_ms: float) -> list[Straggler]:
        """The ranks ``find_stragglers`` names in this window's phase times (none without
        logging.straggler_threshold, nor in this process's first window, whose first step does
        one-off work: lazy initialisation, allocator warm-up); the first call learns every rank's
        host and stage."""
        threshold = self.cfg.logging.straggler_threshold
        if threshold is None:
            return []
        if not self.hosts:
            mine = (socket.gethostname(), self.state.pp_rank)
            every = [mine] * self.state.world_size
            if self.state.world_size > 1:
                dist.all_gather_object(every, mine, group=self.state.host_group)
            self.hosts = [host for host, _ in every]
            self.stages = [stage for _, stage in every]
            return []
        # A phase must also cost 5% of the step more than its median to count.
        return find_stragglers(per_rank, self.stages, self.hosts, threshold, 0.05 * step_ms)

    def save(self) -> None:
        """A checkpoint of this iteration under checkpoint.save (if set); with
        checkpoint.async_save it is written in the background while training goes on."""
        ckpt = self.cfg.checkpoint
        if ckpt.save:
            if self.checkpointer is None:
                self.checkpointer = Checkpointer(ckpt.async_save, self.metrics.record)
            self.checkpointer.save(ckpt.save, self.train, self.cfg, self.state, self.vocab_size)

    def run(
        self,
        train_iter: Iterator[Batch],
        valid_iter: Iterator[Batch] | None,
        test_iter: Iterator[Batch] | None,
        policy: ExitPolicy,
    ) -> int:
        """Iterate until train_iters or an agreed exit; the exit code. Reaching train_iters,
        the test split is evaluated once (training.test_iters batches).

        Every exit (the end, a signal, the NaN stop, an exception) first waits for a save still
        being written in the background; that save's error, if any, is raised here.
        """
        profiling = Profiling(self.cfg, self.state.rank, self.state.device)
        try:
            code = self._iterate(train_iter, valid_iter, test_iter, policy, profiling)
            profiling.close()  # a window the run ended inside is written now
            self.ddp.wait_param_gather()  # the last step's, with parallel.overlap_param_gather
            return code
        finally:
            if self.checkpointer is not None:
                self.checkpointer.wait()

    def _iterate(
        self,
        train_iter: Iterator[Batch],
        valid_iter: Iterator[Batch] | None,
        test_iter: Iterator[Batch] | None,
        policy: ExitPolicy,
        profiling: Profiling,
    ) -> int:
        cfg, t = self.cfg, self.cfg.training
        self.train.model.train()
        while (p := self.train.progress).iteration < t.train_iters:
            gbs = t.global_batch_size
            batch = skip_list.next_batch(p.consumed_train_samples, gbs, p.skip_batches)
            stream_end = p.consumed_train_samples % gbs + batch * gbs
            if self.train_samples is not None and stream_end > self.train_samples:
                log.error(
                    "the train split ran out at iteration %d: its %d samples are used, %d batches "
                    "of them skipped (%s); stopping early",
                    p.iteration + 1, self.train_samples, skip_list.count(p.skip_batches),
                    skip_list.describe(p.skip_batches),
                )  # fmt: skip
                self.save()
                return 0
            if self.heartbeat is not None:
                self.heartbeat.iteration = p.iteration + 1  # published with its next beat
            profiling.step(p.iteration + 1)
            start = time.perf_counter()
            result, means, memory, flags = self.train_step(train_iter, policy)
            # The step ended in a host sync after its last kernel (the optimizer's copy-back), so
            # this is the device's time too (all-gathers left running by overlap_param_gather
            # count in the next); evaluation time is not iteration time.
            seconds = time.perf_counter() - start
            p.iteration += 1
            p.consumed_train_samples = stream_end
            spike = judge(t, p, means, batch)
            if spike is not None:
                if self.checkpointer is not None:
                    self.checkpointer.wait()  # a checkpoint still being written may be the one
                self.ddp.wait_param_gather()
                code = roll_back(spike, cfg, self.train, self.state, self.vocab_size,
                                 self.metrics.record, self.save)  # fmt: skip
                if code is not None:
                    return code
                train_iter, valid_iter = self.reopen(self.train.progress)
                continue
            nan = not result.updated and cfg.precision.dtype != "fp16"
            nan = nan and not math.isfinite(result.grad_norm)
            if result.updated:
                self.train.optimizer.set_lr(self.train.schedule.step())
                p.consecutive_skips = 0
            else:
                p.skipped_iters += 1
                p.consecutive_skips += 1
                p.nan_iters += nan
            evaluated = None
            if valid_iter is not None and t.eval_iters and p.iteration % t.eval_interval == 0:
                # Its flags, agreed after it, supersede the step's.
                evaluated, flags = self.evaluate(valid_iter, t.eval_iters, policy)
                p.consumed_valid_samples += t.eval_iters * t.global_batch_size
            scores = None
            every = t.eval_tasks_interval or t.eval_interval
            if self.downstream is not None and p.iteration % every == 0:
                self.train.model.eval()
                scores = self.downstream(self.train.model, self.state)
                self.train.model.train()
            stop = policy.reason(p.iteration, flags)
            p.window.add(means, seconds, not result.updated, nan)

            if self.logs_at(p.iteration):
                phases = self.times.window_ms()
                every_rank = gather_memory({**memory, **phases}, self.state)
                per_rank = {name: every_rank.pop(name) for name in phases}
                slow = self._stragglers(per_rank, 1000 * p.window.seconds / p.window.steps)
                lr, samples = self.train.optimizer.lr, p.consumed_train_samples
                self.metrics.training(
                    p.iteration, samples, p.window, lr, result, every_rank, per_rank, slow
                )
                p.window = LogWindow()
            if evaluated is not None:
                self.metrics.validation(p.iteration, p.consumed_train_samples, evaluated)
            if scores:
                self.metrics.downstream(p.iteration, p.consumed_train_samples, scores)

            if p.consecutive_skips >= t.max_consecutive_nan and cfg.precision.dtype != "fp16":
                log.error(
                    "stopping: %d consecutive steps with non-finite gradients, the last at "
                    "iteration %d; the checkpoint holds the last good state",
                    p.consecutive_skips,
                    p.iteration,
                )
                self.save()
                return 3
            save_now = (
                cfg.checkpoint.save_interval and p.iteration % cfg.checkpoint.save_interval == 0
            )
            if save_now or stop or p.iteration == t.train_iters:
                self.save()
            if stop:
                log.info("exiting at iteration %d (%s)", p.iteration, stop)
                return 0
        if test_iter is not None:
            tested, _ = self.evaluate(test_iter, t.test_iters, policy)
            self.metrics.validation(p.iteration, p.consumed_train_samples, tested, "test")
        return 0
