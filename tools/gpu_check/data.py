"""Synthetic token ids as a ``.bin``/``.idx`` dataset, for NullTokenizer runs with no corpus.

Throughput depends on the shapes and the vocabulary, not on what the tokens say, so uniform
random ids of the real vocabulary size (GPT-2's 50257 with EOD) measure what real text would.
"""

from __future__ import annotations

import numpy as np

from megatron.data.indexed_dataset import IndexedDatasetWriter, best_dtype


def write_null_dataset(prefix: str, vocab_size: int, tokens: int, seed: int) -> str:
    """About ``tokens`` random ids in ``[0, vocab_size)`` as documents of 100-2000 tokens, each
    ending in EOD (id ``vocab_size``, NullTokenizer's); returns ``prefix`` for ``data.paths``."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(100, 2000, size=max(1, tokens // 1000))
    ids = rng.integers(0, vocab_size, size=int(lengths.sum()), dtype=np.int64)
    ends = np.cumsum(lengths) - 1
    ids[ends] = vocab_size  # each document's last token is EOD
    with IndexedDatasetWriter(prefix, best_dtype(vocab_size + 1)) as writer:
        writer.add_documents(ids, lengths, np.ones(len(lengths), dtype=np.int64))
    return prefix
