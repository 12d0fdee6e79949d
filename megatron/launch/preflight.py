"""Preflight: the config against the world size, the files it reads and the paths it writes,
before any process starts work (``validate``); the dry run stops after it."""

from __future__ import annotations

import glob
import importlib.util
import netrc
import os
import urllib.parse

import numpy as np

from megatron.atomic_file import free_bytes, mib
from megatron.config.checks import check_all
from megatron.config.schema import Config, weighted_paths
from megatron.config.tokenizer import TOKENIZER_FILES
from megatron.errors import ConfigError
from megatron.estimate.checkpoint_size import checkpoint_bytes

# Exported (=1) by the launch scripts once their --preflight, which prints the warnings, passed.
PREFLIGHT_PASSED = "MEGATRON_PREFLIGHT_PASSED"


def check_load_path(cfg: Config, missing_ok: bool = False) -> None:
    """``checkpoint.load`` names a directory (a save directory or one ``iter_*``); with
    ``missing_ok`` (the dry run, whose data may live elsewhere) a path absent here passes."""
    load = cfg.checkpoint.load
    if not load or os.path.isdir(load):
        return
    if os.path.exists(load):
        raise ConfigError(
            f"checkpoint.load: {load} is a file; give the save directory (holding latest and "
            "iter_*) or one iter_* directory"
        )
    if not missing_ok:
        raise ConfigError(
            f"checkpoint.load: {load} not found; fix the path or set checkpoint.load=null to "
            "start from scratch"
        )


def _check_files(cfg: Config) -> int:
    """Data, tokenizer and checkpoint paths exist, and the token dtype holds every token id;
    returns the tokenizer's vocabulary size."""
    tok = cfg.tokenizer
    for key in TOKENIZER_FILES[tok.type].split():
        # exists, not isfile: a HF tokenizer may be given as its directory
        if not os.path.exists(getattr(tok, key)):
            raise ConfigError(f"tokenizer.{key}: {getattr(tok, key)} not found; fix the path")
    check_load_path(cfg)
    for directory in {cfg.checkpoint.save, cfg.checkpoint.load} - {None}:
        # Before any work: a `latest` that is a directory (the load reads it as a file, and
        # refuses it too: megatron.checkpoint.load.find_latest).
        latest = os.path.join(directory, "latest")
        if os.path.isdir(latest):
            raise ConfigError(
                f"{latest} is a directory, not the file naming the latest checkpoint; remove it "
                "to resume from the newest complete iter_* directory"
            )
    prefixes = [p for _, p in weighted_paths(cfg.data.paths)]
    if cfg.data.format == "hdf5":
        # The reader's own resolution (directory, glob or file), so the check accepts exactly
        # what training will read; h5py is imported only for hdf5 data.
        from megatron.data.hdf5_dataset import shard_files

        for path in prefixes:
            try:
                shard_files(path)
            except ConfigError as err:
                raise ConfigError(f"data.paths: {err}") from None
    # Imported here: the checks above (shipped configs, dry runs without data) need neither.
    from megatron.data.indexed_dataset import IndexedDataset
    from megatron.data.tokenizers.factory import build_tokenizer

    vocab_size = build_tokenizer(**vars(tok)).vocab_size
    for prefix in prefixes if cfg.data.format == "indexed" else ():
        dtype = IndexedDataset(prefix).dtype  # raises ConfigError naming a missing/corrupt file
        if dtype.kind not in "iu" or np.iinfo(dtype).max < vocab_size - 1:
            raise ConfigError(
                f"{prefix}.idx: token dtype {dtype} cannot hold the tokenizer's "
                f"{vocab_size} ids; re-run tools/preprocess_data.py with it"
            )
    return vocab_size


