"""``data.paths`` and ``data.split`` to train, valid and test datasets, shared by GPT and BERT.

Each dataset is cut into three contiguous ranges in file order (Megatron's ``"949,50,1"``); a
model's factory turns one range of one dataset into samples, and several datasets are blended::

    data.paths = [0.7, a, 0.3, b]      split "949,50,1"
    a: |---------- train ----------|-valid-|t|     -> make_part(a, train range, size_a) -+
    b: |---------- train ----------|-valid-|t|     -> make_part(b, train range, size_b) -+-> blend
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable

import numpy as np
import torch

from megatron.config.schema import TrainingConfig
from megatron.data.blended_dataset import build_blended_dataset
from megatron.data.indexed_dataset import IndexedDataset
from megatron.errors import ConfigError

SPLIT_NAMES = ("train", "valid", "test")
# megatron-core indexes this many extra samples per blended dataset, which sets its epochs
_BLEND_SURPLUS = 0.005

# make_part(dataset, [begin, end) range of the split, samples or None for one epoch)
PartFactory = Callable[[IndexedDataset, tuple[int, int], int | None], torch.utils.data.Dataset]


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
    bookends = [0.0, *itertools.accumulate(_normalize(weights))]
    return [
        None if hi <= lo else (int(round(lo * num_elements)), int(round(hi * num_elements)))
        for lo, hi in zip(bookends[:-1], bookends[1:], strict=True)
    ]


def samples_per_split(t: TrainingConfig, extra_batches: int = 0) -> tuple[int, int, int]:
    """The samples a run draws from train, valid and test: every step (and ``extra_batches``
    more, the spike guard's ``skip_list.headroom``), every evaluation (at each multiple of
    eval_interval, with one to spare) and the one test evaluation at the end."""
    evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_iters else 0
    return (
        (t.train_iters + extra_batches) * t.global_batch_size,
        evals * t.global_batch_size,
        t.test_iters * t.global_batch_size,
    )


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


def _split_tokens(indexed: IndexedDataset, elements: tuple[int, int], by_documents: bool) -> int:
    begin, end = elements
    if by_documents:
        begin, end = (int(indexed.document_indices[i]) for i in (begin, end))
    return int(indexed.sequence_lengths[begin:end].sum(dtype=np.int64))


def build_split_datasets(
    prefixes: list[str],
    weights: list[float] | None,
    split: str,
    num_samples: tuple[int, int, int],
    make_part: PartFactory,
    cache_dir: str | None,
    by_documents: bool = False,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """Train, valid and test datasets: ``split`` cuts every prefix, ``make_part`` makes samples.

    The split divides each dataset's sequences, or its documents with ``by_documents``, and
    ``make_part`` receives that range. A split asked for 0 samples is None; one that leaves a
    dataset under 2 tokens is a ConfigError. One unweighted prefix gives its part directly.
    Several are blended (``build_blended_dataset``): with weights, each part indexes
    ``ceil(ceil(n * w) * 1.005)`` samples as megatron-core does (so its own sample order matches);
    without, one epoch each, mixed in proportion to their sizes. The parts need the attributes
    that ``build_blended_dataset`` reads.
    """
    indexed = [IndexedDataset(p) for p in prefixes]
    unit = "documents" if by_documents else "sequences"
    counts = [ds.num_documents if by_documents else len(ds) for ds in indexed]
    ranges = [split_ranges(split, count) for count in counts]
    result: list[torch.utils.data.Dataset | None] = []
    for i, name in enumerate(SPLIT_NAMES):
        n = num_samples[i]
        if not n:
            result.append(None)
            continue
        elements = [r[i] for r in ranges]
        for ds, count, r in zip(indexed, counts, elements, strict=True):
            if r is None or _split_tokens(ds, r, by_documents) < 2:
                held = 0 if r is None else r[1] - r[0]
                raise ConfigError(
                    f'data.split="{split}" leaves the {name} split of {ds.prefix} without data '
                    f"({held} of {count} {unit}, under 2 tokens; {n} samples requested); give "
                    f"{name} a larger share or more data"
                )
        if len(indexed) == 1 and weights is None:
            result.append(make_part(indexed[0], elements[0], n))
            continue
        if weights is not None:
            w = _normalize(weights)
            sizes = [math.ceil(math.ceil(n * wd) * (1 + _BLEND_SURPLUS)) for wd in w]
            parts = [make_part(*args) for args in zip(indexed, elements, sizes, strict=True)]
        else:
            parts = [make_part(ds, r, None) for ds, r in zip(indexed, elements, strict=True)]
            w = _normalize([len(p) for p in parts])
            if n > sum(len(p) for p in parts):
                raise ConfigError(
                    f"data.paths: the {name} split has {sum(len(p) for p in parts)} samples "
                    f"in one epoch but {n} are requested; give weights ([w1, prefix1, ...]) "
                    "to repeat data, or add data"
                )
        result.append(build_blended_dataset(parts, w, n, name, cache_dir))
    return tuple(result)
