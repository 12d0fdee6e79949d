"""``--dry-run``: check a config, its files and its memory for a world size, before a job queues.

Runs with no GPU and no process group (a login node will do). It validates the config for the
world size; opens every tokenizer and data file (headers, sizes, and that no token id reaches the
vocabulary: a vectorised scan of the memory-mapped tokens, sampled when the data is huge; for
hdf5 shards, that each split holds the samples the run draws from it); then
reports the parameters, the per-GPU memory by kind (formulas in megatron/estimate.py), the FLOPs
per iteration, and whether the run fits in ``--gpu-memory-gb``. A file that does not exist here
(the data may live on the cluster only) is named and skipped; a file that exists but is wrong is
an error. Exit code: 0 when it fits or no GPU size was given, 1 when it does not fit.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from megatron.config import TOKENIZER_FILES, Config, weighted_paths
from megatron.config_checks import validate
from megatron.data.indexed_dataset import IndexedDataset, data_path, index_path
from megatron.data.sidecar import check_data_tokenizer
from megatron.data.splits import SPLIT_NAMES, samples_per_split
from megatron.errors import ConfigError
from megatron.estimate import (
    DTYPE_BYTES,
    GIB,
    RESERVED_FRACTION,
    MemoryEstimate,
    ModelType,
    count_parameters,
    estimate_memory,
    fits,
    usable_bytes,
)
from megatron.flops import flops_per_iteration

# Tokens (or hdf5 rows x seq) read per dataset before the scan switches to evenly spaced blocks:
# 2^28 uint16 tokens are 512 MiB, a few seconds from a warm page cache.
SAMPLE_TOKENS = 2**28
_BLOCKS = 64  # evenly spaced blocks a sampled scan reads
_CHUNK = 2**24  # tokens reduced at once, so a block never needs more than this in memory


@dataclass(frozen=True)
class DataSummary:
    """What the scan of one dataset found."""

    path: str
    sequences: int
    tokens: int
    dtype: str
    max_id: int
    sampled: bool  # True when only evenly spaced blocks were read


def _blocks(n: int, limit: int) -> list[tuple[int, int]]:
    """All of ``[0, n)`` when ``n <= limit``, else _BLOCKS evenly spaced blocks totalling limit."""
    if n <= limit:
        return [(0, n)]
    size = limit // _BLOCKS
    return [(start, start + size) for start in np.linspace(0, n - size, _BLOCKS, dtype=np.int64)]


def _id_error(where: str, token: int, vocab_size: int) -> ConfigError:
    return ConfigError(
        f"{where}: token id {token} is outside the tokenizer's vocabulary [0, {vocab_size}); "
        "the data was made with another tokenizer, re-run tools/preprocess_data.py with this one"
    )


def check_indexed(prefix: str, vocab_size: int, sample_tokens: int = SAMPLE_TOKENS) -> DataSummary:
    """Open ``prefix`` (validating header and sizes) and check every scanned id is in the vocab."""
    ds = IndexedDataset(prefix)
    if ds.dtype.kind not in "iu":
        raise ConfigError(
            f"{index_path(prefix)}: token dtype {ds.dtype} is not an integer type; "
            "re-run tools/preprocess_data.py"
        )
    blocks = _blocks(ds.num_tokens, sample_tokens)
    tokens = np.memmap(data_path(prefix), ds.dtype, "r") if ds.num_tokens else None
    max_id = -1
    for start, stop in blocks:
        for lo in range(start, stop, _CHUNK):
            chunk = tokens[lo : min(stop, lo + _CHUNK)]
            bad = (chunk < 0) | (chunk >= vocab_size)
            if bad.any():
                pos = lo + int(np.argmax(bad))
                offset = pos * ds.dtype.itemsize
                seq = int(np.searchsorted(ds.sequence_pointers, offset, "right")) - 1
                where = f"{data_path(prefix)} (sequence {seq}, token {pos})"
                raise _id_error(where, int(tokens[pos]), vocab_size)
            max_id = max(max_id, int(chunk.max()))
    return DataSummary(prefix, len(ds), ds.num_tokens, str(ds.dtype), max_id, len(blocks) > 1)


def check_hdf5(
    path: str, cfg: Config, vocab_size: int, sample_tokens: int = SAMPLE_TOKENS
) -> DataSummary:
    """Open the shards of ``path`` (validating their layout) and check the ids they hold."""
    import h5py

    from megatron.data.hdf5_dataset import Hdf5BertDataset, shard_files

    files = shard_files(path)
    dataset = Hdf5BertDataset(files, cfg.model.seq_length)
    rows_limit = max(1, sample_tokens // (cfg.model.seq_length * len(files)))
    max_id, sampled = -1, False
    for file in files:
        with h5py.File(file, "r") as f:
            rows = _blocks(len(f["input_ids"]), rows_limit)
            sampled |= len(rows) > 1
            for name in ("input_ids", "masked_lm_ids"):
                for start, stop in rows:
                    ids = f[name][start:stop]
                    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                        bad = ids.max() if ids.max() >= vocab_size else ids.min()
                        raise _id_error(f"{file} ({name})", int(bad), vocab_size)
                    max_id = max(max_id, int(ids.max()) if ids.size else -1)
    tokens = len(dataset) * cfg.model.seq_length
    return DataSummary(path, len(dataset), tokens, "int32", max_id, sampled)


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
    if cfg.checkpoint.load and not os.path.isdir(cfg.checkpoint.load):
        missing.append(cfg.checkpoint.load)
    return missing


def vocab_size(cfg: Config, missing: list[str]) -> tuple[int, str]:
    """The tokenizer's vocabulary size, and how it was found (built, or assumed when absent)."""
    tok = cfg.tokenizer
    files = [getattr(tok, key) for key in TOKENIZER_FILES[tok.type].split()]
    if not any(f in missing for f in files):
        from megatron.data.tokenizers import build_tokenizer

        size = build_tokenizer(**vars(tok)).vocab_size
        return size, f"{tok.type} from {', '.join(files)}"
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


