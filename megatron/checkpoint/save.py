"""Checkpoints: one tensor file per (TP, PP) rank, written by several nodes, atomic, verified.

    save_dir/
      latest                          "100\\n": replaced atomically after every rank has finished
      iter_0000100/
        meta.json                     resolved config, iteration, progress, TP/PP/DP sizes, vocab
                                      sizes, each tensor's split dim and full shape, each stage's
                                      keys (``stages``), LR schedule, loss scaler, versions, the
                                      checksum of every other file and the rank that wrote it
                                      (``writers``)
        model_optim_tp00.safetensors  TP rank t's slices of the weights and of the optimizer's
        model_optim_tp01.safetensors  main params, moments and steps, written by DP rank t % dp;
                                      with PP > 1 one per (TP, PP) rank,
                                      model_optim_tp{t:02d}_pp{p:03d}, by DP rank (p*tp + t) % dp
                                      (ParallelState.writes_checkpoint_shard)
        experts_tp00_ep000.safetensors  with expert parallelism: each (TP, PP, EP) rank's experts
        experts_tp00_ep001.safetensors  (weights and optimizer state; the TP files then hold the
                                      rest), by one of their expert-data-parallel copies
                                      (ParallelState.writes_expert_shard)
        optim_tp00_dp000.safetensors  with the distributed optimizer: each (TP, PP, DP) rank's shard
        ...                           of the optimizer state (megatron.checkpoint.optim_shards);
                                      the TP files then hold the weights alone
        rng_rank00000.safetensors     each rank's torch CPU/CUDA and TP-tracker states (tensors),
        ...                           python's and numpy's (JSON in the file's header)

Save, in two halves. ``capture`` (on the training thread) takes what this rank writes: live tensors
for a synchronous save, host copies for a background one (megatron.checkpoint.async_save).
``write_and_publish`` (inline, or in the background) does the rest over a gloo group kept for
checkpoints alone, so no rank ever waits for a save inside an NCCL collective or a group the
training loop uses: rank 0 draws a nonce; each rank writes and fsyncs its files in
``iter_0000100.tmp-<nonce>/``, each on a thread of its own, streamed from the tensors (no copy of a
file in memory: ``streamed_file``) and hashed by another thread as the pieces are written; rank 0
gathers the sums, writes meta.json, renames the directory into place, fsyncs ``save_dir``, and only
then replaces ``latest``; last it tells every rank how it went. A process killed at any point
leaves ``latest`` naming the previous complete checkpoint. A save that fails leaves it too: rank 0
removes the temporary directory once every rank is done with it, and where storage refused a write
(a full or read-only disk) every rank raises the same one-line StorageError. Publishing:
megatron.checkpoint.publish; loading: megatron.checkpoint.load.
"""

from __future__ import annotations

import copy
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.atomic_file import (
    free_bytes,
    mib,
    refusal,
)
from megatron.checkpoint.format import (
    FORMAT_VERSION,
    checkpoint_name,
    expert_file,
    optim_file,
    rng_file,
    shard_file,
)
from megatron.checkpoint.load import find_latest
from megatron.checkpoint.publish import publish
from megatron.checkpoint.reshard import expert_keys, padded_vocab, shard_tensors, tensor_layout
from megatron.checkpoint.rng import rng_state
from megatron.checkpoint.streamed_file import write_tensors
from megatron.checkpoint.train_state import TrainState
from megatron.config.schema import Config, to_dict
from megatron.errors import StorageError
from megatron.optim.distributed_optimizer import FIELDS, DistributedOptimizer
from megatron.parallel.state import ParallelState

logger = logging.getLogger(__name__)

# Rank 0 waits in the gather for the slowest writer: a big shard on slow shared storage can
# take many minutes, so far longer than a training collective may. A dead peer still fails it
# at once (its sockets close).
COORDINATION_TIMEOUT = timedelta(minutes=30)
# The coordination group, and the default group it was made beside (a new world needs a new one).
_COORDINATION: dict[str, Any] = {}
Files = dict[str, tuple[dict[str, Tensor], dict[str, str] | None]]


