"""A checkpoint directory's names and its meta.json: which files a checkpoint holds, and the checks
that they are all there and intact."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash
from safetensors import SafetensorError, safe_open

from megatron.errors import ConfigError

FORMAT_VERSION = 1
# The checksum new checkpoints record for each file, as ``xxh3_128:<hex>`` in meta.json's
# ``files``. XXH3-128 catches corruption (flipped bits, torn or truncated writes) but, not being
# cryptographic, no adversary who crafts a collision; it hashes ~30 GB/s a core to sha256's ~2.
# A bare hex checksum is sha256: what checkpoints saved before XXH3 recorded, still verified.
CHECKSUM = "xxh3_128"
_DIGESTS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}  # both hash without the GIL
# Files hashed at once: past the cores there are, more threads only add contention.
_HASHERS = os.cpu_count() or 1

META = "meta.json"

# What every reader of meta.json relies on.
_META_KEYS = """iteration progress tp_size dp_size world_size device_type vocab_size seed rng
    lr_schedule grad_scaler tensors files config""".split()


def checkpoint_name(iteration: int) -> str:
    """``iter_0000100``: the directory of one checkpoint."""
    return f"iter_{iteration:07d}"


def _stage_tag(pp_rank: int, pp_size: int) -> str:
    # At PP = 1 the names stay those of checkpoints saved before pipeline parallelism.
    return f"_pp{pp_rank:03d}" if pp_size > 1 else ""


def shard_file(tp_rank: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The tensor file of one (TP, PP) rank's model and optimizer slices."""
    return f"model_optim_tp{tp_rank:02d}{_stage_tag(pp_rank, pp_size)}.safetensors"