def _check_packages(cfg: Config) -> None:
    """The optional packages the config asks for are installed (found, not imported: importing
    wandb costs every rank a second, and only rank 0 uses it)."""
    if cfg.logging.uses_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"logging.wandb_project={cfg.logging.wandb_project}: needs the wandb package; "
            "pip install wandb"
        )
    online = cfg.logging.wandb_mode == "online" and os.environ.get("WANDB_MODE") != "offline"
    if cfg.logging.uses_wandb and online and not _wandb_logged_in():
        raise ConfigError(
            f"logging.wandb_project={cfg.logging.wandb_project} logs online, and W&B has no API "
            "key here; run `wandb login`, set WANDB_API_KEY, or set logging.wandb_mode=offline"
        )


def _wandb_logged_in() -> bool:
    """Whether W&B finds an API key: WANDB_API_KEY, or the netrc entry ``wandb login`` writes
    for its host (without importing wandb)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _check_writable(key: str, path: str, is_dir: bool) -> None:
    """``path`` (a directory if ``is_dir``, else a file) is of that kind where it exists, and it
    or its nearest existing ancestor, a directory the run creates the rest in, is writable."""
    kind = "directory" if is_dir else "file"
    if os.path.exists(path) and os.path.isdir(path) != is_dir:
        other = "file" if is_dir else "directory"
        raise ConfigError(f"{key}: {path} is a {other}; give the path of a {kind}")
    base = _existing(path)
    if base != os.path.abspath(path) and not os.path.isdir(base):
        raise ConfigError(f"{key}: cannot create {path}: {base} is a file; fix the path")
    # statvfs first, to say why: access(2) refuses a read-only mount too, as EROFS.
    if os.statvfs(base).f_flag & os.ST_RDONLY:
        why = "is on a read-only file system"
    elif not os.access(base, os.W_OK):
        why = "is not writable by this user"
    else:
        return
    raise ConfigError(f"{key}: cannot write {path} ({base} {why}); set {key} to a writable {kind}")


def _check_outputs(cfg: Config) -> None:
    """Every path the run writes is of the right kind, and writable or creatable."""
    log = cfg.logging
    for key, path, is_dir in (
        ("checkpoint.save", cfg.checkpoint.save, True),
        ("logging.tensorboard_dir", log.tensorboard_dir, True),
        ("logging.metrics_file", log.metrics_file, False),
        ("data.cache_dir", cfg.data.cache_dir, True),
    ):
        if not path:
            continue
        # A cache holding complete entries (each's .json is written last) is read without
        # writing (megatron/data/index_cache.py), so a prebuilt one may be read-only.
        if key == "data.cache_dir" and glob.glob(os.path.join(glob.escape(path), "*.json")):
            continue
        _check_writable(key, path, is_dir)


def _save_space_warning(cfg: Config, padded_vocab_size: int) -> str | None:
    """A warning when ``checkpoint.save``'s file system has no room for two checkpoints: a save
    writes the new one before ``keep_last`` removes an old one."""
    save = cfg.checkpoint.save
    if not save:
        return None
    need, free = checkpoint_bytes(cfg, padded_vocab_size, cfg.model.type or "gpt"), free_bytes(save)
    if free >= 2 * need:
        return None
    return (
        f"checkpoint.save: {save} has {mib(free)} free; one checkpoint is about {mib(need)} "
        "and a save needs room for two; free space or point checkpoint.save elsewhere"
    )


def validate(cfg: Config, world_size: int, check_files: bool = True) -> list[str]:
    """Every check, before any process group or data work; raises ConfigError naming key and fix,
    returns the warnings (the run can go on, but is likely to fail later).

    ``check_files=False`` skips the checks of this machine, its files and optional packages
    (shipped configs, dry runs elsewhere).
    """
    check_all(cfg, world_size)
    if not check_files:
        return []
    _check_packages(cfg)
    vocab_size = _check_files(cfg)
    _check_outputs(cfg)
    warning = _save_space_warning(cfg, cfg.derived(world_size).padded_vocab_size(vocab_size))
    return [warning] if warning else []