def files_written_by(state: ParallelState, distributed_optimizer: bool = False) -> list[str]:
    """The files of a checkpoint this rank writes: its (TP, PP) rank's shard if
    ``state.writes_checkpoint_shard``; at EP > 1 its (TP, PP, EP) rank's experts if
    ``state.writes_expert_shard``; with the distributed optimizer its own optimizer shard,
    the part of the state only it holds; always its own RNG file."""
    tp_rank, pp_rank, pp_size = state.tp_rank, state.pp_rank, state.pp_size
    names = [shard_file(tp_rank, pp_rank, pp_size)] if state.writes_checkpoint_shard else []
    if state.writes_expert_shard:
        names.append(expert_file(tp_rank, state.ep_rank, pp_rank, pp_size))
    if distributed_optimizer:
        names.append(optim_file(tp_rank, state.replica_rank, pp_rank, pp_size))
    return names + [rng_file(state.rank)]


def coordination_group(state: ParallelState) -> dist.ProcessGroup | None:
    """The gloo group checkpoint saves coordinate over (None in a world of one).

    Created at the first call, which is collective: every rank calls it at the same save.
    """
    if state.world_size == 1:
        return None
    world = dist.group.WORLD
    if _COORDINATION.get("world") is not world:
        group = dist.new_group(backend="gloo", timeout=COORDINATION_TIMEOUT)
        _COORDINATION.update(world=world, group=group)
    return _COORDINATION["group"]


@dataclass
class SaveJob:
    """One rank's share of one save, held apart from the live training state.

    ``files``: name -> (tensors, safetensors header). ``meta`` (rank 0): meta.json but for
    ``files`` and ``writers``. ``ready`` waits, before any file is written, until the tensors
    are final on the device (the host copies landed; the live tensors, for a synchronous save).
    ``error``: the capture failed; the job then only reports it, so no rank waits for this one.
    ``layout`` (DP rank 0 of each (TP, PP) rank, with the distributed optimizer): (its index
    ``pp_rank * tp_size + tp_rank``, its shard layout); ``stage`` (the writer of TP rank 0's file
    of each stage): (PP rank, its ``tensor_layout``); ``experts`` (at EP > 1, the writer of TP
    rank 0's expert file of EP rank 0 of each stage) likewise. All go to rank 0 for meta.json.
    """

    save_dir: str
    iteration: int
    rank: int
    world_size: int
    files: Files
    meta: dict[str, Any] | None
    keep_last: int | None
    ready: Callable[[], None] | None = None
    error: BaseException | None = None
    layout: tuple[int, dict[str, Any]] | None = None
    stage: tuple[int, dict[str, Any]] | None = None
    experts: tuple[int, dict[str, Any]] | None = None  # EP > 1: a stage's expert tensors


