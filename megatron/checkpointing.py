"""Checkpoints: one tensor file per TP rank, written atomically, verified on load, reshardable.

    save_dir/
      latest                          "100\\n": replaced atomically after every rank has finished
      iter_0000100/
        meta.json                     resolved config, iteration, progress, TP/DP sizes, vocab
                                      sizes, each tensor's split dim and full shape, LR schedule,
                                      loss scaler, versions, and the sha256 of every other file
        model_optim_tp00.safetensors  TP rank t's slices of the weights and of the optimizer's
        model_optim_tp01.safetensors  main params, moments and steps (from DP rank 0 of TP rank t)
        rng_rank00000.safetensors     each rank's torch CPU/CUDA and TP-tracker states (tensors),
        ...                           python's and numpy's (JSON in the file's header)

Save (collective): rank 0 draws a nonce and broadcasts it; each rank writes and fsyncs its files in
``iter_0000100.tmp-<nonce>/``; rank 0 gathers their sha256 sums, writes meta.json, renames the
directory into place, fsyncs ``save_dir``, and only then replaces ``latest``. A process killed at
any point leaves ``latest`` naming the previous complete checkpoint.

Load (collective): ``latest``'s iteration, then older ``iter_*``, newest first; the first whose
meta.json parses and whose files match their sha256 (each rank hashes a share) is used, with a
warning for each one passed over. Tensors go through safetensors, the rest is JSON: nothing is
ever unpickled.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
import re
import secrets
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn

from megatron.atomic_file import fsync_path
from megatron.checkpoint_reshard import (
    FORMAT_VERSION,
    META,
    check_files,
    checkpoint_name,
    open_safetensors,
    padded_vocab,
    read_meta,
    read_state,
    rng_file,
    sha256_file,
    shard_file,
    shard_tensors,
    tensor_layout,
)
from megatron.config import Config, to_dict
from megatron.errors import ConfigError
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState

logger = logging.getLogger(__name__)

LATEST = "latest"
_ITER = re.compile(r"iter_(\d+)")
# What killed saves leave behind: unpublished directories, set-aside copies, pointer temp files.
_LEFTOVER = re.compile(r"iter_\d+\.(tmp|old|del)-[0-9a-f]+|latest\.tmp-\d+")
_T = TypeVar("_T")


def write_text(path: str, text: str) -> None:
    """Write under a temp name, fsync, os.replace onto ``path``, fsync its directory."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")


def write_tensors(
    path: str, tensors: dict[str, Tensor], header: dict[str, str] | None = None
) -> str:
    """Write a safetensors file, fsync it, return its sha256."""
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path, header)
    fsync_path(path)
    return sha256_file(path)


def iterations(save_dir: str) -> list[int]:
    """Iterations of the published ``iter_*`` directories in ``save_dir``, ascending."""
    found = [_ITER.fullmatch(n) for n in os.listdir(save_dir)]
    return sorted(
        int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(save_dir, m[0]))
    )


