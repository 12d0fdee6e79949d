"""The pretraining entry shared by GPT and BERT: setup, resume, and the hand-over to the loop.

``pretrain`` validates the config before any process starts work, builds the process groups,
tokenizer, model, optimizer and data, resumes from the newest intact checkpoint when there is
one, then hands over to ``megatron.training.loop.TrainLoop`` until ``train_iters`` (or
``train_samples``), ``exit_interval``, ``exit_duration_in_mins`` or the exit signal.

Resuming is bit-exact: a checkpoint holds every rank's RNG states, the data position of both
streams, the optimizer, loss scaler and LR schedule, and the open log window. If a peer dies or
freezes, the heartbeat names it and the run exits 1: when a collective fails (gloo), or, where
none fails (NCCL hangs), from the heartbeat's own thread after ``parallel.heartbeat_grace_s``.
Rank 0 holds ``checkpoint.save``'s lock (``run_lock``): a second run there refuses to start.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from megatron import checkpoint
from megatron.atomic_file import write_contents
from megatron.checkpoint.train_state import Progress, TrainState
from megatron.config import skip_list
from megatron.config.dtypes import DTYPES
from megatron.config.load import parse_args
from megatron.config.schema import Config, to_yaml, weighted_paths
from megatron.data.loader import build_loader
from megatron.data.sidecar import check_data_tokenizer
from megatron.data.splits import samples_per_split
from megatron.data.token_range import check_data_ids
from megatron.data.tokenizers.factory import Tokenizer, build_tokenizer
from megatron.errors import ConfigError
from megatron.estimate.workload import Workload
from megatron.launch.heartbeat import PEER_FAILURE, Heartbeat
from megatron.launch.preflight import PREFLIGHT_PASSED, validate
from megatron.launch.run_lock import NO_LOCK, NoLock, RunLock, hold_save_dir
from megatron.launch.torchrun import exit_with
from megatron.logging import log, setup_logging
from megatron.models.build import build_model
from megatron.optim.build import build_optimizer
from megatron.optim.lr_schedule import LRSchedule
from megatron.parallel import state as parallel_state
from megatron.parallel.data_parallel import DataParallel
from megatron.parallel.launcher import launcher_env
from megatron.parallel.pipeline.stage import PipelineStage, activation_spec
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState
from megatron.training.exit import ExitPolicy, ExitSignal
from megatron.training.loop import Batch, Downstream, ForwardStep, TrainLoop
from megatron.training.metrics import MetricsLogger
from megatron.training.source_losses import SourceLosses

DatasetsProvider = Callable[[Config, Tokenizer, tuple[int, int, int]], tuple[Any, Any, Any]]
# (cfg, tokenizer) -> the training.eval_tasks scorer, built (and checked) before the model: the
# entrypoint's, from megatron/inference (a package above this one).
DownstreamProvider = Callable[[Config, Tokenizer], Downstream]


def main(
    argv: list[str],
    description: str,
    datasets_provider: DatasetsProvider,
    forward_step: ForwardStep,
    model_type: str = "gpt",
    downstream: DownstreamProvider | None = None,
) -> int:
    """Entry point: parse, validate, train; a user mistake is one line on rank 0 and exit 2 (4:
    storage refused a write). ``--preflight`` runs the checks alone, for ``--world-size``.

    ``model_type`` ("gpt" or "bert") is this entrypoint's, the model ``models/build.py`` builds:
    a config whose ``model.type`` names the other is refused, and the run's config (printed,
    saved) holds only this model's sections. The dry run reports that model's parameter count.
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
        if args.dry_run or args.plan:
            from megatron.launch.dry_run import dry_run_to_stdout

            return dry_run_to_stdout(cfg, args, model_type)
        if args.preflight:  # what the launch scripts run before they start torchrun
            world_size = args.world_size or int(launcher_env()["WORLD_SIZE"])
            for warning in validate(cfg, world_size):
                print(f"WARNING: {warning}")
            print(f"preflight ok: {', '.join(args.config)} at world size {world_size}")
            return 0
        return pretrain(cfg, datasets_provider, forward_step, downstream)
    except ConfigError as err:
        return exit_with(err)


