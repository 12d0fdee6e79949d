"""Publishing a written checkpoint: meta.json, the rename into place, ``latest``, and the clean-up
of older checkpoints and of what killed saves left; and ``save_offline``, a checkpoint composed in
one process (conversions, imports) written and published at once."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from megatron.atomic_file import free_bytes, fsync_path, mib, refusal, write_contents
from megatron.checkpoint.format import META, checkpoint_name
from megatron.checkpoint.load import LATEST, iterations
from megatron.checkpoint.streamed_file import write_tensors
from megatron.errors import StorageError

# What killed saves leave behind: unpublished directories, set-aside copies, pointer temp files.
_LEFTOVER = re.compile(r"iter_\d+\.(tmp|old|del)-[0-9a-f]+|latest\.tmp-.+")


def publish(tmp: str, save_dir: str, meta: dict[str, Any], keep_last: int | None) -> str:
    """Make the fully written, fsynced checkpoint in ``tmp`` the newest of ``save_dir``.

    ``meta`` (with ``files``: every file's checksum) goes to meta.json; the directory is renamed
    into place and ``save_dir`` fsynced; only then is ``latest`` replaced (if that fails, the
    directory goes back to ``tmp`` before the error is raised). Last, checkpoints older than the
    newest ``keep_last`` and leftovers of killed saves are removed. Returns the path.
    """
    write_contents(os.path.join(tmp, META), json.dumps(meta, indent=1) + "\n")
    final = os.path.join(save_dir, checkpoint_name(meta["iteration"]))
    aside = f"{final}.old-{tmp.rsplit('-', 1)[1]}"
    if os.path.exists(final):
        # Saving an iteration again (an exit right after resuming): the old copy steps aside,
        # so no reader ever sees a directory that is half one save and half the other.
        os.rename(final, aside)
    os.rename(tmp, final)
    try:
        fsync_path(save_dir)
        write_contents(os.path.join(save_dir, LATEST), f"{meta['iteration']}\n")
    except OSError:
        # ``latest`` could not move (a full disk): unpublish, so the newest iter_* stays the
        # one it names. Renames need no space.
        os.rename(final, tmp)
        if os.path.exists(aside):
            os.rename(aside, final)
        raise
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


def save_offline(
    save_dir: str, meta: dict[str, Any], files: Iterable[tuple[str, dict[str, Tensor]]]
) -> str:
    """Publish a checkpoint composed in one process, without process groups (conversions,
    imports), as the newest of ``save_dir``; returns its path.

    ``files`` yields (name, tensors) one file at a time, so only one is held in memory; ``meta``
    is meta.json, whose ``files`` (the checksum of each file) are filled in here. Atomic like every
    save: nothing appears under ``iter_*`` or in ``latest`` until every file is written, and a
    save that fails removes its temporary directory. Where storage refused a write (a full or
    read-only disk) that is a one-line StorageError naming the checkpoint, the bytes it needs
    (``meta``'s ``tensors``, in each of its ``tp_size`` files) and those free.
    """
    final = os.path.join(save_dir, checkpoint_name(meta["iteration"]))
    tmp = f"{final}.tmp-{secrets.token_hex(6)}"
    try:
        os.makedirs(tmp)
        sums = {n: write_tensors(os.path.join(tmp, n), tensors) for n, tensors in files}
        return publish(tmp, save_dir, {**meta, "files": sums}, keep_last=None)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)  # before the free bytes are counted
        refused = refusal(error)
        if refused is None:
            raise
        reason, fix = refused
        needed = sum(
            torch.Size(info["shape"]).numel()
            * getattr(torch, info["dtype"]).itemsize
            * (meta["tp_size"] if info["split_dim"] is None else 1)  # replicated: in every file
            for info in meta["tensors"].values()
        )
        raise StorageError(
            f"cannot write {final} ({reason}: needs about {mib(needed)}, "
            f"{mib(free_bytes(save_dir))} free); nothing of it is left; {fix} or write it elsewhere"
        ) from error