def _check_hdf5_splits(cfg: Config, missing: list[str]) -> str:
    """hdf5 data: that each split holds the samples the run draws from it (pre-masked rows are
    never repeated), as the run itself checks at start; a summary, or "" when not checked."""
    paths = [p for _, p in weighted_paths(cfg.data.paths)]
    if cfg.data.format != "hdf5" or any(p in missing for p in paths):
        return ""
    from megatron.data.hdf5_dataset import split_shards

    needed = samples_per_split(cfg.training)
    parts = split_shards(cfg.data.paths, cfg.data.split, cfg.model.seq_length, needed)
    return ", ".join(
        f"{name} {len(part):,} >= {n:,}" if part is not None else f"{name} unused"
        for name, part, n in zip(SPLIT_NAMES, parts, needed, strict=True)
    )


def _report_memory(
    cfg: Config, padded_vocab: int, model_type: ModelType, out: TextIO
) -> MemoryEstimate:
    """Write the parameter and memory lines; return the estimate."""
    m, tp, b = cfg.model, cfg.parallel.tensor_parallel_size, cfg.training.micro_batch_size
    params = count_parameters(
        m, padded_vocab, tp, model_type, cfg.bert.num_tokentypes, cfg.bert.binary_head != "none"
    )
    mem = estimate_memory(cfg, padded_vocab, model_type)
    dtype, e = cfg.precision.dtype, DTYPE_BYTES[cfg.precision.dtype]
    configured = {True: "   <- model.recompute=full", False: "   <- model.recompute=none"}
    rows = [
        (f"weights ({dtype}, {e} B/param)", mem.weights, ""),
        ("gradients (fp32 main_grad, 4 B/param)", mem.main_grads, ""),
        ("fp32 main params (4 B/param; none in fp32)", mem.main_params, ""),
        ("Adam moments (2 x fp32, 8 B/param)", mem.adam_moments, ""),
        (f"word embedding .grad ({dtype}, in backward)", mem.embedding_grad, ""),
        ("logits + loss buffers, (e+4)*b*s*V/t", mem.logits, ""),
        ("activations, no recomputation", mem.activations_no_recompute, ""),
        ("activations, full recomputation", mem.activations_recompute, ""),
        ("total, no recomputation", mem.total_with(False), configured[False] * (not mem.recompute)),
        ("total, full recomputation", mem.total_with(True), configured[True] * mem.recompute),
    ]
    out.write(
        f"parameters: {params.total:,} total; {params.per_gpu:,} per GPU at TP {tp} "
        f"({params.split:,} split {tp} ways, {params.replicated:,} replicated)\n"
        f"memory per GPU (micro-batch {b}, seq {m.seq_length}, e = {e} bytes per element):\n"
    )
    for label, n, note in rows:
        out.write(f"  {label:<46}{n / GIB:9.2f} GiB{note}\n")
    extra = mem.unfused_attention_extra
    out.write(
        "  activations per layer: Korthikanti et al. 2022 (s*b*h*(10 + 24/t + 5*a*s/(h*t)) for\n"
        "    e = 2, f = 4h) with fused attention: s*b*h*(4e + 2 masks) + 16*s*b\n"
        "    + [s*b*(4h + 2f)*e + 4*a*s*b] / t; full recomputation keeps L layer inputs\n"
        "    (e*s*b*h each) plus one layer's working set. Unfused attention (probabilities\n"
        f"    materialised, the 5*a*s/(h*t) term) would add {m.num_layers * extra / GIB:.2f} GiB\n"
        f"    without recomputation, {extra / GIB:.2f} GiB with it.\n"
    )
    return mem