def pretrain(
    cfg: Config,
    datasets_provider: DatasetsProvider,
    forward_step: ForwardStep,
    downstream: DownstreamProvider | None = None,
) -> int:
    """Train the ``cfg.model.type`` model as ``cfg`` says; returns the process exit code (3: NaN
    stop, 1: a peer was lost)."""
    world_size = int(launcher_env()["WORLD_SIZE"])
    warnings = validate(cfg, world_size)  # every user mistake surfaces here, before any collective
    # A launch script's preflight ran these same checks and printed the warnings: once a launch.
    shown = os.environ.get(PREFLIGHT_PASSED) == "1"
    for warning in warnings if int(launcher_env()["RANK"]) == 0 and not shown else ():
        print(f"WARNING: {warning}")  # stdout, as rank 0's log, whose logger is not set up yet
    start_time = time.time()
    # Installed before the slow setup: a signal that comes while indices are built is then acted
    # on at the first iteration instead of killing the process.
    exit_signal = ExitSignal(cfg.training.exit_signal)
    lock: RunLock | NoLock = NO_LOCK  # checkpoint.save's, released on every way out
    try:
        p = cfg.parallel
        state = parallel_state.initialize(
            p.tensor_parallel_size,
            p.timeout_minutes,
            p.pipeline_parallel_size,
            p.context_parallel_size,
            p.expert_parallel_size,
        )
        setup_logging(state.rank)
        grace = p.heartbeat_grace_s
        lock = hold_save_dir(cfg.checkpoint.save, grace, state)
        # The heartbeat ends the process itself when a peer is lost: it releases the lock first.
        heartbeat = None
        if state.world_size > 1:
            heartbeat = Heartbeat(state.rank, state.world_size, grace, lock.release)
        policy = ExitPolicy(cfg.training, exit_signal, start_time)
        try:
            provided = (datasets_provider, forward_step, downstream)
            code = _train(cfg, state, *provided, policy, heartbeat)
        except Exception as err:
            if heartbeat is None:
                raise
            # A user mistake found after setup (e.g. at load) is raised by every rank alike; any
            # other error is a lost peer's when the heartbeat names one.
            report = None if isinstance(err, ConfigError) else heartbeat.blame(err)
            heartbeat.leave(f"{type(err).__name__}: {str(err)[:200]}")
            if report is None:
                raise
            log.error("%s", report)
            return PEER_FAILURE
        if heartbeat is not None:
            heartbeat.leave("finished")
        parallel_state.shutdown()
        return code
    finally:
        lock.release()
        exit_signal.restore()


