"""Megatron's BERT sample mapping: which sentences of which document form each sample.

A row ``(first, end, target)`` names the sentences ``[first, end)`` of one document and the
sample's target length in tokens. Each epoch regroups every eligible document greedily into rows,
with target lengths drawn from a counter-based generator keyed by (seed, epoch, first sentence),
so the rows never depend on how the build batches its work; the rows of an epoch are then
shuffled. Documents advance in lockstep (one sample per numpy step), so the build is vectorised
over documents and epochs.
"""

from __future__ import annotations

import math

import numpy as np

# Megatron skips documents holding a "sentence" this long: such lines are tables or code, not prose.
LONG_SENTENCE_TOKENS = 512
# Bump when the mapping algorithm changes, so stale caches are not reused.
MAPPING_VERSION = 1
# Entries of the lockstep frontier per batch of epochs (bounds the builder's memory).
_FRONTIER_CAP = 1 << 24


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective scramble of uint64 (the wrap-around is intended)."""
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


def _epoch_keys(seed: int, epochs: np.ndarray) -> np.ndarray:
    """One random uint64 per (seed, epoch): the key of that epoch's target lengths."""
    return _mix64(_mix64(np.array([seed], dtype=np.uint64)) + epochs.astype(np.uint64))


def _targets(
    keys: np.ndarray, firsts: np.ndarray, max_length: int, short_prob: float
) -> np.ndarray:
    """Per sample ``max_length``, or with probability ``short_prob`` uniform in [2, max_length].

    A counter-based generator: one hash of (epoch key, first sentence) per sample, so the mapping
    is the same however the build batches its epochs. Its high 32 bits decide whether the sample
    is short and the low 32 bits pick the short length, two independent draws.
    """
    bits = _mix64(keys + firsts.astype(np.int64).view(np.uint64))
    short = (bits >> 32) < np.uint64(round(short_prob * 2**32))
    lengths = 2 + (bits & 0xFFFFFFFF) % np.uint64(max_length - 1)
    return np.where(short, lengths.astype(np.int64), max_length)


def build_sample_mapping(
    document_indices: np.ndarray,
    sequence_lengths: np.ndarray,
    num_samples: int | None,
    max_length: int,
    short_seq_prob: float,
    seed: int,
    min_sentences: int = 2,
) -> np.ndarray:
    """Megatron's BERT sample mapping: rows ``(first sentence, end sentence, target length)``.

    ``document_indices`` bounds the documents to use (sentence ids, documents+1 entries). Documents
    with fewer than ``min_sentences`` sentences (2 for a binary head: one on each side of the
    pivot) or with a sentence over LONG_SENTENCE_TOKENS are skipped. Each sample starts where the
    previous one ended and takes sentences until it holds ``target`` tokens and ``min_sentences``
    sentences, unless that would leave a single sentence behind: the document's last sample takes
    the rest. Every document advances one sample per numpy step (all documents in lockstep), so
    the work is vectorised over documents and epochs. Whole epochs are built until
    ``num_samples`` rows exist (one epoch when None); rows are shuffled within their epoch and the
    surplus of the last epoch is dropped. Empty when nothing is eligible.
    """
    docs = np.asarray(document_indices, dtype=np.int64)
    base = int(docs[0])
    sizes = sequence_lengths[base : docs[-1]]
    # widen before the cumsum: numpy's casting accumulate is an order of magnitude slower
    cum_tokens = np.concatenate([[0], np.cumsum(sizes.astype(np.int64))])
    first, stop = docs[:-1] - base, docs[1:] - base
    long = np.flatnonzero(sizes > LONG_SENTENCE_TOKENS)
    has_long = np.searchsorted(long, stop) > np.searchsorted(long, first)
    eligible = (stop - first >= min_sentences) & ~has_long
    doc_first, doc_stop = first[eligible], stop[eligible]
    if len(doc_first) == 0 or num_samples == 0:
        return np.zeros((0, 3), dtype=np.int32)

    dtype = np.int32 if docs[-1] <= np.iinfo(np.int32).max else np.int64  # halves the cache
    rows: list[np.ndarray] = []  # one [samples, 3] array per epoch, shuffled
    built, epoch = 0, 0
    while epoch == 0 or (num_samples is not None and built < num_samples):
        n_epochs = 1
        if epoch > 0:  # batch the epochs still needed, estimated from the first one
            wanted = math.ceil((num_samples - built) / len(rows[0]))
            n_epochs = max(1, min(wanted, _FRONTIER_CAP // len(doc_first)))
        epoch_ids = np.arange(epoch, epoch + n_epochs)
        pieces = _group_sentences(
            cum_tokens, doc_first, doc_stop, epoch_ids, base,
            max_length, short_seq_prob, seed, min_sentences,
        )  # fmt: skip
        for e, piece in zip(epoch_ids.tolist(), pieces, strict=True):
            if num_samples is not None and built >= num_samples:
                break
            order = np.random.default_rng([seed, e]).permutation(len(piece))
            if num_samples is not None:
                order = order[: num_samples - built]
            rows.append(piece[order].astype(dtype))
            built += len(order)
        epoch += n_epochs
    return np.concatenate(rows)


def _group_sentences(
    cum_tokens: np.ndarray,
    doc_first: np.ndarray,
    doc_stop: np.ndarray,
    epoch_ids: np.ndarray,
    base: int,
    max_length: int,
    short_seq_prob: float,
    seed: int,
    min_sentences: int,
) -> list[np.ndarray]:
    """Group every document of every epoch in ``epoch_ids`` into samples; [n, 3] rows per epoch.

    All documents advance one sample per step. The frontier stays sorted by epoch, so each step's
    rows split into per-epoch runs, and each epoch's rows come out in the same order however the
    epochs are batched.
    """
    epochs = np.repeat(epoch_ids, len(doc_first))
    keys = np.repeat(_epoch_keys(seed, epoch_ids), len(doc_first))
    starts, stops = np.tile(doc_first, len(epoch_ids)), np.tile(doc_stop, len(epoch_ids))
    per_epoch: list[list[tuple[np.ndarray, ...]]] = [[] for _ in epoch_ids]
    while len(starts):
        target = _targets(keys, starts + base, max_length, short_seq_prob)
        # the sentence at which the running token count reaches the target
        last = np.searchsorted(cum_tokens, cum_tokens[starts] + target) - 1
        last = np.maximum(last, starts + min_sentences - 1)
        last = np.where(last > stops - 3, stops - 1, last)  # never leave one sentence behind
        bounds = np.searchsorted(epochs, epoch_ids, side="right").tolist()
        for k, (lo, hi) in enumerate(zip([0, *bounds[:-1]], bounds, strict=True)):
            if hi > lo:
                per_epoch[k].append((starts[lo:hi], last[lo:hi] + 1, target[lo:hi]))
        more = last + 1 < stops
        epochs, keys, starts, stops = epochs[more], keys[more], last[more] + 1, stops[more]
    rows = []
    for pieces in per_epoch:
        first, end, target = (np.concatenate(column) for column in zip(*pieces, strict=True))
        rows.append(np.stack([first + base, end + base, target], axis=1))
    return rows