def optim_file(tp_rank: int, dp_rank: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The file of one (TP, PP, DP) rank's distributed-optimizer shard; with context
    parallelism ``dp_rank`` is the rank's place among the DP x CP replicas it shards over."""
    return f"optim_tp{tp_rank:02d}{_stage_tag(pp_rank, pp_size)}_dp{dp_rank:03d}.safetensors"


def expert_file(tp_rank: int, ep_rank: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The tensor file of one (TP, PP, EP) rank's experts (weights and optimizer state), saved at
    expert parallelism > 1; the (TP, PP) file then holds the rest of the model."""
    return f"experts_tp{tp_rank:02d}{_stage_tag(pp_rank, pp_size)}_ep{ep_rank:03d}.safetensors"


def ep_size_of(meta: dict[str, Any]) -> int:
    """The expert-parallel size a checkpoint was saved at (1 for those saved before EP)."""
    return meta.get("ep_size", 1)


def pp_size_of(meta: dict[str, Any]) -> int:
    """The pipeline size a checkpoint was saved at (1 for those saved before PP existed)."""
    return meta.get("pp_size", 1)


def cp_size_of(meta: dict[str, Any]) -> int:
    """The context-parallel size a checkpoint was saved at (1 for those saved before CP)."""
    return meta.get("cp_size", 1)


def stage_files(meta: dict[str, Any], pp_rank: int) -> list[str]:
    """The tensor files of one saved pipeline stage, one per saved TP rank."""
    return [shard_file(t, pp_rank, pp_size_of(meta)) for t in range(meta["tp_size"])]


def stage_expert_files(meta: dict[str, Any], pp_rank: int) -> list[list[str]]:
    """The expert files of one saved pipeline stage, [EP rank][TP rank]; [] at EP 1 (the
    experts are then in ``stage_files``)."""
    ep, tp, pp = ep_size_of(meta), meta["tp_size"], pp_size_of(meta)
    if ep == 1:
        return []
    return [[expert_file(t, e, pp_rank, pp) for t in range(tp)] for e in range(ep)]


def optim_files(meta: dict[str, Any]) -> list[str]:
    """The optimizer shard files of a distributed-optimizer checkpoint; [] for any other."""
    if not meta.get("distributed_optimizer"):
        return []
    pp, tp, dp = pp_size_of(meta), meta["tp_size"], meta["dp_size"] * cp_size_of(meta)
    return [optim_file(t, d, p, pp) for p in range(pp) for t in range(tp) for d in range(dp)]


def rng_file(rank: int) -> str:
    """The RNG-state file of one global rank."""
    return f"rng_rank{rank:05d}.safetensors"


def new_digest(algorithm: str = CHECKSUM) -> Any:
    """An empty hash object of ``algorithm`` (``update``, ``hexdigest``)."""
    return _DIGESTS[algorithm]()


def checksum_text(hexdigest: str) -> str:
    """How meta.json records a ``CHECKSUM`` hex digest: ``xxh3_128:<hex>``, the algorithm named."""
    return f"{CHECKSUM}:{hexdigest}"


def parse_checksum(text: str) -> tuple[str, str]:
    """(algorithm, hex) of a checksum in meta.json; bare hex (older checkpoints) is sha256."""
    algorithm, _, hexdigest = text.rpartition(":")
    return algorithm or "sha256", hexdigest


def _hash_file(path: str, algorithm: str) -> str:
    """Hex digest of a file, hashed straight from its mapped pages (no copy into Python)."""
    digest = new_digest(algorithm)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:  # an empty file cannot be mapped
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                digest.update(mapped)
    return digest.hexdigest()


def file_checksum(path: str) -> str:
    """A file's checksum as new checkpoints record it in meta.json (``xxh3_128:<hex>``)."""
    return checksum_text(_hash_file(path, CHECKSUM))


def sha256_file(path: str) -> str:
    """Hex sha256 of a file: its checksum as checkpoints saved before XXH3 recorded it."""
    return _hash_file(path, "sha256")


def _matches(path: str, recorded: str) -> bool:
    """Whether a file hashes to ``recorded``, by the algorithm it names."""
    algorithm, hexdigest = parse_checksum(recorded)
    return _hash_file(path, algorithm) == hexdigest


def read_meta(ckpt_dir: str) -> dict[str, Any]:
    """meta.json of one checkpoint; ConfigError when missing, unreadable or of another format."""
    path = os.path.join(ckpt_dir, META)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: the checkpoint is incomplete") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({e}); the checkpoint is damaged") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise ConfigError(f"{path}: format_version {version}, this code reads {FORMAT_VERSION}")
    absent = [k for k in _META_KEYS if k not in meta]
    if absent:
        raise ConfigError(f"{path} lacks {absent}; the checkpoint is damaged")
    expected = [n for p in range(pp_size_of(meta)) for n in stage_files(meta, p)]
    expected += optim_files(meta)
    expected += [rng_file(r) for r in range(meta["world_size"])] if meta["rng"] else []
    missing = [n for n in expected if n not in meta["files"]]
    if missing:
        raise ConfigError(f"{path}: no checksum for {missing[0]}; the checkpoint is incomplete")
    outside = [n for n in meta["files"] if os.path.basename(n) != n]
    if outside:
        raise ConfigError(f"{path} lists {outside[0]}, outside the checkpoint; it is damaged")
    unknown = [(n, s) for n, s in meta["files"].items() if parse_checksum(s)[0] not in _DIGESTS]
    if unknown:
        raise ConfigError(
            f"{path}: checksum {unknown[0][1]!r} of {unknown[0][0]} is by an algorithm this code "
            f"does not know (it knows {', '.join(_DIGESTS)}); load it with newer code"
        )
    return meta


def check_files(
    ckpt_dir: str, meta: dict[str, Any], names: list[str], hashes: bool = True
) -> str | None:
    """The first of ``names`` that is missing or (``hashes``) fails its checksum (by the
    algorithm meta.json names for it), as one line naming it; None when all are intact.
    ``hashes=False`` reads nothing; else the files are hashed concurrently, one thread each."""
    paths = [os.path.join(ckpt_dir, name) for name in names]
    missing = next((p for p in paths if not os.path.isfile(p)), None)
    if missing is not None:
        return f"{missing} is missing"
    if not hashes or not names:
        return None
    with ThreadPoolExecutor(
        min(len(paths), _HASHERS), thread_name_prefix="checkpoint-hash"
    ) as pool:
        sums = [meta["files"][n] for n in names]
        intact = list(pool.map(_matches, paths, sums))
    bad = next((i for i, ok in enumerate(intact) if not ok), None)
    if bad is None:
        return None
    return f"{paths[bad]} does not match its {parse_checksum(sums[bad])[0]} checksum in meta.json"


def verify_checkpoint(ckpt_dir: str) -> str | None:
    """What is wrong with a checkpoint directory (meta.json, any file), or None when intact."""
    try:
        meta = read_meta(ckpt_dir)
    except ConfigError as e:
        return str(e)
    return check_files(ckpt_dir, meta, sorted(meta["files"]))


def open_safetensors(path: str) -> Any:
    """A safetensors file opened for reading; ConfigError for anything else (e.g. a pickle)."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ConfigError(
            f"{path}: not a valid safetensors file ({e}); refusing to load it (checkpoints are "
            "never unpickled); restore the file or load another checkpoint"
        ) from None