def publish(tmp: str, save_dir: str, meta: dict[str, Any], keep_last: int | None) -> str:
    """Make the fully written, fsynced checkpoint in ``tmp`` the newest of ``save_dir``.

    ``meta`` (with ``files``: every file's sha256) goes to meta.json; the directory is renamed
    into place and ``save_dir`` fsynced; only then is ``latest`` replaced. Last, checkpoints older
    than the newest ``keep_last`` and leftovers of killed saves are removed. Returns the path.
    """
    write_text(os.path.join(tmp, META), json.dumps(meta, indent=1) + "\n")
    final = os.path.join(save_dir, checkpoint_name(meta["iteration"]))
    if os.path.exists(final):
        # Saving an iteration again (an exit right after resuming): the old copy steps aside,
        # so no reader ever sees a directory that is half one save and half the other.
        os.rename(final, f"{final}.old-{tmp.rsplit('-', 1)[1]}")
    os.rename(tmp, final)
    fsync_path(save_dir)
    write_text(os.path.join(save_dir, LATEST), f"{meta['iteration']}\n")
    for name in os.listdir(save_dir):
        if _LEFTOVER.fullmatch(name):
            path = os.path.join(save_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    if keep_last:
        older = [i for i in iterations(save_dir) if i < meta["iteration"]][::-1]
        for it in older[keep_last - 1 :]:
            path = os.path.join(save_dir, checkpoint_name(it))
            # Renamed first: a deletion cut short must not leave a half-present iter_* behind.
            os.rename(path, f"{path}.del-{os.getpid():x}")
            shutil.rmtree(f"{path}.del-{os.getpid():x}")
    return final


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


def _on_every_rank(state: ParallelState, what: str, fn: Callable[[], _T]) -> _T:
    """``fn()``; if it raised on any rank, raise on every rank, so none waits in a collective."""
    try:
        result, error = fn(), None
    except Exception as e:  # re-raised below, after every rank knows
        result, error = None, e
    if _any_rank(error is not None, state):
        if error is not None:
            raise error
        raise RuntimeError(f"{what} failed on another rank; see that rank's error")
    return result


def _rng_state(state: ParallelState, tracker: RNGTracker | None) -> tuple[dict, dict[str, str]]:
    """(tensors, header): torch CPU/CUDA and tracker states; python and numpy states as JSON."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and state.device.type == "cuda":
        tensors["cuda"] = torch.cuda.get_rng_state(state.device)
    if tracker is not None and tracker.tp_state is not None:
        tensors.update({f"tracker/{k}": v for k, v in tracker.state_dict().items()})
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    header = {
        "python": json.dumps([version, list(mt), gauss]),
        "numpy": json.dumps([name, keys.tolist(), pos, has_gauss, cached]),
    }
    return tensors, header


def _set_rng_state(tensors: dict[str, Tensor], header: dict[str, str], tracker: RNGTracker) -> None:
    version, mt, gauss = json.loads(header["python"])
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = json.loads(header["numpy"])
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if "cuda" in tensors:
        torch.cuda.set_rng_state(tensors["cuda"], tracker.generator.device)
    if "tracker/tp" in tensors:
        tracker.load_state_dict({"shared": tensors["tracker/shared"], "tp": tensors["tracker/tp"]})


def reseed(seed: int, iteration: int) -> int:
    """A seed for a resumed run whose saved RNG states do not fit: a function of both numbers."""
    return int(np.random.SeedSequence([seed, iteration]).generate_state(1)[0])


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model: nn.Module,
    optimizer: Any,
    lr_schedule: Any,
    tracker: RNGTracker,
    progress: dict[str, int],
    cfg: Config,
    state: ParallelState,
    vocab_size: int,
) -> str:
    """Save checkpoint ``iteration`` under ``save_dir`` and point ``latest`` at it; return its path.

    Collective: every rank calls it, with its own model/optimizer slices. ``progress`` (the loop's
    iteration, consumed samples, counters) must be JSON-able; it comes back from load_checkpoint.
    Keeps the newest ``cfg.checkpoint.keep_last``. Consumes no random numbers, so a run that
    saves stays bit-identical to one that does not. Raises on every rank if any rank failed.
    """
    nonce = f"{_broadcast_ints([secrets.randbits(48)], state)[0]:012x}"
    tmp = os.path.join(save_dir, f"{checkpoint_name(iteration)}.tmp-{nonce}")
    tensors = shard_tensors(model, optimizer) if state.dp_rank == 0 else {}

    def write() -> dict[str, str]:
        os.makedirs(tmp, exist_ok=True)
        sums = {}
        if state.dp_rank == 0:
            sums[shard_file(state.tp_rank)] = write_tensors(
                os.path.join(tmp, shard_file(state.tp_rank)), tensors
            )
        rng, header = _rng_state(state, tracker)
        sums[rng_file(state.rank)] = write_tensors(
            os.path.join(tmp, rng_file(state.rank)), rng, header
        )
        return sums

    sums = _on_every_rank(state, "checkpoint save", write)
    gathered = [sums]
    if state.world_size > 1:
        gathered = [None] * state.world_size if state.rank == 0 else None
        dist.gather_object(sums, gathered, dst=0)

    def finish() -> str:
        if state.rank != 0:
            return os.path.join(save_dir, checkpoint_name(iteration))
        scaler = optimizer.state_dict()["grad_scaler"] if optimizer is not None else None
        meta = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "progress": dict(progress),
            "tp_size": state.tp_size,
            "dp_size": state.dp_size,
            "world_size": state.world_size,
            "device_type": state.device.type,
            "vocab_size": vocab_size,
            "padded_vocab_size": padded_vocab(model, state.tp_size),
            "seed": cfg.training.seed,
            "rng": True,
            "torch_version": torch.__version__,
            "lr_schedule": lr_schedule.state_dict() if lr_schedule is not None else None,
            "grad_scaler": scaler,
            "tensors": tensor_layout(tensors, model, state.tp_size),
            "files": {name: s for part in gathered for name, s in sorted(part.items())},
            "config": to_dict(cfg),
        }
        return publish(tmp, save_dir, meta, cfg.checkpoint.keep_last)

    path = _on_every_rank(state, "checkpoint save", finish)
    if state.rank == 0:
        logger.info("saved checkpoint %s", path)
    return path


def find_latest(load_dir: str) -> int | None:
    """The iteration ``load_dir/latest`` names; None when there is none (nothing saved yet)."""
    path = os.path.join(load_dir, LATEST)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
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


def _select(load_dir: str, state: ParallelState) -> tuple[str, dict[str, Any]]:
    """The newest intact checkpoint; every rank hashes a share of each candidate's files."""
    its = _broadcast_ints(candidates(load_dir), state)
    if state.rank == 0 and find_latest(load_dir) is None:
        logger.warning(
            "%s has no latest file; trying its iter_* directories, newest first", load_dir
        )
    for it in its:
        path = checkpoint_dir(load_dir, it)
        try:
            meta = read_meta(path)
            problem = check_files(path, meta, sorted(meta["files"])[state.rank :: state.world_size])
            if problem:
                logger.warning("%s", problem)
        except ConfigError as e:
            meta, problem = None, str(e)
            if state.rank == 0:  # every rank found the same, one says it
                logger.warning("%s", problem)
        if not _any_rank(problem is not None, state):
            return path, meta
        if state.rank == 0:
            logger.warning("checkpoint %s is incomplete or corrupt; trying the previous one", path)
    raise ConfigError(
        f"checkpoint.load: no intact checkpoint in {load_dir} (see the warnings above); restore "
        "one, or unset checkpoint.load to start from scratch"
    )


def _read_rng(path: str, meta: dict[str, Any], state: ParallelState) -> tuple[dict, dict] | None:
    """This rank's saved RNG states; None when they belong to another world or device."""
    here = (state.tp_size, state.dp_size, state.device.type)
    if not meta["rng"] or (meta["tp_size"], meta["dp_size"], meta["device_type"]) != here:
        return None
    f = open_safetensors(os.path.join(path, rng_file(state.rank)))
    return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def load_checkpoint(
    load_dir: str,
    model: nn.Module,
    optimizer: Any | None,
    lr_schedule: Any | None,
    tracker: RNGTracker | None,
    state: ParallelState,
    vocab_size: int,
    finetune: bool = False,
) -> dict[str, int] | None:
    """Load the newest intact checkpoint of ``load_dir`` into the given objects (collective).

    Returns the saved ``progress`` (with ``iteration``). ``finetune``: weights only, and None,
    since nothing is resumed. A checkpoint saved at another TP size is resharded on the fly; at
    another TP/DP size or device the RNG states cannot carry over and are reseeded from (seed,
    iteration) with a warning. Raises ConfigError naming ``checkpoint.load`` when ``load_dir``
    is missing or holds no intact checkpoint: a requested resume never silently starts fresh.
    """
    path, meta = _select(load_dir, state)

    def read() -> tuple[dict, dict, tuple | None]:
        if meta["vocab_size"] != vocab_size:
            raise ConfigError(
                f"{path} was saved for a vocabulary of {meta['vocab_size']} tokens, the tokenizer "
                f"has {vocab_size}; use the tokenizer the checkpoint was trained with"
            )
        files = [os.path.join(path, shard_file(t)) for t in range(meta["tp_size"])]
        weights, entries = read_state(files, meta, model, None if finetune else optimizer, state)
        rng = None if finetune or tracker is None else _read_rng(path, meta, state)
        return weights, entries, rng

    weights, entries, rng = _on_every_rank(state, "checkpoint load", read)
    model.load_state_dict(weights)
    if finetune:
        if optimizer is not None:
            optimizer.reload_main_params()
        if state.rank == 0:
            logger.info("loaded the weights of %s", path)
        return None
    if optimizer is not None:
        scaler = meta["grad_scaler"] or optimizer.state_dict()["grad_scaler"]
        optimizer.load_state_dict({"params": entries, "grad_scaler": scaler})
    if lr_schedule is not None and meta["lr_schedule"] is not None:
        lr_schedule.load_state_dict(meta["lr_schedule"])
    if tracker is not None:
        if rng is not None:
            _set_rng_state(*rng, tracker)
        else:
            if state.rank == 0:
                logger.warning(
                    "%s was saved at TP=%d x DP=%d on %s, this run is TP=%d x DP=%d on %s: RNG "
                    "states cannot carry over; reseeding from (seed=%d, iteration=%d)",
                    path, meta["tp_size"], meta["dp_size"], meta["device_type"],
                    state.tp_size, state.dp_size, state.device.type,
                    meta["seed"], meta["iteration"],
                )  # fmt: skip
            tracker.seed(reseed(meta["seed"], meta["iteration"]), state.tp_rank)
    if state.rank == 0:
        logger.info("loaded checkpoint %s (iteration %d)", path, meta["iteration"])
    return {"iteration": meta["iteration"], **meta["progress"]}
