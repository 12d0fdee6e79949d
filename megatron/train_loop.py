"""The iteration loop: micro-batches -> forward/backward -> DP gradient sync -> unscale/check/
clip/step (with the metrics and exit flags in its all-reduce, and the iteration's one host sync at
its end) -> LR step -> evaluate -> log -> save, and the ``Progress`` a checkpoint carries.

``megatron.training`` builds everything this loop needs and hands it over; nothing here reads the
launcher or builds a model.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron import checkpointing
from megatron.config import Config
from megatron.logging import LogWindow, MetricsLogger, log
from megatron.optim.lr_schedule import LRSchedule
from megatron.optim.optimizer import MixedPrecisionOptimizer, StepResult
from megatron.parallel.data_parallel import DataParallel
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState
from megatron.preemption import ExitPolicy

Batch = dict[str, Tensor]
# forward_step(model, batch) -> (loss to minimise, {metric name: detached scalar tensor})
ForwardStep = Callable[[nn.Module, Batch], tuple[Tensor, dict[str, Tensor]]]


@dataclass
class Progress:
    """Where the run stands; saved with every checkpoint (JSON)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iters: int = 0  # steps not applied: overflow or a non-finite gradient
    nan_iters: int = 0  # of those, the ones whose loss itself was not finite
    consecutive_skips: int = 0
    window: LogWindow = field(default_factory=LogWindow)  # iterations not logged yet

    @classmethod
    def restore(cls, saved: dict[str, Any]) -> Progress:
        """From load_checkpoint's dict; keys an older checkpoint lacks keep their defaults."""
        names = set(cls.__dataclass_fields__) - {"window"}
        counters = {k: v for k, v in saved.items() if k in names}
        return cls(**counters, window=LogWindow(**saved.get("window", {})))


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@dataclass
class TrainLoop:
    """The iteration loop and its bookkeeping; one instance per run."""

    cfg: Config
    state: ParallelState
    model: nn.Module
    ddp: DataParallel
    optimizer: MixedPrecisionOptimizer
    schedule: LRSchedule
    tracker: RNGTracker
    progress: Progress
    metrics: MetricsLogger
    forward_step: ForwardStep
    num_micro: int
    vocab_size: int

    def train_step(
        self, data: Iterator[Batch], policy: ExitPolicy
    ) -> tuple[StepResult, dict[str, float], list[float]]:
        """One optimizer step over ``num_micro`` micro-batches: its result, the metrics averaged
        over the micro-batches and DP, and the exit flags summed over the world.

        Nothing here waits for the device but the optimizer's one host sync, after the step's
        last kernel; the metrics and the flags ride in the step's all-reduce and that sync.
        """
        self.ddp.zero_grad_buffer()
        sums: dict[str, Tensor] = {}
        for i in range(self.num_micro):
            batch = to_device(next(data), self.state.device)
            # Only the last micro-batch's backward all-reduces gradients over DP.
            last = i == self.num_micro - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                loss, values = self.forward_step(self.model, batch)
                self.optimizer.scale_loss(loss / self.num_micro).backward()
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + value.detach().float()
        self.ddp.finish_grad_sync()  # waits for the buckets still in flight
        means = {k: v / self.num_micro for k, v in sums.items()}
        # The iteration's one host sync, after the step's last kernel: the metrics and this
        # rank's exit flags are summed over the world in the step's own all-reduce.
        result = self.optimizer.step(policy.contribution(means, self.state))
        return result, *policy.split_sums(list(sums), result.sums, self.state)

    @torch.no_grad()
    def evaluate(
        self, data: Iterator[Batch], iters: int, policy: ExitPolicy
    ) -> tuple[dict[str, float], list[float]]:
        """``iters`` steps of evaluation on ``data``: the metrics averaged over them and DP, and
        the exit flags summed over the world (agreed after the evaluation, so a signal that came
        during it counts now); one all-reduce and one host sync."""
        self.model.eval()
        sums: dict[str, Tensor] = {}
        for _ in range(iters * self.num_micro):
            batch = to_device(next(data), self.state.device)
            for name, value in self.forward_step(self.model, batch)[1].items():
                sums[name] = sums.get(name, 0.0) + value.float()
        self.model.train()
        count = iters * self.num_micro
        local = policy.contribution({k: v / count for k, v in sums.items()}, self.state)
        if self.state.world_size > 1:
            # The means over DP, and the flags of every rank, so that all stop together.
            dist.all_reduce(local)
        # The evaluation's one host sync: its means are logged now.
        return policy.split_sums(list(sums), local.tolist(), self.state)

    def save(self) -> None:
        """A checkpoint of this iteration under checkpoint.save (if set)."""
        if self.cfg.checkpoint.save:
            checkpointing.save_checkpoint(
                self.cfg.checkpoint.save,
                self.progress.iteration,
                self.model,
                self.optimizer,
                self.schedule,
                self.tracker,
                asdict(self.progress),
                self.cfg,
                self.state,
                self.vocab_size,
            )

    def run(
        self,
        train_iter: Iterator[Batch],
        valid_iter: Iterator[Batch] | None,
        test_iter: Iterator[Batch] | None,
        policy: ExitPolicy,
    ) -> int:
        """Iterate until train_iters or an agreed exit; the exit code. Reaching train_iters,
        the test split is evaluated once (training.test_iters batches)."""
        cfg, p, t = self.cfg, self.progress, self.cfg.training
        self.model.train()
        while p.iteration < t.train_iters:
            start = time.perf_counter()
            result, means, flags = self.train_step(train_iter, policy)
            # The step ended in a host sync after its last kernel (the optimizer's copy-back), so
            # this is the device's time too; evaluation time is not iteration time.
            seconds = time.perf_counter() - start
            p.iteration += 1
            p.consumed_train_samples += t.global_batch_size
            nan = not result.updated and cfg.precision.dtype != "fp16"
            nan = nan and not math.isfinite(result.grad_norm)
            if result.updated:
                self.optimizer.set_lr(self.schedule.step())
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
            stop = policy.reason(p.iteration, flags)
            p.window.add(means, seconds, not result.updated, nan)

            if p.iteration % cfg.logging.log_interval == 0 or p.iteration == t.train_iters:
                step = {
                    "learning rate": self.optimizer.lr,
                    "loss scale": result.loss_scale,
                    "grad norm": result.grad_norm,
                }
                self.metrics.training(p.iteration, p.consumed_train_samples, p.window, step)
                p.window = LogWindow()
            if evaluated is not None:
                self.metrics.validation(p.iteration, p.consumed_train_samples, evaluated)

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