def capture(
    save_dir: str,
    train: TrainState,
    cfg: Config,
    state: ParallelState,
    vocab_size: int,
    take: Callable[[str, Tensor], Tensor] | None = None,
) -> SaveJob:
    """This rank's part of the checkpoint of ``train`` at its iteration; ``take(key, tensor)``
    copies a tensor off the live state (None: the live tensors themselves, for a save that
    finishes before training goes on). Never raises: a failure becomes the job's ``error``."""
    model, optimizer, iteration = train.model, train.optimizer, train.progress.iteration
    job = SaveJob(save_dir, iteration, state.rank, state.world_size, {}, None, None)
    try:
        job.keep_last = cfg.checkpoint.keep_last
        # The distributed optimizer's state_dict() is a collective over DP, which only the ranks
        # writing a TP file would join: its shards are saved as they lie instead.
        distributed = isinstance(optimizer, DistributedOptimizer)
        names = files_written_by(state, distributed)
        mine = shard_file(state.tp_rank, state.pp_rank, state.pp_size)
        held = expert_file(state.tp_rank, state.ep_rank, state.pp_rank, state.pp_size)
        writes = mine in names or held in names
        tensors = shard_tensors(model, None if distributed else optimizer) if writes else {}
        experts = expert_keys(tensors, model) if state.ep_size > 1 else set()
        dense = {k: v for k, v in tensors.items() if k not in experts}
        if mine in names and state.tp_rank == 0:  # one writer per stage describes its tensors
            job.stage = (state.pp_rank, tensor_layout(dense, model, state.tp_size))
        own = {k: tensors[k] for k in experts}
        if held in names and state.tp_rank == 0 and state.ep_rank == 0:  # and its experts
            job.experts = (state.pp_rank, tensor_layout(own, model, state.tp_size, state.ep_size))
        rng, header = rng_state(state, train.tracker)
        parts = {mine: (dense, None), held: (own, None), rng_file(state.rank): (rng, header)}
        if distributed:
            shard = optim_file(state.tp_rank, state.replica_rank, state.pp_rank, state.pp_size)
            flat = optimizer.shard_state()  # the flat fp32 tensors (live references)
            parts[shard] = ({key: flat[key] for key in FIELDS}, None)
            if state.replica_rank == 0:
                job.layout = (state.pp_rank * state.tp_size + state.tp_rank, optimizer.layout())
        take = take or (lambda _, t: t)
        for name in names:
            part, head = parts[name]
            job.files[name] = ({k: take(f"{name}/{k}", v) for k, v in part.items()}, head)
        if state.rank == 0:
            scaler = optimizer.scaler.state_dict() if optimizer is not None else None
            job.meta = {
                "format_version": FORMAT_VERSION,
                "iteration": iteration,
                "progress": asdict(train.progress),
                "tp_size": state.tp_size,
                "pp_size": state.pp_size,
                "dp_size": state.dp_size,
                "cp_size": state.cp_size,
                "ep_size": state.ep_size,
                "world_size": state.world_size,
                "device_type": state.device.type,
                "vocab_size": vocab_size,
                "padded_vocab_size": padded_vocab(model, state.tp_size),
                "seed": cfg.training.seed,
                "rng": True,
                "torch_version": torch.__version__,
                "lr_schedule": train.schedule.state_dict() if train.schedule is not None else None,
                "grad_scaler": copy.deepcopy(scaler),
                # Every stage's tensors, and the distributed optimizer's layouts of every
                # (TP, PP) rank, are added by write_and_publish.
                "distributed_optimizer": {"step": optimizer.shard_state()["step"]}
                if distributed
                else None,
                "config": to_dict(cfg),
            }
    except Exception as e:  # reported to every rank by write_and_publish
        job.error = e
    return job


def _from_rank0(value: Any, job: SaveJob, group: dist.ProcessGroup | None) -> Any:
    if job.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _to_rank0(value: Any, job: SaveJob, group: dist.ProcessGroup | None) -> list[Any] | None:
    if job.world_size == 1:
        return [value]
    out = [None] * job.world_size if job.rank == 0 else None
    dist.gather_object(value, out, dst=0, group=group)
    return out


class _Report(NamedTuple):
    """What a rank tells rank 0 once it has written: each file's checksum, its error (a repr) and,
    when that was storage refusing the write, ``refusal``'s (reason, fix); the bytes of tensors
    it had to write; its layouts for meta.json (``SaveJob.layout``, ``SaveJob.stage``)."""

    sums: dict[str, str]
    error: str | None
    refused: tuple[str, str] | None
    nbytes: int
    layout: tuple[int, dict[str, Any]] | None
    stage: tuple[int, dict[str, Any]] | None
    experts: tuple[int, dict[str, Any]] | None


def _full_meta(job: SaveJob, reports: list[_Report]) -> dict[str, Any]:
    """Rank 0's ``job.meta`` completed from every rank's report: sums, writers, layouts."""
    files = {n: s for r in reports for n, s in r.sums.items()}
    writers = {n: rank for rank, r in enumerate(reports) for n in r.sums}
    # Every stage's layouts in stage order (the tied word table's two copies: one entry).
    stages = sorted((r.stage for r in reports if r.stage is not None), key=lambda s: s[0])
    for p, experts in (r.experts for r in reports if r.experts is not None):
        stages[p][1].update(experts)  # one stage's keys: its expert files' with its own
    tensors = {key: info for _, layout in stages for key, info in layout.items()}
    meta = {**job.meta, "tensors": tensors, "stages": [list(lay) for _, lay in stages]}
    meta.update(files=dict(sorted(files.items())), writers=writers)
    layouts = sorted((r.layout for r in reports if r.layout is not None), key=lambda x: x[0])
    if layouts:
        sharded = {**meta["distributed_optimizer"], "layouts": [lay for _, lay in layouts]}
        meta["distributed_optimizer"] = sharded
    return meta


