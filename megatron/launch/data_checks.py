"""The dry run's look at the files a run reads: the tokenizer's vocabulary (or the size assumed
where the file is absent here), each dataset's header, sizes and token ids against it, the hdf5
splits' sample counts, and which configured paths do not exist on this machine."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from megatron.config import skip_list
from megatron.config.schema import Config, weighted_paths
from megatron.config.tokenizer import TOKENIZER_FILES
from megatron.data.indexed_dataset import IndexedDataset, data_path, index_path
from megatron.data.splits import SPLIT_NAMES, samples_per_split
from megatron.data.token_range import IdRange, check_hdf5_ids, check_indexed_ids
from megatron.errors import ConfigError

# Tokens (or hdf5 rows x seq) read per dataset before the scan switches to evenly spaced blocks
# (when no cached full scan exists): 2^28 uint16 tokens are 512 MiB, ~1 s from a warm page cache.
SAMPLE_TOKENS = 2**28


@dataclass(frozen=True)
class DataSummary:
    """What the scan of one dataset found."""

    path: str
    sequences: int
    tokens: int
    dtype: str
    max_id: int
    sampled: bool  # True when only evenly spaced blocks were read


def check_indexed(
    prefix: str, vocab_size: int, sample_tokens: int = SAMPLE_TOKENS, cache_dir: str | None = None
) -> DataSummary:
    """Open ``prefix`` (validating header and sizes) and check its ids against the vocabulary."""
    found = check_indexed_ids(prefix, vocab_size, cache_dir, sample_tokens)
    ds = IndexedDataset(prefix)
    return _summary(prefix, len(ds), ds.num_tokens, str(ds.dtype), found)


def check_hdf5(
    path: str, cfg: Config, vocab_size: int, sample_tokens: int = SAMPLE_TOKENS
) -> DataSummary:
    """Open the shards of ``path`` (validating their layout) and check the ids they hold."""
    from megatron.data.hdf5_dataset import Hdf5BertDataset, shard_files

    files = shard_files(path)
    dataset = Hdf5BertDataset(files, cfg.model.seq_length)
    rows_limit = max(1, sample_tokens // (cfg.model.seq_length * len(files)))
    found = None
    for file in files:
        ids = check_hdf5_ids(file, vocab_size, cfg.data.cache_dir, rows_limit)
        found = ids.merge(found) if ids is not None else found
    tokens = len(dataset) * cfg.model.seq_length
    return _summary(path, len(dataset), tokens, "int32", found)


def _summary(
    path: str, sequences: int, tokens: int, dtype: str, found: IdRange | None
) -> DataSummary:
    max_id = -1 if found is None else found.highest
    return DataSummary(path, sequences, tokens, dtype, max_id, found is not None and found.sampled)


def missing_files(cfg: Config) -> list[str]:
    """Configured tokenizer, data and checkpoint paths that do not exist on this machine."""
    tok = cfg.tokenizer
    paths = [getattr(tok, key) for key in TOKENIZER_FILES[tok.type].split()]
    missing = [p for p in paths if p and not os.path.exists(p)]
    for _, prefix in weighted_paths(cfg.data.paths):
        if cfg.data.format == "indexed":
            missing += [p for p in (index_path(prefix), data_path(prefix)) if not os.path.exists(p)]
        elif not glob.glob(prefix):  # hdf5: a shard file, a folder of them or a glob
            missing.append(prefix)
    if cfg.checkpoint.load and not os.path.exists(cfg.checkpoint.load):
        missing.append(cfg.checkpoint.load)
    return missing


def vocab_size(cfg: Config, missing: list[str]) -> tuple[int, str]:
    """The tokenizer's vocabulary size, and how it was found (built, or assumed when absent)."""
    tok = cfg.tokenizer
    files = [getattr(tok, key) for key in TOKENIZER_FILES[tok.type].split()]
    if not any(f in missing for f in files):
        from megatron.data.tokenizers.factory import build_tokenizer

        return build_tokenizer(**vars(tok)).vocab_size, f"{tok.type} from {', '.join(files)}"
    if tok.type == "hf" and tok.vocab_size:  # the model's rows, which the file's ids fill
        return tok.vocab_size, f"hf ASSUMED (files absent; tokenizer.vocab_size {tok.vocab_size})"
    # The standard files' sizes, assumed only when the files are absent here: GPT-2 BPE, and
    # Google's BERT WordPiece vocabularies (uncased, cased).
    known = {"gpt2": 50257, "wordpiece": 30522 if tok.lower_case else 28996}.get(tok.type)
    if known is None:
        key = TOKENIZER_FILES[tok.type].split()[0]
        raise ConfigError(
            f"tokenizer.{key}: {getattr(tok, key)} not found; the dry run needs it for the "
            "vocabulary size, copy it here or fix the path"
        )
    return known, f"{tok.type} ASSUMED (files absent; the standard vocabulary has {known})"


def check_hdf5_splits(cfg: Config, missing: list[str]) -> str:
    """hdf5 data: that each split holds the samples the run draws from it (pre-masked rows are
    never repeated), as the run itself checks at start; a summary, or "" when not checked."""
    paths = [p for _, p in weighted_paths(cfg.data.paths)]
    if cfg.data.format != "hdf5" or any(p in missing for p in paths):
        return ""
    from megatron.data.hdf5_dataset import split_shards

    needed = samples_per_split(cfg.training, skip_list.headroom(cfg))
    parts = split_shards(cfg.data.paths, cfg.data.split, cfg.model.seq_length, needed)
    return ", ".join(
        f"{name} {len(part):,} >= {n:,}" if part is not None else f"{name} unused"
        for name, part, n in zip(SPLIT_NAMES, parts, needed, strict=True)
    )
