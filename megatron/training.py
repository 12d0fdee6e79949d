"""The pretraining loop shared by GPT and BERT.

``pretrain`` validates the config before any process starts work, builds the process groups,
tokenizer, model, optimizer and data, then runs: micro-batches -> forward/backward -> DP gradient
sync -> unscale/check/clip/step -> LR step -> log / evaluate / save, until ``train_iters``
(or ``train_samples``), ``exit_interval``, ``exit_duration_in_mins`` or the exit signal.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron import checkpointing
from megatron.config import Config, parse_args, to_yaml, validate
from megatron.data.loader import build_loader
from megatron.data.tokenizers import Tokenizer, build_tokenizer
from megatron.errors import ConfigError
from megatron.flops import flops_per_iteration
from megatron.logging import (
    MetricsLogger,
    format_line,
    log,
    peak_memory_mb,
    perplexity,
    setup_logging,
)
from megatron.optim.lr_schedule import LRSchedule
from megatron.optim.optimizer import MixedPrecisionOptimizer, build_optimizer
from megatron.parallel import state as parallel_state
from megatron.parallel.data_parallel import DataParallel
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState
from megatron.preemption import ExitSignal

Batch = dict[str, Tensor]
ModelProvider = Callable[[Config, int, int, ParallelState, RNGTracker], nn.Module]
DatasetsProvider = Callable[[Config, Tokenizer, tuple[int, int, int]], tuple[Any, Any, Any]]
# forward_step(model, batch) -> (loss to minimise, {metric name: detached scalar tensor})
ForwardStep = Callable[[nn.Module, Batch], tuple[Tensor, dict[str, Tensor]]]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Progress:
    """Where the run stands; saved with every checkpoint (JSON)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iters: int = 0  # steps not applied: overflow or a non-finite gradient
    nan_iters: int = 0  # of those, the ones whose loss itself was not finite
    consecutive_skips: int = 0


def main(
    argv: list[str],
    description: str,
    model_provider: ModelProvider,
    datasets_provider: DatasetsProvider,
    forward_step: ForwardStep,
) -> int:
    """Entry point: parse, validate, train; a user mistake is one line on rank 0 and exit 2."""
    try:
        cfg, args = parse_args(argv, description)
        if args.dry_run:
            from megatron.dry_run import dry_run

            return dry_run(cfg, args)
        return pretrain(cfg, model_provider, datasets_provider, forward_step)
    except ConfigError as err:
        if int(parallel_state.launcher_env()["RANK"]) == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2