def _train(
    cfg: Config,
    state: ParallelState,
    datasets_provider: DatasetsProvider,
    forward_step: ForwardStep,
    downstream: DownstreamProvider | None,
    policy: ExitPolicy,
    heartbeat: Heartbeat | None,
) -> int:
    """Build everything, resume if there is a checkpoint, run the loop."""
    derived = cfg.derived(state.world_size)
    config_text = to_yaml(cfg)
    m, t = cfg.model, cfg.training
    log.info(
        "%s: %d layers x %d hidden, %d heads, seq %d, %s; world %d = dp %d x pp %d x cp %d x "
        "tp %d; "
        "%d iterations of %d samples (%d micro-batches per step), lr %g",
        m.type,
        m.num_layers,
        m.hidden_size,
        m.num_attention_heads,
        m.seq_length,
        cfg.precision.dtype,
        state.world_size,
        derived.dp_size,
        state.pp_size,
        state.cp_size,
        derived.tp_size,
        t.train_iters,
        t.global_batch_size,
        derived.num_micro_batches,
        cfg.optimizer.lr,
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
    # Every rank: an id outside the vocabulary would fail in the embedding at step 1. One scan
    # per file and node (then cached), and every rank raises the same ConfigError after the
    # cache's barrier, so none is left waiting in a collective.
    check_data_ids(cfg.data, tokenizer.vocab_size)
    if cfg.training.eval_tasks and downstream is None:
        raise ConfigError(f"training.eval_tasks: lm-eval tasks score a GPT; {m.type} has none")
    tasks = downstream(cfg, tokenizer) if downstream is not None else None  # checked here
    padded_vocab = derived.padded_vocab_size(tokenizer.vocab_size)
    model = build_model(cfg.model.type, cfg, tokenizer.vocab_size, padded_vocab, state, tracker)
    model.to(DTYPES[cfg.precision.dtype])
    n_params = sum(p.numel() for p in model.parameters())
    # Rank 0's share: its TP slice of its pipeline stage.
    log.info("model: %d parameters on rank 0 (padded vocab %d)", n_params, padded_vocab)
    # With parallel.distributed_optimizer the buckets are reduce-scattered and each DP rank
    # updates its shard of them (megatron/optim/distributed_optimizer.py).
    parallel = cfg.parallel
    ddp = DataParallel(
        model,
        state,
        parallel.ddp_bucket_size_mb,
        shard_optimizer=parallel.distributed_optimizer,
        overlap_param_gather=parallel.overlap_param_gather,
    )
    optimizer = build_optimizer(model, cfg.optimizer, cfg.precision, state, ddp)
    schedule = LRSchedule.from_config(cfg.optimizer)

    train = TrainState(model, optimizer, schedule, tracker)
    load_dir, weights_only = _resume_source(cfg)
    if load_dir is not None:
        if cfg.checkpoint.finetune and not weights_only:
            log.info(
                "checkpoint.save=%s holds this fine-tune's own checkpoint: resuming it in full, "
                "not the pretrained weights of checkpoint.load=%s",
                load_dir,
                cfg.checkpoint.load,
            )
        start = time.perf_counter()
        checkpoint.load_checkpoint(load_dir, train, state, tokenizer.vocab_size, weights_only)
        load_ms = 1000 * (time.perf_counter() - start)  # choosing, reading, verifying, restoring
        how = "fine-tuning the weights of" if weights_only else "resumed from"
        iteration = train.progress.iteration
        log.info("%s %s at iteration %d (load_total_ms %.0f)", how, load_dir, iteration, load_ms)
    progress = train.progress
    if progress.iteration >= cfg.training.train_iters:
        log.info(
            "already at iteration %d >= training.train_iters=%d; nothing to do; raise "
            "train_iters to continue",
            progress.iteration,
            cfg.training.train_iters,
        )
        windows = {"profile_steps": cfg.logging.profile_steps}
        windows["memory_snapshot_steps"] = cfg.logging.memory_snapshot_steps
        for key, steps in windows.items():
            if steps is not None and state.is_first:  # one line, not one per rank
                log.warning("logging.%s=%s: nothing was recorded (no iteration ran)", key, steps)
        return 0
    if state.rank == 0:
        # Only now: a run refused by its checkpoint, or with nothing to do, leaves the save
        # directory's record of the config that wrote its checkpoints alone.
        _record_config(cfg, config_text)
    optimizer.set_lr(schedule.lr)
    # The hand-given skips join the checkpoint's: the stream passes over both.
    progress.skip_batches = skip_list.with_config(progress.skip_batches, cfg)
    splits = datasets_provider(cfg, tokenizer, samples_per_split(t, skip_list.headroom(cfg)))
    streams = _Streams(cfg, state, splits)
    train_iter, valid_iter = streams.reopen(progress)
    test_iter = streams.stream(splits[2], 0) if splits[2] else None

    work = Workload.of(cfg, padded_vocab, state.world_size)
    metrics = MetricsLogger(
        cfg.logging.tensorboard_dir,
        cfg.logging.metrics_file,
        state.is_first,
        config_text,
        work,
        cfg,
    )
    if load_dir is not None:  # the resume's own line, as each save has one
        metrics.record({"iteration": progress.iteration, "load_total_ms": load_ms})
    prefixes = [prefix for _, prefix in weighted_paths(cfg.data.paths)]
    sources = SourceLosses(prefixes, state) if len(prefixes) > 1 else None
    if sources is not None:
        forward_step = sources.wrap(forward_step)
    stage = None  # with pipeline parallelism: this rank's stage, which runs the schedule
    if state.pp_size > 1:
        mbs, dtype = cfg.training.micro_batch_size, DTYPES[cfg.precision.dtype]
        spec = activation_spec(cfg.model, mbs, state, parallel.sequence_parallel, dtype)
        stage = PipelineStage(model, forward_step, state, spec)
    micro, vocab = derived.num_micro_batches, tokenizer.vocab_size
    loop = TrainLoop(cfg, state, train, ddp, metrics, forward_step, micro, vocab, heartbeat, stage)
    loop.downstream = tasks
    loop.reopen, loop.train_samples = streams.reopen, len(splits[0])
    loop.sources = sources
    try:
        return loop.run(train_iter, valid_iter, test_iter, policy)
    finally:
        metrics.close()


def _record_config(cfg: Config, config_text: str) -> None:
    """The resolved config as ``resolved_config.yaml`` in the run's save (else TensorBoard)
    directory, its path on the console; with neither, the whole config on the console. A file
    that cannot be written is a warning: every checkpoint's meta.json holds the config too."""
    directory = cfg.checkpoint.save or cfg.logging.tensorboard_dir
    if directory is None:
        log.info("resolved config:\n%s", config_text)
        return
    path = os.path.join(directory, "resolved_config.yaml")
    try:
        os.makedirs(directory, exist_ok=True)
        write_contents(path, config_text)
    except OSError as err:
        log.warning("could not write the resolved config to %s (%s)", path, err.strerror)
        return
    log.info("resolved config: %s", path)


def _resume_source(cfg: Config) -> tuple[str | None, bool]:
    """(the checkpoint directory to load, whether to load its weights only); (None, False): none.

    checkpoint.save once it holds a checkpoint, unless checkpoint.load names another run to
    resume; in a fine-tune always, since its checkpoints are this run's own, newer than the
    pretrained weights. Else checkpoint.load (which must hold a checkpoint): in full, or its
    weights only with checkpoint.finetune.
    """
    ckpt, own = cfg.checkpoint, False
    if ckpt.save and os.path.isdir(ckpt.save):
        own = checkpoint.find_latest(ckpt.save) is not None
        own = own or bool(checkpoint.iterations(ckpt.save))
    if own and (ckpt.finetune or not ckpt.load):
        return ckpt.save, False
    return ckpt.load, ckpt.finetune


@dataclass
class _Streams:
    """The data streams of a run's train, valid and test splits, each from a position."""

    cfg: Config
    state: ParallelState
    splits: tuple[Any, Any, Any]

    def stream(self, dataset: Any, consumed: int, skip: list[list[int]] = ()) -> Iterator[Batch]:
        t = self.cfg.training
        return build_loader(
            dataset,
            consumed,
            t.micro_batch_size,
            t.global_batch_size,
            self.state.dp_rank,
            self.state.dp_size,
            self.cfg.data.num_workers,
            self.state.device.type == "cuda",
            skip,
        )

    def reopen(self, progress: Progress) -> tuple[Iterator[Batch], Iterator[Batch] | None]:
        """The train stream (its skip list passed over) and the validation stream, each from
        where ``progress`` says it stopped."""
        train, valid, _ = self.splits
        train_iter = self.stream(train, progress.consumed_train_samples, progress.skip_batches)
        valid_iter = self.stream(valid, progress.consumed_valid_samples) if valid else None
        return train_iter, valid_iter
