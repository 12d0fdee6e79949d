"""On-disk cache of dataset indices: built once per node, then memory-mapped by every rank.

A cache entry is a set of ``.npy`` arrays plus a JSON description, all named by a hash of the key
that determines them (``{kind}-{digest}-{name}.npy``, ``{kind}-{digest}.json``). The description
is written last, so its presence means every array is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import BinaryIO

import numpy as np
import torch

from megatron.atomic_file import refusal, write_atomic
from megatron.data.indexed_dataset import index_path
from megatron.errors import ConfigError, StorageError
from megatron.parallel.launcher import launcher_env

logger = logging.getLogger(__name__)


def dataset_fingerprint(prefix: str) -> str:
    """A digest of the ``.idx`` file: the indices depend on the sequence lengths, not the tokens."""
    with open(index_path(prefix), "rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()


def _is_builder() -> bool:
    """One process per node builds caches: LOCAL_RANK 0, or every process when not distributed."""
    return not torch.distributed.is_initialized() or launcher_env()["LOCAL_RANK"] == "0"


def _write_atomic(path: str, write: Callable[[BinaryIO], None]) -> None:
    def to_file(tmp: str) -> None:
        with open(tmp, "wb") as f:
            write(f)

    write_atomic(path, to_file)


def _entry_base(cache_dir: str, kind: str, key: dict) -> str:
    """The path, without suffix, of the entry for ``key``: ``{cache_dir}/{kind}-{digest}``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(cache_dir, f"{kind}-{digest}")


def is_cached(cache_dir: str | None, kind: str, key: dict) -> bool:
    """Whether a complete entry for ``key`` exists (its JSON description, written last)."""
    return cache_dir is not None and os.path.isfile(_entry_base(cache_dir, kind, key) + ".json")


def cached_indices(
    cache_dir: str | None,
    kind: str,
    key: dict,
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """Arrays ``names`` from ``build()``, cached under ``cache_dir`` by a hash of ``key``.

    ``key`` must hold everything that determines the arrays. The node's builder (LOCAL_RANK 0, or
    every process when torch.distributed is not initialised) builds them if missing and writes
    each atomically, the JSON description last; then all ranks meet at a barrier and memory-map
    the files. Without a cache_dir the arrays are built in memory on every rank.
    """
    if cache_dir is None:
        return build()
    base = _entry_base(cache_dir, kind, key)
    paths = {name: f"{base}-{name}.npy" for name in names}
    description = base + ".json"
    refused = None  # storage's refusal to the builder, raised after the barrier it must meet
    if _is_builder() and not os.path.isfile(description):
        start = time.perf_counter()
        arrays = build()
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for name in names:
                array = arrays[name]
                _write_atomic(paths[name], lambda f, a=array: np.save(f, a, allow_pickle=False))
            # the description goes last: its presence means every array is in place
            text = json.dumps(key, indent=1, sort_keys=True).encode()
            _write_atomic(description, lambda f: f.write(text))
        except OSError as err:
            if (reason := refusal(err)) is None:
                raise
            refused = StorageError(
                f"data.cache_dir: cannot write {cache_dir} ({reason[0]}); {reason[1]} or set "
                "data.cache_dir to another directory"
            )
        else:
            logger.info("built %s indices in %.3f s: %s", kind, time.perf_counter() - start, base)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # the builder's files must exist before anyone maps them
    if refused is not None:
        raise refused
    if not os.path.isfile(description):
        raise ConfigError(
            f"{description}: index cache missing after the build; data.cache_dir must be a "
            "directory every process on a node can see"
        )
    return {name: np.load(paths[name], mmap_mode="r") for name in names}