def dry_run(
    cfg: Config,
    args: argparse.Namespace,
    model_type: ModelType = "gpt",
    out: TextIO | None = None,
) -> int:
    """Validate, check the files, report memory and FLOPs; 0 if it fits (or no size), else 1.

    ``args`` carries ``world_size`` (default: one replica, the TP size) and ``gpu_memory_gb``
    (GiB, as vendors' "32 GB" means). Config and file errors raise ConfigError.
    """
    out = out or sys.stdout
    tp = cfg.parallel.tensor_parallel_size
    world = args.world_size or tp
    validate(cfg, world, check_files=False)
    missing = missing_files(cfg)
    if not missing:
        validate(cfg, world, check_files=True)
    split_counts = _check_hdf5_splits(cfg, missing)
    derived = cfg.derived(world)
    out.write(
        f"dry run ({model_type}): world {world} = DP {derived.dp_size} x TP {tp}; "
        f"{derived.num_micro_batches} micro-batches of {cfg.training.micro_batch_size} per step "
        f"on each rank; config valid\n"
    )
    if not args.world_size:
        out.write(f"  (no --world-size: checked for one replica of {tp} GPU(s))\n")
    for path in missing:
        out.write(f"ABSENT here: {path} (not checked; the run fails at start if it is absent)\n")
    if split_counts:
        out.write(f"data: hdf5 splits (samples held >= needed): {split_counts}\n")
    vocab, source = vocab_size(cfg, missing)
    padded = derived.padded_vocab_size(vocab)
    out.write(f"tokenizer: {source}; vocab {vocab:,}, padded to {padded:,} at TP {tp}\n")
    if not missing:  # the data's sidecars against the tokenizer, as training checks them
        check_data_tokenizer(cfg.tokenizer, cfg.data, lambda msg: out.write(f"WARNING: {msg}\n"))
    for _, path in weighted_paths(cfg.data.paths):
        if cfg.data.format == "hdf5":
            if path in missing:
                continue
            summary = check_hdf5(path, cfg, vocab)
        elif index_path(path) in missing or data_path(path) in missing:
            continue
        else:
            summary = check_indexed(path, vocab)
        how = "sampled" if summary.sampled else "all scanned"
        out.write(
            f"data: {summary.path}: {summary.sequences:,} sequences, {summary.tokens:,} "
            f"{summary.dtype} tokens; max id {summary.max_id} < {vocab} ({how})\n"
        )
    mem = _report_memory(cfg, padded, model_type, out)
    m = cfg.model
    flops = flops_per_iteration(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        seq_length=m.seq_length,
        padded_vocab_size=padded,
        global_batch_size=cfg.training.global_batch_size,
        recompute=mem.recompute,
    )
    out.write(f"FLOPs per iteration: {flops:.3e} in all, {flops / world:.3e} per GPU\n")
    gb = args.gpu_memory_gb
    if gb is None:
        return 0
    ok = fits(mem.total, gb)
    out.write(
        f"fits in {gb:g} GB: {'yes' if ok else 'no'} ({mem.total / GIB:.2f} GiB of "
        f"{usable_bytes(gb) / GIB:.2f} GiB usable: {RESERVED_FRACTION:.0%} of the GPU is kept for "
        "the CUDA context, NCCL buffers and fragmentation; GB here is 2^30 bytes)\n"
    )
    if not ok:
        out.write(f"  hint: {_hint(mem, gb)}\n")
    return 0 if ok else 1


def _hint(mem: MemoryEstimate, gb: float) -> str:
    if not mem.recompute and fits(mem.total_with(True), gb):
        return "model.recompute=full fits"
    return (
        "raise parallel.tensor_parallel_size (weights and optimizer state divide by it) "
        "or lower training.micro_batch_size (activations scale with it)"
    )