def _refused_line(job: SaveJob, refused: tuple[str, str], needed: int) -> str:
    """The one line of a save that storage refused: where, why, the bytes it needs and those
    free, what ``latest`` still names, and the fix."""
    reason, fix = refused
    path = os.path.join(job.save_dir, checkpoint_name(job.iteration))
    latest = find_latest(job.save_dir)
    kept = "no earlier checkpoint exists"
    if latest is not None:
        kept = f"{checkpoint_name(latest)} is still the latest"
    return (
        f"checkpoint.save: cannot write {path} ({reason}: needs about {mib(needed)}, "
        f"{mib(free_bytes(job.save_dir))} free); {kept}; {fix} or set checkpoint.save elsewhere"
    )


def write_and_publish(job: SaveJob, group: dist.ProcessGroup | None) -> str:
    """Write ``job``'s files, and (rank 0) publish the checkpoint once every rank has written.

    Collective over ``group`` (``coordination_group``), with the same three object collectives
    on every rank whatever fails. Returns the checkpoint's path; raises on every rank if any
    rank failed, after rank 0 has removed the temporary directory: a StorageError with one line
    for all if storage refused a write (full or read-only disk); else its own error on the rank
    that failed, a RuntimeError naming it elsewhere.
    """
    nonce = _from_rank0(f"{secrets.randbits(48):012x}", job, group)
    tmp = os.path.join(job.save_dir, f"{checkpoint_name(job.iteration)}.tmp-{nonce}")
    error, sums = job.error, {}
    if error is None:
        try:
            if job.ready is not None:
                job.ready()
            os.makedirs(tmp, exist_ok=True)
            # Each file on a thread of its own: one file's fsync overlaps the others' writes.
            workers = max(1, len(job.files))
            with ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-write") as pool:
                written = {
                    name: pool.submit(write_tensors, os.path.join(tmp, name), tensors, header)
                    for name, (tensors, header) in job.files.items()
                }
            sums = {name: future.result() for name, future in written.items()}
        except Exception as e:  # reported below, to every rank
            error = e
    nbytes = sum(t.nbytes for tensors, _ in job.files.values() for t in tensors.values())
    what = None if error is None else repr(error)
    report = _Report(sums, what, refusal(error), nbytes, job.layout, job.stage, job.experts)
    reports = _to_rank0(report, job, group)
    failure, refused = None, None
    if job.rank == 0:
        failed = [(r, rep) for r, rep in enumerate(reports) if rep.error is not None]
        if not failed:
            try:
                publish(tmp, job.save_dir, _full_meta(job, reports), job.keep_last)
            except Exception as e:  # reported below, to every rank
                error = e
                failed = [(0, report._replace(error=repr(e), refused=refusal(e)))]
        if failed:
            shutil.rmtree(tmp, ignore_errors=True)  # every rank is done writing into it
            failure = f"rank {failed[0][0]}: {failed[0][1].error}"
            refused = next((rep.refused for _, rep in failed if rep.refused), None)
            if refused is not None:
                failure = _refused_line(job, refused, sum(rep.nbytes for rep in reports))
    failure, refused = _from_rank0((failure, refused), job, group)
    if refused is not None:
        raise StorageError(failure) from error
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"checkpoint save of iteration {job.iteration} failed on {failure}")
    path = os.path.join(job.save_dir, checkpoint_name(job.iteration))
    if job.rank == 0:
        logger.info("saved checkpoint %s", path)
    return path


def save_checkpoint(
    save_dir: str, train: TrainState, cfg: Config, state: ParallelState, vocab_size: int
) -> str:
    """Save ``train`` as the checkpoint of its iteration under ``save_dir`` and point ``latest``
    at it; return its path.

    Collective: every rank calls it, with its own share of the state. ``train.progress`` comes
    back from load_checkpoint. Keeps the newest ``cfg.checkpoint.keep_last``. Consumes no random
    numbers, so a run that saves stays bit-identical to one that does not. Raises on every rank
    if any rank failed.
    """
    group = coordination_group(state)
    job = capture(save_dir, train, cfg, state, vocab_size)
    if state.device.type == "cuda":
        # The writer threads copy the live tensors to the host on streams of their own.
        job.ready = torch.cuda.current_stream(state.device).synchronize
    return write_and_publish(job, group)
