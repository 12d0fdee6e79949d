"""Loading checkpoints: which one (the newest intact), and restoring every object from it.

Load (collective): ``latest``'s iteration, then older ``iter_*``, newest first; the first whose
meta.json parses and whose files match their checksums (each rank hashes a share, while it reads
the tensors) is used, with a warning for each one passed over. One checkpoint directory
(``iter_*``) given instead of a save directory is that checkpoint alone. Tensors go through
safetensors, the rest is JSON: nothing is ever unpickled.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron.checkpoint.format import (
    META,
    check_files,
    checkpoint_name,
    cp_size_of,
    open_safetensors,
    pp_size_of,
    read_meta,
    rng_file,
)
from megatron.checkpoint.optim_shards import own_shard_file
from megatron.checkpoint.read_through import DamagedFile, FileClaims, read_file
from megatron.checkpoint.reshard import read_state
from megatron.checkpoint.rng import reseed, set_rng_state
from megatron.checkpoint.stages import open_checkpoint
from megatron.checkpoint.train_state import Progress, TrainState
from megatron.errors import ConfigError
from megatron.parallel.state import ParallelState

logger = logging.getLogger("megatron.checkpoint.save")

LATEST = "latest"
_ITER = re.compile(r"iter_(\d+)")
_T = TypeVar("_T")


def iterations(save_dir: str) -> list[int]:
    """Iterations of the published ``iter_*`` directories in ``save_dir``, ascending."""
    found = [_ITER.fullmatch(n) for n in os.listdir(save_dir)]
    return sorted(
        int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(save_dir, m[0]))
    )


def find_latest(load_dir: str) -> int | None:
    """The iteration ``load_dir/latest`` names; None when there is none (nothing saved yet)."""
    path = os.path.join(load_dir, LATEST)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        raise ConfigError(
            f"{path} is a directory, not the file naming the latest checkpoint; remove it to "
            "resume from the newest complete iter_* directory"
        ) from None
    if not text.strip().isdigit():
        raise ConfigError(
            f"{path} holds {text[:20]!r}, not an iteration; delete it to resume from the newest "
            "complete iter_* directory"
        )
    return int(text)


def candidates(load_dir: str) -> list[int]:
    """Iterations to try, best first: ``latest``'s, then the older ``iter_*`` directories."""
    if not os.path.isdir(load_dir):
        raise ConfigError(
            f"checkpoint.load: {load_dir} not found; fix the path, or unset checkpoint.load to "
            "start from scratch"
        )
    latest, found = find_latest(load_dir), iterations(load_dir)[::-1]
    if latest is not None:
        return [latest] + [i for i in found if i < latest]
    if not found:
        raise ConfigError(
            f"checkpoint.load: {load_dir} holds no checkpoint (no latest file, no iter_* "
            "directory); point it at a save directory, or unset it to start from scratch"
        )
    return found


def checkpoint_dir(load_dir: str, iteration: int) -> str:
    """``iter_*`` of ``iteration``; if a save of the same iteration was killed between moving
    the old copy aside and renaming the new one into place, the copy it set aside."""
    path = os.path.join(load_dir, checkpoint_name(iteration))
    aside = sorted(glob.glob(glob.escape(path) + ".old-*"))
    return aside[-1] if aside and not os.path.isdir(path) else path


def _is_checkpoint(path: str) -> bool:
    """Whether ``path`` is one checkpoint (an ``iter_*`` directory), not a save directory."""
    return os.path.isfile(os.path.join(path, META))


# What a tool's checkpoint flag accepts, for its errors.
_ACCEPTED = (
    "give a save directory (with latest or iter_*), one iter_* directory, or what "
    "tools/checkpoint_util.py wrote"
)


def _contents(path: str) -> str:
    """What a directory that holds no checkpoint holds instead, and the save directories in it."""
    names = sorted(os.listdir(path))
    if not names:
        return "it is empty"
    shown = [n + "/" if os.path.isdir(os.path.join(path, n)) else n for n in names[:6]]
    text = "it holds " + ", ".join(shown) + (", ..." if len(names) > 6 else "")
    inner = [n for n in names if os.path.isfile(os.path.join(path, n, LATEST))]
    return text + (f"; its {inner[0]}/ is a save directory" if inner else "")


