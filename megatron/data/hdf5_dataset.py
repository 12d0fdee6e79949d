"""Pre-masked BERT samples in NVIDIA-style HDF5 shards: the writer and a reader.

A shard holds N samples of sequence length s as six datasets (the layout of NVIDIA's BERT
pretraining data, so their shards read here and ours read there)::

    input_ids             int32[N, s]  the masked input ([MASK], random or kept ids where masked)
    input_mask            int8[N, s]   1 on real tokens, 0 on padding
    segment_ids           int8[N, s]   0 for [CLS] A [SEP], 1 for B [SEP]
    masked_lm_positions   int32[N, p]  positions of the masked tokens, then 0 as padding
    masked_lm_ids         int32[N, p]  the original ids at those positions
    next_sentence_labels  int8[N]      1 when B does not follow A (here: A and B were swapped)

Position 0 is always [CLS], which is never masked, so the first 0 in ``masked_lm_positions`` ends
the list. Reading gives the same sample dict as ``BertDataset``, its ``masked_positions`` as wide
as the shard's ``masked_lm_positions`` (the same width when the shard was written with the
default ``max_predictions``).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

import h5py
import numpy as np
import torch

from megatron.atomic_file import write_atomic
from megatron.data.bert_dataset import pad_positions
from megatron.data.splits import SPLIT_NAMES, parse_data_paths, split_ranges
from megatron.errors import ConfigError

FIELDS: dict[str, type] = {
    "input_ids": np.int32,
    "input_mask": np.int8,
    "segment_ids": np.int8,
    "masked_lm_positions": np.int32,
    "masked_lm_ids": np.int32,
    "next_sentence_labels": np.int8,
}
# Rows per compressed chunk: one row never spans chunks, and h5py's 1 MiB chunk cache keeps the
# chunk being read sequentially.
_CHUNK_ROWS = 64


def write_shard(path: str, samples: Sequence[dict[str, np.ndarray]], max_predictions: int) -> None:
    """Write ``samples`` (BertDataset dicts) as one shard, atomically.

    The file is written under a temporary name, fsynced and renamed, so ``path`` is either absent
    or complete. ``max_predictions`` is the width p of the masked-position arrays.
    """
    if not samples:
        raise ValueError(f"{path}: a shard needs at least one sample")
    n, s = len(samples), len(samples[0]["text"])
    arrays = {name: np.zeros((n, s), dtype) for name, dtype in list(FIELDS.items())[:3]}
    arrays["masked_lm_positions"] = np.zeros((n, max_predictions), np.int32)
    arrays["masked_lm_ids"] = np.zeros((n, max_predictions), np.int32)
    arrays["next_sentence_labels"] = np.zeros(n, np.int8)
    for i, sample in enumerate(samples):
        positions = np.flatnonzero(sample["loss_mask"])
        if len(positions) > max_predictions:
            raise ConfigError(
                f"{path}: sample {i} masks {len(positions)} tokens but --max-predictions-per-seq="
                f"{max_predictions}; raise it to at least {len(positions)}"
            )
        arrays["input_ids"][i] = sample["text"]
        arrays["input_mask"][i] = sample["padding_mask"]
        arrays["segment_ids"][i] = sample["types"]
        arrays["masked_lm_positions"][i, : len(positions)] = positions
        arrays["masked_lm_ids"][i, : len(positions)] = sample["labels"][positions]
        arrays["next_sentence_labels"][i] = sample["is_random"]

    def write(tmp: str) -> None:
        with h5py.File(tmp, "w") as f:
            for name, data in arrays.items():
                chunks = (min(n, _CHUNK_ROWS), *data.shape[1:])
                f.create_dataset(name, data=data, chunks=chunks, compression="gzip")

    write_atomic(path, write)


def shard_files(path: str) -> list[str]:
    """The shards named by ``path``: a directory (its ``*.hdf5``/``*.h5``), a glob or a file."""
    if os.path.isdir(path):
        files = [p for ext in ("*.hdf5", "*.h5") for p in glob.glob(os.path.join(path, ext))]
    else:
        files = glob.glob(path)
    if not files:
        raise ConfigError(
            f"{path}: no HDF5 shard found; give a directory of .hdf5 files, a glob or a file "
            "(write shards with tools/bert_to_hdf5.py)"
        )
    return sorted(files)


class Hdf5BertDataset(torch.utils.data.Dataset):
    """The samples of several shards, in file order, as BertDataset sample dicts.

    Opening checks that every shard has the six datasets with consistent shapes and, when
    ``seq_length`` is given, that length. Rows are read on demand; each process (DataLoader
    worker) opens its own file handles, since HDF5 handles do not survive a fork.
    """

    def __init__(self, files: Sequence[str], seq_length: int | None = None) -> None:
        self.files = list(files)
        counts = []
        for path in self.files:
            counts.append(self._check(path, seq_length))
        self._offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._handles: dict[int, dict[str, h5py.Dataset]] = {}
        self._pid = os.getpid()

    @staticmethod
    def _check(path: str, seq_length: int | None) -> int:
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: HDF5 shard not found")
        with h5py.File(path, "r") as f:
            missing = [name for name in FIELDS if name not in f]
            if missing:
                raise ConfigError(
                    f"{path}: no dataset {', '.join(missing)}; a BERT shard needs "
                    f"{', '.join(FIELDS)} (write shards with tools/bert_to_hdf5.py)"
                )
            shapes = {name: f[name].shape for name in FIELDS}
        if len(shapes["input_ids"]) != 2 or len(shapes["masked_lm_positions"]) != 2:
            raise ConfigError(
                f"{path}: input_ids {shapes['input_ids']} and masked_lm_positions "
                f"{shapes['masked_lm_positions']} must be 2-D; the shard is corrupted, rewrite it"
            )
        (n, s), p = shapes["input_ids"], shapes["masked_lm_positions"][1]
        expected = {
            "input_mask": (n, s),
            "segment_ids": (n, s),
            "masked_lm_positions": (n, p),
            "masked_lm_ids": (n, p),
            "next_sentence_labels": (n,),
        }
        for name, shape in expected.items():
            if shapes[name] != shape:
                raise ConfigError(
                    f"{path}: dataset {name} has shape {shapes[name]} where input_ids "
                    f"{shapes['input_ids']} implies {shape}; the shard is corrupted, rewrite it"
                )
        if seq_length is not None and s != seq_length:
            raise ConfigError(
                f"{path}: samples have {s} tokens but model.seq_length={seq_length}; "
                "set the sequence length the shards were written with"
            )
        return n

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def _datasets(self, shard: int) -> dict[str, h5py.Dataset]:
        # the dataset objects are kept, not just the file: h5py's chunk cache lives in them, and
        # without it every row read decompresses its chunk again (~20x slower, measured)
        if os.getpid() != self._pid:  # a forked worker: the parent's handles are not ours
            self._handles, self._pid = {}, os.getpid()
        if shard not in self._handles:
            f = h5py.File(self.files[shard], "r")
            self._handles[shard] = {name: f[name] for name in FIELDS}
        return self._handles[shard]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        shard = int(np.searchsorted(self._offsets, idx, side="right")) - 1
        row = idx - int(self._offsets[shard])
        f = self._datasets(shard)
        text = f["input_ids"][row].astype(np.int64)
        positions = f["masked_lm_positions"][row].astype(np.int64)
        ids = f["masked_lm_ids"][row].astype(np.int64)
        count = int(np.argmax(positions == 0)) if (positions == 0).any() else len(positions)
        labels = np.full(len(text), -1, dtype=np.int64)
        labels[positions[:count]] = ids[:count]
        loss_mask = np.zeros(len(text), dtype=np.float32)
        loss_mask[positions[:count]] = 1.0
        return {
            "text": text,
            "types": f["segment_ids"][row].astype(np.int64),
            "labels": labels,
            "loss_mask": loss_mask,
            "padding_mask": f["input_mask"][row].astype(np.int64),
            "is_random": np.int64(f["next_sentence_labels"][row]),
            "masked_positions": pad_positions(positions[:count], len(positions)),
        }

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state


def split_shards(
    data_paths: list, split: str, seq_length: int, num_samples: tuple[int, int, int]
) -> list[torch.utils.data.Subset | None]:
    """The rows of the shards ``data_paths`` name, in file order, cut by ``split`` into train,
    valid and test; a part the run needs no samples of (``num_samples``) is None.

    Raises ConfigError when a part holds fewer rows than the run needs: pre-masked shards are
    read once, never repeated, so a short split would run dry mid-run.
    """
    paths, weights = parse_data_paths(list(data_paths))
    if weights is not None:
        raise ConfigError("data.paths: weights are not supported with data.format=hdf5; drop them")
    rows = Hdf5BertDataset([f for path in paths for f in shard_files(path)], seq_length)
    parts = []
    ranges = split_ranges(split, len(rows))
    for name, wanted, bounds in zip(SPLIT_NAMES, num_samples, ranges, strict=True):
        have = 0 if bounds is None else bounds[1] - bounds[0]
        if wanted and have < wanted:
            raise ConfigError(
                f"data.paths: the hdf5 shards give the {name} split {have} samples but the run "
                f"needs {wanted}; write more (tools/bert_to_hdf5.py --num-samples) or change "
                "data.split, training.train_iters, training.eval_iters or training.test_iters"
            )
        parts.append(torch.utils.data.Subset(rows, range(*bounds)) if wanted else None)
    return parts
