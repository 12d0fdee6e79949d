"""GPT samples: Megatron's document, sample and shuffle indices over an indexed dataset.

For a split (a contiguous range of sequences in file order), the sequences are tiled once per
epoch and shuffled (the *document index*). Their tokens, read in that order, form one long
stream; sample ``j`` is the ``seq_length + 1`` tokens starting at stream position
``j * seq_length``, so each sample's last token is the next sample's first. The *sample index*
records where every sample starts as (position in the document index, token offset). The
*shuffle index* is a permutation of the samples. Everything is drawn from one
``numpy.random.RandomState(seed)`` in the order megatron-core 0.16.1 uses, so the same data, seed,
split, sequence length and sample count give the same samples in the same order as its
GPTDataset.

The indices are built with whole-array numpy operations and cached as ``.npy`` files (see
``cached_indices``), which every rank then memory-maps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable
from typing import BinaryIO

import numpy as np
import torch

from megatron.data.blended_dataset import BlendedDataset, blend_indices
from megatron.data.indexed_dataset import IndexedDataset, index_path
from megatron.errors import ConfigError
from megatron.parallel.state import launcher_env

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
# Bump when the meaning of a cached array changes, so stale caches are never reused.
_CACHE_VERSION = 1
# megatron-core reshuffles a final epoch on its own when less than this share of it is used
_FINAL_EPOCH_THRESHOLD = 0.80
# megatron-core indexes this many extra samples per blended dataset, which sets its epochs
_BLEND_SURPLUS = 0.005


def split_ranges(split: str, num_elements: int) -> list[tuple[int, int] | None]:
    """Megatron's ``"949,50,1"`` split: the [begin, end) element range of train, valid and test.

    Weights are normalised, their running sums mark the bookends, and each bookend is rounded to
    an element (half to even, as Python's round). A split of weight 0 is None.
    """
    weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    if not weights or len(weights) > 3 or sum(weights) <= 0:
        raise ConfigError(
            f'data.split="{split}" must be up to three non-negative weights with a positive sum, '
            'e.g. "949,50,1"'
        )
    weights += [0.0] * (3 - len(weights))
    normalized = (np.array(weights, dtype=np.float64) / np.sum(weights)).tolist()
    bookends = [0.0]
    for w in normalized:
        bookends.append(bookends[-1] + w)
    ranges: list[tuple[int, int] | None] = []
    for lo, hi in zip(bookends[:-1], bookends[1:], strict=True):
        if hi <= lo:
            ranges.append(None)
        else:
            ranges.append((int(round(lo * num_elements)), int(round(hi * num_elements))))
    return ranges


def dataset_fingerprint(prefix: str) -> str:
    """A digest of the ``.idx`` file: the indices depend on the sequence lengths, not the tokens."""
    with open(index_path(prefix), "rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()


def _is_builder() -> bool:
    """One process per node builds caches: LOCAL_RANK 0, or every process when not distributed."""
    return not torch.distributed.is_initialized() or launcher_env()["LOCAL_RANK"] == "0"


def _write_atomic(path: str, write: Callable[[BinaryIO], None]) -> None:
    # host and pid in the temporary name: several nodes may build into one shared directory
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    base = os.path.join(cache_dir, f"{kind}-{digest}")
    paths = {name: f"{base}-{name}.npy" for name in names}
    description = base + ".json"
    if _is_builder() and not os.path.isfile(description):
        start = time.perf_counter()
        arrays = build()
        os.makedirs(cache_dir, exist_ok=True)
        for name in names:
            _write_atomic(paths[name], lambda f, a=arrays[name]: np.save(f, a, allow_pickle=False))
        # the description goes last: its presence means every array is in place
        text = json.dumps(key, indent=1, sort_keys=True).encode()
        _write_atomic(description, lambda f: f.write(text))
        logger.info("built %s indices in %.3f s: %s", kind, time.perf_counter() - start, base)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # the builder's files must exist before anyone maps them
    if not os.path.isfile(description):
        raise ConfigError(
            f"{description}: index cache missing after the build; data.cache_dir must be a "
            "directory every process on a node can see"
        )
    return {name: np.load(paths[name], mmap_mode="r") for name in names}


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    sequences: tuple[int, int],
    num_samples: int | None,
    seq_length: int,
    seed: int,
) -> dict[str, np.ndarray]:
    """The document, sample and shuffle indices of megatron-core's GPTDataset, vectorised.

    ``sequences`` is the split's [begin, end) range of sequence ids; ``num_samples`` None means
    one epoch. Returns ``document_index`` int32[epochs * n_seq], ``sample_index`` [samples + 1, 2]
    (row j: position in the document index and token offset where sample j starts) and
    ``shuffle_index`` [samples].
    """
    begin, end = sequences
    split_lengths = sequence_lengths[begin:end]
    tokens_per_epoch = int(split_lengths.sum(dtype=np.int64))
    if tokens_per_epoch < 2:
        raise ValueError("a split needs at least 2 tokens to make a sample")
    # every sample needs seq_length tokens plus the one extra that becomes its last label
    tokens_needed = (num_samples or 0) * seq_length + 1
    num_epochs = max(1, -(-tokens_needed // tokens_per_epoch))
    separate_final_epoch = False
    if num_epochs > 1 and num_samples is not None:
        samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        # a barely used final epoch shuffled into the others would skew the sample mix
        separate_final_epoch = num_samples - samples_before_final < int(
            _FINAL_EPOCH_THRESHOLD * samples_per_epoch
        )
    rng = np.random.RandomState(seed)

    ids = np.arange(begin, end, dtype=np.int32)
    full_epochs = num_epochs - 1 if separate_final_epoch else num_epochs
    document_index = np.tile(ids, full_epochs)
    rng.shuffle(document_index)
    if separate_final_epoch:
        final = ids.copy()
        rng.shuffle(final)
        document_index = np.concatenate([document_index, final])

    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = _sample_index(sequence_lengths[document_index], total, seq_length)

    # uint32 like megatron-core while the range fits, which halves the cache
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = samples_before_final if separate_final_epoch else total
    shuffle_index = np.arange(first, dtype=dtype)
    rng.shuffle(shuffle_index)
    if separate_final_epoch:
        rest = np.arange(first, total, dtype=dtype)
        rng.shuffle(rest)
        shuffle_index = np.concatenate([shuffle_index, rest])
    return {
        "document_index": document_index,
        "sample_index": sample_index,
        "shuffle_index": shuffle_index,
    }


def _sample_index(lengths: np.ndarray, num_samples: int, seq_length: int) -> np.ndarray:
    """[num_samples + 1, 2]: for each boundary j*seq_length, the document holding it and the offset.

    Counting, per document, the boundaries that fall inside it and repeating the document's
    position that many times is linear in the data (no search, no loop over samples).
    """
    # in-place steps below: at 1e10 tokens each array is ~80 MB, and memory traffic is the cost
    ends = np.cumsum(lengths, dtype=np.int64)  # stream position after each document
    # boundaries before the end of document d: j*L < ends[d], i.e. j < ceil(ends[d] / L)
    before_end = ends + (seq_length - 1)
    before_end //= seq_length
    np.minimum(before_end, num_samples + 1, out=before_end)
    dtype = np.int32 if len(lengths) <= np.iinfo(np.int32).max else np.int64
    doc = np.repeat(np.arange(len(lengths), dtype=dtype), np.diff(before_end, prepend=0))
    starts = np.subtract(ends, lengths, out=ends)
    offset = np.arange(num_samples + 1, dtype=np.int64)
    offset *= seq_length
    offset -= starts[doc]
    index = np.stack([doc, offset.astype(dtype, copy=False)], axis=1)
    index[0] = 0  # megatron-core starts at (0, 0) even when the first document is empty
    return index


def ltor_masks(
    tokens: torch.Tensor,
    eod: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> dict[str, torch.Tensor]:
    """Loss mask, position ids and (only with reset_attention_mask) the attention mask.

    With resets, a document starts after each EOD in ``tokens``: positions restart at 0 and a
    token attends only to earlier tokens of its own document. ``attention_mask`` is [1, s, s],
    True where attention is masked out, as in Megatron.
    """
    s = tokens.numel()
    out = {"loss_mask": torch.ones(s, dtype=torch.float32)}
    if eod_mask_loss:
        out["loss_mask"][tokens == eod] = 0.0
    positions = torch.arange(s, dtype=torch.int64)
    after_eod = torch.zeros(s, dtype=torch.bool)
    after_eod[1:] = tokens[:-1] == eod
    if reset_position_ids:
        # start of each token's document: the latest position following an EOD
        starts = torch.cummax(torch.where(after_eod, positions, 0), dim=0).values
        out["position_ids"] = positions - starts
    else:
        out["position_ids"] = positions
    if reset_attention_mask:
        document = torch.cumsum(after_eod, dim=0)  # [s]
        causal = positions[None, :] <= positions[:, None]  # [s_query, s_key]
        allowed = causal & (document[None, :] == document[:, None])
        out["attention_mask"] = (~allowed)[None]  # [1, s, s]
    return out


class GPTDataset(torch.utils.data.Dataset):
    """One split of one indexed dataset as GPT samples (Megatron's sample order).

    ``dataset[i]`` is a dict of ``tokens`` int64[s], ``labels`` int64[s] (tokens shifted by one),
    ``loss_mask`` float32[s], ``position_ids`` int64[s], and ``attention_mask`` bool[1, s, s]
    only when reset_attention_mask.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        sequences: tuple[int, int],
        num_samples: int | None,
        seq_length: int,
        seed: int,
        cache_dir: str | None,
        eod: int,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
    ) -> None:
        self.indexed = indexed
        self.seq_length = seq_length
        self.eod = eod
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.eod_mask_loss = eod_mask_loss
        self.key = {
            "version": _CACHE_VERSION,
            "idx_sha1": dataset_fingerprint(indexed.prefix),
            "sequences": list(sequences),
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
        }
        arrays = cached_indices(
            cache_dir,
            "gpt",
            self.key,
            ("document_index", "sample_index", "shuffle_index"),
            lambda: build_gpt_indices(
                indexed.sequence_lengths, sequences, num_samples, seq_length, seed
            ),
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        """Samples available: at least the number requested (whole epochs are indexed)."""
        return len(self.shuffle_index)

    def tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``idx`` (int64)."""
        j = int(self.shuffle_index[idx])
        first, first_offset = (int(v) for v in self.sample_index[j])
        last, last_offset = (int(v) for v in self.sample_index[j + 1])
        get, docs = self.indexed.get, self.document_index
        if first == last:
            parts = [get(int(docs[first]), first_offset, last_offset - first_offset + 1)]
        else:
            parts = [get(int(docs[first]), first_offset)]
            parts += [get(int(docs[k])) for k in range(first + 1, last)]
            parts.append(get(int(docs[last]), 0, last_offset + 1))
        return np.concatenate(parts, dtype=np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        """Sample ``idx`` as the tensors the GPT loss needs."""
        text = torch.from_numpy(self.tokens(idx))
        tokens = text[:-1].contiguous()
        sample = {"tokens": tokens, "labels": text[1:].contiguous()}
        sample.update(
            ltor_masks(
                tokens,
                self.eod,
                self.reset_position_ids,
                self.reset_attention_mask,
                self.eod_mask_loss,
            )
        )
        return sample


def parse_data_paths(paths: list) -> tuple[list[str], list[float] | None]:
    """``data.paths``: a list of prefixes, or alternating weight, prefix (``[0.7, a, 0.3, b]``)."""
    if not paths:
        raise ConfigError("data.paths is empty; give one or more dataset prefixes")
    if len(paths) % 2 == 0:
        try:
            weights = [float(w) for w in paths[0::2]]
        except (TypeError, ValueError):
            weights = None
        if weights is not None:
            if not all(w > 0 for w in weights):
                raise ConfigError(f"data.paths={paths}: every weight must be positive")
            return [str(p) for p in paths[1::2]], weights
    return [str(p) for p in paths], None


def _normalize(weights: list[float]) -> list[float]:
    """megatron-core's normalisation, bit for bit (it decides the per-dataset sample counts)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def build_gpt_datasets(
    paths: list,
    split: str,
    num_samples: tuple[int, int, int],
    seq_length: int,
    seed: int,
    cache_dir: str | None,
    eod: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """Train, valid and test datasets from ``data.paths`` and ``data.split``.

    A split asked for 0 samples is None. One unweighted prefix gives a GPTDataset with exactly
    megatron-core's sample order. Several prefixes give a BlendedDataset: with weights, each
    dataset indexes ``ceil(ceil(n * w) * 1.005)`` samples as megatron-core does (so its own sample
    order matches); without weights, one epoch each, mixed in proportion to their sizes.
    """
    prefixes, weights = parse_data_paths(paths)
    indexed = [IndexedDataset(p) for p in prefixes]
    ranges = [split_ranges(split, len(ds)) for ds in indexed]
    options = dict(
        seq_length=seq_length,
        seed=seed,
        cache_dir=cache_dir,
        eod=eod,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
    )
    result: list[torch.utils.data.Dataset | None] = []
    for i, name in enumerate(SPLIT_NAMES):
        n = num_samples[i]
        if not n:
            result.append(None)
            continue
        for ds, r in zip(indexed, ranges, strict=True):
            if r[i] is None or ds.sequence_lengths[r[i][0] : r[i][1]].sum(dtype=np.int64) < 2:
                raise ConfigError(
                    f'data.split="{split}" leaves the {name} split of {ds.prefix} without data '
                    f"({n} samples requested); give {name} a larger share or more data"
                )
        if len(prefixes) == 1 and weights is None:
            result.append(GPTDataset(indexed[0], ranges[0][i], n, **options))
            continue
        if weights is not None:
            w = _normalize(weights)
            sizes = [math.ceil(math.ceil(n * wd) * (1 + _BLEND_SURPLUS)) for wd in w]
            parts = [
                GPTDataset(ds, r[i], size, **options)
                for ds, r, size in zip(indexed, ranges, sizes, strict=True)
            ]
        else:
            parts = [GPTDataset(ds, r[i], None, **options) for ds, r in zip(indexed, ranges)]
            w = _normalize([len(p) for p in parts])
            if n > sum(len(p) for p in parts):
                raise ConfigError(
                    f"data.paths: the {name} split has {sum(len(p) for p in parts)} samples "
                    f"of one epoch but {n} are requested; give weights ([w1, prefix1, ...]) "
                    "to repeat data, or add data"
                )
        result.append(_blend(parts, w, n, name, cache_dir))
    return tuple(result)


def _blend(
    parts: list[torch.utils.data.Dataset],
    weights: list[float],
    size: int,
    name: str,
    cache_dir: str | None,
) -> BlendedDataset:
    """Mix ``parts`` (each with ``.key``, its cache key, and ``.indexed``) into ``size`` samples.

    Shared with bert_dataset. The blend indices are cached like the parts' own indices; a part
    that the blend would read past its end is a ConfigError.
    """
    key = {
        "version": _CACHE_VERSION,
        "parts": [p.key for p in parts],
        "weights": weights,
        "size": size,
    }
    arrays = cached_indices(
        cache_dir,
        "blend",
        key,
        ("dataset_index", "dataset_sample_index"),
        lambda: dict(zip(("dataset_index", "dataset_sample_index"), blend_indices(weights, size))),
    )
    used = np.bincount(arrays["dataset_index"], minlength=len(parts))
    for part, count in zip(parts, used, strict=True):
        if count > len(part):
            raise ConfigError(
                f"data.paths: the {name} blend needs {count} samples of {part.indexed.prefix} "
                f"but only {len(part)} are indexed; lower its weight or add data"
            )
    return BlendedDataset(parts, arrays["dataset_index"], arrays["dataset_sample_index"])