def find_checkpoint(
    path: str, iteration: int | None = None, flag: str = "--load"
) -> tuple[str, dict[str, Any]]:
    """(directory, meta) of the checkpoint a tool's ``flag`` names, read without a process group
    or checksums: ``path`` itself when it is one checkpoint, else from the save directory ``path``
    (a run's, or what tools/checkpoint_util.py wrote) ``iteration``'s or the newest whose
    meta.json reads. ConfigError (one line naming ``flag``, what ``path`` holds and what is
    accepted) for anything else."""
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: no such directory; {_ACCEPTED}")
    if _is_checkpoint(path):
        return path, read_meta(path)
    if iteration is not None:
        ckpt = checkpoint_dir(path, iteration)
        if not os.path.isdir(ckpt):
            have = iterations(path)
            newest = f"the newest is {have[-1]}" if have else "it has none"
            raise ConfigError(
                f"{flag} {path}: no checkpoint of iteration {iteration} ({newest}); fix --iteration"
            )
        return ckpt, read_meta(ckpt)
    if find_latest(path) is None and not iterations(path):
        raise ConfigError(f"{flag} {path} holds no checkpoint ({_contents(path)}); {_ACCEPTED}")
    problems = []
    for ckpt in (checkpoint_dir(path, it) for it in candidates(path)):
        try:
            return ckpt, read_meta(ckpt)
        except ConfigError as e:
            problems.append(str(e))
    raise ConfigError(f"{flag} {path}: no readable checkpoint ({problems[0]})")


