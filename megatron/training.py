"""The pretraining loop shared by GPT and BERT.

``pretrain`` validates the config before any process starts work, builds the process groups,
tokenizer, model, optimizer and data, resumes from the newest intact checkpoint when there is
one, then runs: micro-batches -> forward/backward -> DP gradient sync -> unscale/check/clip/step
(with the metrics and exit flags in its all-reduce, and the iteration's one host sync at its end)
-> LR step -> evaluate (agreeing on the exit flags again) -> log -> save, until
``train_iters`` (or ``train_samples``), ``exit_interval``, ``exit_duration_in_mins`` or the exit
signal; a run that reaches ``train_iters`` then evaluates the test split once (``test_iters``).

Resuming is bit-exact: a checkpoint holds every rank's RNG states, the data position of both
streams, the optimizer, loss scaler and LR schedule, and the open log window. If a peer dies or
freezes, the collective that fails names no rank; the heartbeat does, and the run exits 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron import checkpointing
from megatron.config import Config, to_yaml
from megatron.config_checks import validate
from megatron.config_load import parse_args
from megatron.data.loader import build_loader
from megatron.data.sidecar import check_data_tokenizer
from megatron.data.splits import samples_per_split
from megatron.data.tokenizers import Tokenizer, build_tokenizer
from megatron.errors import ConfigError
from megatron.logging import LogWindow, MetricsLogger, Workload, log, setup_logging
from megatron.optim.lr_schedule import LRSchedule
from megatron.optim.optimizer import MixedPrecisionOptimizer, StepResult, build_optimizer
from megatron.parallel import state as parallel_state
from megatron.parallel.data_parallel import DataParallel
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import Heartbeat, ParallelState
from megatron.preemption import ExitPolicy, ExitSignal

Batch = dict[str, Tensor]
ModelProvider = Callable[[Config, int, int, ParallelState, RNGTracker], nn.Module]
DatasetsProvider = Callable[[Config, Tokenizer, tuple[int, int, int]], tuple[Any, Any, Any]]
# forward_step(model, batch) -> (loss to minimise, {metric name: detached scalar tensor})
ForwardStep = Callable[[nn.Module, Batch], tuple[Tensor, dict[str, Tensor]]]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PEER_FAILURE = 1  # exit code when a peer died or froze


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


def main(
    argv: list[str],
    description: str,
    model_provider: ModelProvider,
    datasets_provider: DatasetsProvider,
    forward_step: ForwardStep,
    model_type: str = "gpt",
) -> int:
    """Entry point: parse, validate, train; a user mistake is one line on rank 0 and exit 2.

    ``model_type`` ("gpt" or "bert") is this entrypoint's: a config whose ``model.type`` names
    the other is refused, and the run's config (printed, saved) holds only this model's sections.
    The dry run reports that model's parameter count.
    """
    try:
        cfg, args = parse_args(argv, description)
        if cfg.model.type not in (None, model_type):
            raise ConfigError(
                f"model.type={cfg.model.type}: {', '.join(args.config)} is a {cfg.model.type} "
                f"config and this entrypoint trains {model_type}; run pretrain_"
                f"{cfg.model.type}.py with it, or give a {model_type} config"
            )
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, type=model_type))
        if args.dry_run:
            from megatron.dry_run import dry_run

            return dry_run(cfg, args, model_type)
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
    """Train as ``cfg`` says; returns the process exit code (3: NaN stop, 1: a peer was lost)."""
    world_size = int(parallel_state.launcher_env()["WORLD_SIZE"])
    validate(cfg, world_size)  # every user mistake surfaces here, before any collective
    start_time = time.time()
    # Installed before the slow setup: a signal that comes while indices are built is then acted
    # on at the first iteration instead of killing the process.
    exit_signal = ExitSignal(cfg.training.exit_signal)
    try:
        state = parallel_state.initialize(
            cfg.parallel.tensor_parallel_size, cfg.parallel.timeout_minutes
        )
        setup_logging(state.rank)
        heartbeat = Heartbeat(state.rank, state.world_size) if state.world_size > 1 else None
        policy = ExitPolicy(cfg.training, exit_signal, start_time)
        try:
            code = _train(cfg, state, model_provider, datasets_provider, forward_step, policy)
        except Exception as err:
            if heartbeat is None:
                raise
            return _peer_failure(err, heartbeat)
        if heartbeat is not None:
            heartbeat.leave("finished")
        parallel_state.shutdown()
        return code
    finally:
        exit_signal.restore()


def _peer_failure(err: Exception, heartbeat: Heartbeat) -> int:
    """Name the peers at fault and return PEER_FAILURE; re-raise ``err`` if none is."""
    # A user mistake found after setup (e.g. at load) is raised by every rank alike.
    report = None if isinstance(err, ConfigError) else heartbeat.blame(err)
    heartbeat.leave(f"{type(err).__name__}: {str(err)[:200]}")
    if report is None:
        raise err
    log.error("%s", report)
    return PEER_FAILURE


def _train(
    cfg: Config,
    state: ParallelState,
    model_provider: ModelProvider,
    datasets_provider: DatasetsProvider,
    forward_step: ForwardStep,
    policy: ExitPolicy,
) -> int:
    """Build everything, resume if there is a checkpoint, run the loop."""
    derived = cfg.derived(state.world_size)
    config_text = to_yaml(cfg)
    log.info("resolved config:\n%s", config_text)
    log.info(
        "world %d = dp %d x tp %d; %d micro-batches per step",
        state.world_size,
        derived.dp_size,
        derived.tp_size,
        derived.num_micro_batches,
    )
    if cfg.precision.dtype == "fp16" and state.device.type == "cpu" and state.rank == 0:
        # Where a CPU lacks fp16 kernels, fp16 was measured 50x slower than bf16 (issue 12);
        # bf16 also needs no loss scaling.
        log.warning(
            "precision.dtype=fp16 on CPU can be up to ~50x slower than bf16 (CPUs without fp16 "
            "kernels); use precision.dtype=bf16"
        )
    if cfg.precision.dtype == "fp32":
        # Flags only: on CUDA they pick TF32 kernels for fp32 matmuls; elsewhere nothing reads them.
        torch.backends.cuda.matmul.allow_tf32 = cfg.precision.tf32
        torch.backends.cudnn.allow_tf32 = cfg.precision.tf32
    tracker = RNGTracker(state.device)
    tracker.seed(cfg.training.seed, state.tp_rank)
    tokenizer = build_tokenizer(**asdict(cfg.tokenizer))
    if state.rank == 0:  # one line when the data's sidecar names another tokenizer
        check_data_tokenizer(cfg.tokenizer, cfg.data, log.warning, tokenizer)
    padded_vocab = derived.padded_vocab_size(tokenizer.vocab_size)
    model = model_provider(cfg, tokenizer.vocab_size, padded_vocab, state, tracker)
    model.to(DTYPES[cfg.precision.dtype])
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %d parameters on TP rank 0 (padded vocab %d)", n_params, padded_vocab)
    ddp = DataParallel(model, state, cfg.parallel.ddp_bucket_size_mb)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.precision, state)
    schedule = LRSchedule.from_config(cfg.optimizer)

    progress = Progress()
    load_dir, weights_only = _resume_source(cfg)
    if load_dir is not None:
        if cfg.checkpoint.finetune and not weights_only:
            log.info(
                "checkpoint.save=%s holds this fine-tune's own checkpoint: resuming it in full, "
                "not the pretrained weights of checkpoint.load=%s",
                load_dir,
                cfg.checkpoint.load,
            )
        saved = checkpointing.load_checkpoint(
            load_dir,
            model,
            optimizer,
            schedule,
            tracker,
            state,
            tokenizer.vocab_size,
            finetune=weights_only,
        )
        if saved is not None:
            progress = Progress.restore(saved)
        how = "fine-tuning the weights of" if weights_only else "resumed from"
        log.info("%s %s at iteration %d", how, load_dir, progress.iteration)
    if progress.iteration >= cfg.training.train_iters:
        log.info(
            "already at iteration %d >= training.train_iters=%d; nothing to do; raise "
            "train_iters to continue",
            progress.iteration,
            cfg.training.train_iters,
        )
        return 0
    optimizer.set_lr(schedule.lr)
    train_iter, valid_iter, test_iter = _data(cfg, state, datasets_provider, tokenizer, progress)

    work = Workload.of(cfg, padded_vocab, state.world_size, state.device)
    metrics = MetricsLogger(
        cfg.logging.tensorboard_dir, cfg.logging.metrics_file, state.is_first, config_text, work
    )
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
        tokenizer.vocab_size,
    )
    try:
        return loop.run(train_iter, valid_iter, test_iter, policy)
    finally:
        metrics.close()


def _resume_source(cfg: Config) -> tuple[str | None, bool]:
    """(the checkpoint directory to load, whether to load its weights only); (None, False): none.

    checkpoint.save once it holds a checkpoint, unless checkpoint.load names another run to
    resume; in a fine-tune always, since its checkpoints are this run's own, newer than the
    pretrained weights. Else checkpoint.load (which must hold a checkpoint): in full, or its
    weights only with checkpoint.finetune.
    """
    ckpt, own = cfg.checkpoint, False
    if ckpt.save and os.path.isdir(ckpt.save):
        own = checkpointing.find_latest(ckpt.save) is not None
        own = own or bool(checkpointing.iterations(ckpt.save))
    if own and (ckpt.finetune or not ckpt.load):
        return ckpt.save, False
    return ckpt.load, ckpt.finetune


def _data(
    cfg: Config,
    state: ParallelState,
    datasets_provider: DatasetsProvider,
    tokenizer: Tokenizer,
    progress: Progress,
) -> tuple[Iterator[Batch], Iterator[Batch] | None, Iterator[Batch] | None]:
    """The train and validation streams, each from where ``progress`` says it stopped, and the
    test stream (from its start; built only with training.test_iters)."""
    t = cfg.training
    train_ds, valid_ds, test_ds = datasets_provider(cfg, tokenizer, samples_per_split(t))

    def stream(ds: Any, consumed: int) -> Iterator[Batch]:
        return build_loader(
            ds,
            consumed,
            t.micro_batch_size,
            t.global_batch_size,
            state.dp_rank,
            state.dp_size,
            cfg.data.num_workers,
            state.device.type == "cuda",
        )

    train_iter = stream(train_ds, progress.consumed_train_samples)
    valid_iter = stream(valid_ds, progress.consumed_valid_samples) if valid_ds else None
    test_iter = stream(test_ds, 0) if test_ds else None
    return train_iter, valid_iter, test_iter


def _to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@dataclass
class _Loop:
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
            batch = _to_device(next(data), self.state.device)
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
            batch = _to_device(next(data), self.state.device)
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
