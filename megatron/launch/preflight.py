"""Preflight: the config against the world size and the files it names, before any process
starts work (``validate``); the dry run stops after it."""

from __future__ import annotations

import os

import numpy as np

from megatron.config.checks import check_config, check_world
from megatron.config.schema import TOKENIZER_FILES, Config, weighted_paths
from megatron.errors import ConfigError


def _check_files(cfg: Config) -> None:
    """Data, tokenizer and checkpoint paths exist, and the token dtype holds every token id."""
    tok = cfg.tokenizer
    for key in TOKENIZER_FILES[tok.type].split():
        # exists, not isfile: a HF tokenizer may be given as its directory
        if not os.path.exists(getattr(tok, key)):
            raise ConfigError(f"tokenizer.{key}: {getattr(tok, key)} not found; fix the path")
    if cfg.checkpoint.load and not os.path.isdir(cfg.checkpoint.load):
        raise ConfigError(
            f"checkpoint.load: {cfg.checkpoint.load} not found; fix the path or set "
            "checkpoint.load=null to start from scratch"
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
        return
    # Imported here: the checks above (shipped configs, dry runs without data) need neither.
    from megatron.data.indexed_dataset import IndexedDataset
    from megatron.data.tokenizers.factory import build_tokenizer

    vocab_size = build_tokenizer(**vars(tok)).vocab_size
    for prefix in prefixes:
        dtype = IndexedDataset(prefix).dtype  # raises ConfigError naming a missing/corrupt file
        if dtype.kind not in "iu" or np.iinfo(dtype).max < vocab_size - 1:
            raise ConfigError(
                f"{prefix}.idx: token dtype {dtype} cannot hold the tokenizer's "
                f"{vocab_size} ids; re-run tools/preprocess_data.py with it"
            )


def validate(cfg: Config, world_size: int, check_files: bool = True) -> None:
    """Every check, before any process group or data work; raises ConfigError naming key and fix.

    ``check_files=False`` skips the file-system checks (shipped configs, dry runs elsewhere).
    """
    check_world(cfg, world_size)
    check_config(cfg)
    if check_files:
        _check_files(cfg)