def _any_rank(flag: bool, state: ParallelState) -> bool:
    """True on every rank when ``flag`` is True on some rank (one tiny all-reduce)."""
    if state.world_size == 1:
        return flag
    t = torch.tensor([int(flag)], device=state.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _broadcast_ints(values: list[int], state: ParallelState) -> list[int]:
    """Rank 0's list of ints, on every rank."""
    if state.world_size == 1:
        return values
    n = torch.tensor([len(values)], dtype=torch.int64, device=state.device)
    dist.broadcast(n, src=0)
    if not n.item():
        return []
    t = torch.tensor(values if state.rank == 0 else [0] * n.item(), device=state.device)
    dist.broadcast(t, src=0)
    return t.tolist()


def _check_unclaimed(
    path: str, meta: dict[str, Any], share: list[str], claims: FileClaims
) -> str | None:
    """``check_files`` on the files of ``share`` that no read verified as it went."""
    claims.planned.wait()
    return check_files(path, meta, [name for name in share if claims.claim(name)])


def _select(
    load_dir: str, state: ParallelState, read: Callable[[str, dict[str, Any], FileClaims], _T]
) -> tuple[str, dict[str, Any], _T]:
    """The newest intact checkpoint of a save directory, or ``load_dir`` itself if it is one
    checkpoint and intact, as (path, meta, ``read(path, meta, claims)``); every rank hashes a
    share of each candidate's files. If ``read`` raised on any rank, it raises on every rank.

    ``read`` verifies the files it reads whole as their bytes arrive (those it ``claims``), and
    another thread hashes the rest of this rank's share meanwhile: checking costs no pass over
    the files of its own, and what ``read`` took from a candidate that fails the check is
    dropped (a later candidate overwrites all of it).
    A missing file or an unreadable meta.json is seen alike by every rank, so when no candidate
    is intact the error names the newest one's problem (a checksum mismatch only its hasher saw
    is in that rank's warning).
    """
    if _is_checkpoint(load_dir):  # named on purpose: no older one to fall back on
        paths = [load_dir]
    else:
        paths = [
            checkpoint_dir(load_dir, it) for it in _broadcast_ints(candidates(load_dir), state)
        ]
        if state.rank == 0 and find_latest(load_dir) is None:
            logger.warning(
                "%s has no latest file; trying its iter_* directories, newest first", load_dir
            )
    newest = None
    for path in paths:
        result, error = None, None
        try:
            meta = read_meta(path)
            # Missing files every rank checks alike (reading nothing, so all agree on the line).
            alike = check_files(path, meta, sorted(meta["files"]), hashes=False)
        except ConfigError as e:
            meta, alike = None, str(e)
        problem = alike
        if alike is None:
            share = sorted(meta["files"])[state.rank :: state.world_size]
            claims = FileClaims()
            with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-verify") as pool:
                hashing = pool.submit(_check_unclaimed, path, meta, share, claims)
                try:
                    result = read(path, meta, claims)
                except DamagedFile as e:  # a file checked as it was read
                    problem = str(e)
                except Exception as e:  # raised below on every rank, if the checkpoint is intact
                    error = e
                finally:
                    claims.planned.set()
                problem = hashing.result() or problem
        if problem and (alike is None or state.rank == 0):  # what all ranks found, one says
            logger.warning("%s", problem)
        if not _any_rank(problem is not None, state):
            if _any_rank(error is not None, state):
                if error is not None:
                    raise error
                raise RuntimeError("checkpoint load failed on another rank; see that rank's error")
            return path, meta, result
        newest = newest or alike or "see the warnings above"
        if state.rank == 0:
            logger.warning("checkpoint %s is incomplete or corrupt; trying the previous one", path)
    raise ConfigError(
        f"checkpoint.load: no intact checkpoint in {load_dir} (the newest: {newest}); restore "
        "one, or unset checkpoint.load to start from scratch"
    )


def _read_rng(
    path: str, meta: dict[str, Any], state: ParallelState
) -> tuple[dict[str, Tensor], dict[str, str]] | None:
    """This rank's saved RNG states; None when they belong to another world or device."""
    here = (state.tp_size, state.pp_size, state.dp_size, state.cp_size, state.device.type)
    saved = (meta["tp_size"], pp_size_of(meta), meta["dp_size"], cp_size_of(meta))
    saved += (meta["device_type"],)
    if not meta["rng"] or saved != here:
        return None
    f = open_safetensors(os.path.join(path, rng_file(state.rank)))
    return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _whole_model_keys(model: nn.Module, state: ParallelState) -> set[str]:
    """The state-dict keys of every stage of this rank's pipeline (collective over its PP group
    when PP > 1): what a checkpoint may hold, where one stage holds only part of it."""
    keys = set(model.state_dict())
    if state.pp_size == 1:
        return keys
    every: list[set[str] | None] = [None] * state.pp_size
    dist.all_gather_object(every, keys, group=state.pp_group)
    return set().union(*every)


def load_checkpoint(
    load_dir: str, train: TrainState, state: ParallelState, vocab_size: int, finetune: bool = False
) -> None:
    """Load the newest intact checkpoint of the save directory ``load_dir`` (or ``load_dir``
    itself, one ``iter_*`` directory) into ``train`` (collective).

    Restores the model, and each of the optimizer (with its loss scaler), the LR schedule and
    the RNG tracker that ``train`` holds, and replaces ``train.progress`` with the saved one.
    ``finetune``: the weights only; nothing else is resumed. A checkpoint saved at another TP or
    PP size is resharded on the fly (megatron.checkpoint.stages); at another TP/PP/DP size or
    device the RNG states cannot carry over and are reseeded from (seed, iteration) with a
    warning. Raises ConfigError naming ``checkpoint.load`` when ``load_dir`` is missing or holds
    no intact checkpoint: a requested resume never silently starts fresh.
    """
    model, optimizer, tracker = train.model, train.optimizer, train.tracker
    model_keys = _whole_model_keys(model, state)

    def read(path: str, meta: dict[str, Any], claims: FileClaims) -> tuple[dict, dict, Any]:
        if meta["vocab_size"] != vocab_size:
            raise ConfigError(
                f"{path} was saved for a vocabulary of {meta['vocab_size']} tokens, the tokenizer "
                f"has {vocab_size}; use the tokenizer the checkpoint was trained with"
            )
        optimizer_state = None if finetune else optimizer
        own = own_shard_file(meta, optimizer_state, state)
        verify = own is not None and claims.claim(own)  # before read_state lets the hasher go
        source = open_checkpoint(path, meta, optimizer_state is not None and own is None, claims)
        weights, entries = read_state(
            source, path, meta, model, None if own else optimizer_state, state, model_keys
        )
        shard = None
        if own is not None:
            into = {k: t if t.device.type == "cpu" else None for k, t in optimizer.shard.items()}
            recorded = meta["files"][own] if verify else None
            shard = read_file(os.path.join(path, own), recorded, into)
        rng = None if finetune or tracker is None else _read_rng(path, meta, state)
        return weights, (entries, shard), rng

    path, meta, (weights, (entries, shard), rng) = _select(load_dir, state, read)
    model.load_state_dict(weights)
    if finetune:
        if optimizer is not None:
            optimizer.reload_main_params()
        if state.rank == 0:
            logger.info("loaded the weights of %s", path)
        return
    if optimizer is not None:
        scaler = meta["grad_scaler"] or optimizer.scaler.state_dict()
        if shard is not None:
            optimizer.load_shard(shard, meta["distributed_optimizer"]["step"], scaler)
        else:
            optimizer.load_state_dict({"params": entries, "grad_scaler": scaler})
    if train.schedule is not None and meta["lr_schedule"] is not None:
        changed = train.schedule.load_state_dict(meta["lr_schedule"])
        if changed and state.rank == 0:
            logger.warning(
                "learning-rate settings differ from the checkpoint's %s; using the config's",
                changed,
            )
    if tracker is not None:
        if rng is not None:
            set_rng_state(*rng, tracker)
        else:
            if state.rank == 0:
                logger.warning(
                    "%s was saved at TP=%d x DP=%d x CP=%d x PP=%d on %s, this run is TP=%d x "
                    "DP=%d x CP=%d x PP=%d on %s: RNG states cannot carry over; reseeding from "
                    "(seed=%d, iteration=%d)",
                    path, meta["tp_size"], meta["dp_size"], cp_size_of(meta), pp_size_of(meta),
                    meta["device_type"], state.tp_size, state.dp_size, state.cp_size,
                    state.pp_size, state.device.type,
                    meta["seed"], meta["iteration"],
                )  # fmt: skip
            tracker.seed(reseed(meta["seed"], meta["iteration"]), state.tp_rank)
    if state.rank == 0:
        logger.info("loaded checkpoint %s (iteration %d)", path, meta["iteration"])
    train.progress = Progress.restore({"iteration": meta["iteration"], **meta["progress"]})