def pretrain(
    cfg: Config,
    model_provider: ModelProvider,
    datasets_provider: DatasetsProvider,
    forward_step: ForwardStep,
) -> int:
    """Train as ``cfg`` says; returns the process exit code."""
    world_size = int(parallel_state.launcher_env()["WORLD_SIZE"])
    validate(cfg, world_size)  # every user mistake surfaces here, before any collective
    derived = cfg.derived(world_size)
    start_time = time.time()
    state = parallel_state.initialize(
        cfg.parallel.tensor_parallel_size, cfg.parallel.timeout_minutes
    )
    setup_logging(state.rank)
    config_text = to_yaml(cfg)
    log.info("resolved config:\n%s", config_text)
    log.info(
        "world %d = dp %d x tp %d; %d micro-batches per step",
        world_size,
        derived.dp_size,
        derived.tp_size,
        derived.num_micro_batches,
    )

    tracker = RNGTracker(state.device)
    tracker.seed(cfg.training.seed, state.tp_rank)
    tokenizer = build_tokenizer(**asdict(cfg.tokenizer))
    padded_vocab = derived.padded_vocab_size(tokenizer.vocab_size)
    model = model_provider(cfg, tokenizer.vocab_size, padded_vocab, state, tracker)
    model.to(DTYPES[cfg.precision.dtype])
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %d parameters on TP rank 0 (padded vocab %d)", n_params, padded_vocab)
    ddp = DataParallel(model, state, cfg.parallel.ddp_bucket_size_mb)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.precision, state)
    schedule = LRSchedule.from_config(cfg.optimizer)

    progress = Progress()
    load_dir = _resume_dir(cfg)
    if load_dir is not None:
        saved = checkpointing.load_checkpoint(
            load_dir,
            model,
            optimizer,
            schedule,
            tracker,
            state,
            tokenizer.vocab_size,
            finetune=cfg.checkpoint.finetune,
        )
        if saved is not None and not cfg.checkpoint.finetune:
            progress = Progress(**{k: saved[k] for k in asdict(progress) if k in saved})
        log.info("resumed from %s at iteration %d", load_dir, progress.iteration)
    optimizer.set_lr(schedule.lr)

    t = cfg.training
    train_iters = t.train_iters
    evals = (train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_iters else 0
    num_samples = (
        train_iters * t.global_batch_size,
        evals * t.global_batch_size,
        t.eval_iters * t.global_batch_size,
    )
    train_ds, valid_ds, _ = datasets_provider(cfg, tokenizer, num_samples)
    pin = state.device.type == "cuda"
    loader = lambda ds, consumed: build_loader(  # noqa: E731
        ds,
        consumed,
        t.micro_batch_size,
        t.global_batch_size,
        state.dp_rank,
        state.dp_size,
        cfg.data.num_workers,
        pin,
    )
    train_iter = loader(train_ds, progress.consumed_train_samples)
    valid_iter = loader(valid_ds, progress.consumed_valid_samples) if valid_ds else None

    flops = flops_per_iteration(
        num_layers=cfg.model.num_layers,
        hidden_size=cfg.model.hidden_size,
        ffn_hidden_size=cfg.model.ffn_hidden_size,
        seq_length=cfg.model.seq_length,
        padded_vocab_size=padded_vocab,
        global_batch_size=t.global_batch_size,
        recompute=cfg.model.recompute == "full",
    )
    metrics = MetricsLogger(
        cfg.logging.tensorboard_dir, cfg.logging.metrics_file, state.is_first, config_text
    )
    exit_signal = ExitSignal(t.exit_signal)
    loop = _Loop(
        cfg,
        state,
        model,
        ddp,
        optimizer,
        schedule,
        tracker,
        progress,
        metrics,
        forward_step,
        derived.num_micro_batches,
        flops,
        tokenizer.vocab_size,
    )
    try:
        code = loop.run(train_iter, valid_iter, train_iters, start_time, exit_signal)
    finally:
        metrics.close()
        exit_signal.restore()
    parallel_state.shutdown()
    return code


def _resume_dir(cfg: Config) -> str | None:
    """checkpoint.load if set (it must hold a checkpoint), else checkpoint.save once it has one."""
    ckpt = cfg.checkpoint
    if ckpt.load:
        return ckpt.load
    if (
        ckpt.save
        and os.path.isdir(ckpt.save)
        and (
            checkpointing.find_latest(ckpt.save) is not None or checkpointing.iterations(ckpt.save)
        )
    ):
        return ckpt.save
    return None


def _to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class _Loop:
    """The iteration loop and its bookkeeping; one instance per run."""

    def __init__(
        self,
        cfg: Config,
        state: ParallelState,
        model: nn.Module,
        ddp: DataParallel,
        optimizer: MixedPrecisionOptimizer,
        schedule: LRSchedule,
        tracker: RNGTracker,
        progress: Progress,
        metrics: MetricsLogger,
        forward_step: ForwardStep,
        num_micro: int,
        flops: float,
        vocab_size: int,
    ):
        self.cfg, self.state, self.model, self.ddp = cfg, state, model, ddp
        self.optimizer, self.schedule, self.tracker = optimizer, schedule, tracker
        self.progress, self.metrics, self.forward_step = progress, metrics, forward_step
        self.num_micro, self.flops, self.vocab_size = num_micro, flops, vocab_size

    def train_step(self, data: Iterator[Batch]) -> tuple[Any, dict[str, Tensor]]:
        """One optimizer step over ``num_micro`` micro-batches; metrics averaged over them."""
        self.ddp.zero_grad_buffer()
        sums: dict[str, Tensor] = {}
        for i in range(self.num_micro):
            batch = _to_device(next(data), self.state.device)
            # Only the last micro-batch's backward all-reduces gradients over DP.
            last = i == self.num_micro - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                loss, values = self.forward_step(self.model, batch)
                self.optimizer.scale_loss(loss / self.num_micro).backward()
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + value.detach().float()
        self.ddp.finish_grad_sync()  # waits for the buckets still in flight
        result = self.optimizer.step()  # one host sync: the agreed overflow flag and the norm
        return result, {k: v / self.num_micro for k, v in sums.items()}

    def _dp_mean(self, sums: dict[str, Tensor], count: int) -> dict[str, float]:
        """Average metric sums over ``count`` steps and the DP replicas (one all-reduce)."""
        if not sums:
            return {}
        stacked = torch.stack(list(sums.values()))
        if self.state.dp_size > 1:
            dist.all_reduce(stacked, group=self.state.dp_group)
        values = (stacked / (count * self.state.dp_size)).tolist()
        return dict(zip(sums.keys(), values))

    @torch.no_grad()
    def evaluate(self, valid_iter: Iterator[Batch]) -> dict[str, float]:
        self.model.eval()
        sums: dict[str, Tensor] = {}
        iters = self.cfg.training.eval_iters
        for _ in range(iters * self.num_micro):
            _, values = self.forward_step(
                self.model, _to_device(next(valid_iter), self.state.device)
            )
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + value.float()
        self.model.train()
        self.progress.consumed_valid_samples += iters * self.cfg.training.global_batch_size
        return self._dp_mean(sums, iters * self.num_micro)

    def save(self) -> None:
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
        train_iters: int,
        start_time: float,
        exit_signal: ExitSignal,
    ) -> int:
        cfg, p, t = self.cfg, self.progress, self.cfg.training
        self.model.train()
        sums: dict[str, Tensor] = {}
        window_steps, window_start = 0, time.perf_counter()
        skipped_at_window, nan_at_window = p.skipped_iters, p.nan_iters
        last_saved = p.iteration
        while p.iteration < train_iters:
            result, values = self.train_step(train_iter)
            p.iteration += 1
            p.consumed_train_samples += t.global_batch_size
            if result.updated:
                self.optimizer.set_lr(self.schedule.step())
                p.consecutive_skips = 0
            else:
                p.skipped_iters += 1
                p.consecutive_skips += 1
                if not math.isfinite(result.grad_norm) and cfg.precision.dtype != "fp16":
                    p.nan_iters += 1
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + value
            window_steps += 1

            if p.iteration % cfg.logging.log_interval == 0 or p.iteration == train_iters:
                elapsed = time.perf_counter() - window_start
                means = self._dp_mean(sums, window_steps)
                self._log_train(
                    means,
                    result,
                    elapsed / window_steps,
                    p.skipped_iters - skipped_at_window,
                    p.nan_iters - nan_at_window,
                )
                sums, window_steps, window_start = {}, 0, time.perf_counter()
                skipped_at_window, nan_at_window = p.skipped_iters, p.nan_iters

            if valid_iter is not None and t.eval_iters and p.iteration % t.eval_interval == 0:
                self._log_eval(self.evaluate(valid_iter))
                window_start = time.perf_counter()  # evaluation time is not iteration time

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
            stop = self._should_exit(start_time, exit_signal)
            if save_now or stop or p.iteration == train_iters:
                self.save()
                last_saved = p.iteration
            if stop:
                log.info("exiting at iteration %d (%s)", p.iteration, stop)
                return 0
        if last_saved != p.iteration:
            self.save()
        return 0

    def _should_exit(self, start_time: float, exit_signal: ExitSignal) -> str:
        """Why every rank should save and stop now ('' to go on); all ranks agree."""
        t, it = self.cfg.training, self.progress.iteration
        if t.exit_interval and it % t.exit_interval == 0:
            return f"training.exit_interval={t.exit_interval}"
        # Wall-clock and signals differ between ranks; one tiny all-reduce (MAX) makes every rank
        # take the same decision at the same iteration.
        flags = torch.tensor(
            [
                exit_signal.received,
                bool(t.exit_duration_in_mins)
                and time.time() - start_time > 60 * t.exit_duration_in_mins,
            ],
            dtype=torch.float32,
            device=self.state.device,
        )
        if self.state.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signal_seen, timed_out = flags.tolist()
        if signal_seen:
            return f"signal {t.exit_signal}"
        if timed_out:
            return f"training.exit_duration_in_mins={t.exit_duration_in_mins}"
        return ""

    def _log_train(
        self, means: dict[str, float], result: Any, seconds: float, skipped: int, nans: int
    ) -> None:
        p, t = self.progress, self.cfg.training
        tokens_per_s = t.global_batch_size * self.cfg.model.seq_length / seconds
        tflops = self.flops / seconds / self.state.world_size / 1e12
        lr = self.optimizer.lr
        entry = {
            "iteration": p.iteration,
            "consumed_samples": p.consumed_train_samples,
            **{k.replace(" ", "_"): v for k, v in means.items()},
            "lr": lr,
            "grad_norm": result.grad_norm,
            "loss_scale": result.loss_scale,
            "skipped": skipped,
            "nan": nans,
            "ms_per_iter": 1000 * seconds,
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
        }
        self.metrics.record(entry)
        self.metrics.scalars(
            {
                "learning-rate": lr,
                **means,
                "loss-scale": result.loss_scale,
                "grad-norm": result.grad_norm,
                "iteration-time": seconds,
            },
            p.iteration,
            p.consumed_train_samples,
        )
        fields: dict[str, Any] = {
            "iteration": f"{p.iteration:8d}/{t.train_iters:8d}",
            "consumed samples": p.consumed_train_samples,
            "elapsed time per iteration (ms)": 1000 * seconds,
            "tokens/s": tokens_per_s,
            "TFLOP/s per device": tflops,
            "learning rate": lr,
            **means,
            "loss scale": result.loss_scale,
            "grad norm": result.grad_norm,
            "skipped iterations": skipped,
            "nan iterations": nans,
            "peak memory (MB)": peak_memory_mb(self.state.device),
        }
        log.info(format_line(fields))

    def _log_eval(self, means: dict[str, float]) -> None:
        p = self.progress
        values = {}
        for name, value in means.items():
            values[f"{name} validation"] = value
            values[f"{name} validation ppl"] = perplexity(value)
        self.metrics.scalars(values, p.iteration, p.consumed_train_samples)
        self.metrics.record(
            {
                "iteration": p.iteration,
                "consumed_samples": p.consumed_train_samples,
                **{k.replace(" ", "_"): v for k, v in values.items()},
            }
        )
        log.info("validation at iteration %d | %s", p.iteration, format_line(values))
