"""The pre-step-1 token-id check of a 1e9-token dataset: its first (scanning) and cached costs.

Writes 1e9 uint16 tokens (1000 documents of 1e6, 2 GB) with the real IndexedDatasetWriter in a
temporary directory, deleted afterwards, then times megatron.data.token_range's check as
training calls it: once with an empty cache (the chunked scan, plus writing the entry) and then
cached (the best of --repeats). The baseline is one plain numpy ``max`` over the memory-mapped
tokens in the same process. The file was just written, so the scan reads a warm page cache; from
a cold disk the first check is bound by the disk instead. Prints one JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_token_check.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.indexed_dataset import IndexedDatasetWriter, data_path  # noqa: E402
from megatron.data.token_range import check_indexed_ids  # noqa: E402

VOCAB = 50257  # GPT-2's
DOC_TOKENS = 10**6


def write_dataset(prefix: str, tokens: int) -> int:
    """``tokens`` ids below VOCAB in documents of DOC_TOKENS; returns the largest id written."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, VOCAB - 1, DOC_TOKENS, dtype=np.uint16)  # the top id comes last
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(tokens // DOC_TOKENS):
            doc = np.roll(base, i)
            if i == tokens // DOC_TOKENS - 1:
                doc[-1] = VOCAB - 1
            w.add_document([doc])
    return VOCAB - 1


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e9)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokens = int(args.tokens) // DOC_TOKENS * DOC_TOKENS
    with tempfile.TemporaryDirectory(prefix="bench_token_check-") as tmp:
        prefix, cache = os.path.join(tmp, "data"), os.path.join(tmp, "cache")
        write_s, top = timed(lambda: write_dataset(prefix, tokens))
        numpy_s, numpy_max = timed(lambda: int(np.memmap(data_path(prefix), np.uint16, "r").max()))
        uncached_s, first = timed(lambda: check_indexed_ids(prefix, VOCAB, cache))
        cached = [
            timed(lambda: check_indexed_ids(prefix, VOCAB, cache)) for _ in range(args.repeats)
        ]
        assert first.highest == numpy_max == top and all(r == first for _, r in cached)
        print(
            json.dumps(
                {
                    "benchmark": "token_check",
                    "tokens": tokens,
                    "dtype": "uint16",
                    "max_id": first.highest,
                    "write_s": round(write_s, 3),
                    "uncached_s": round(uncached_s, 3),
                    "cached_s": round(min(s for s, _ in cached), 4),
                    "numpy_max_baseline_s": round(numpy_s, 3),
                    "load_avg_1m": os.getloadavg()[0],
                    "cpus": os.cpu_count(),
                }
            )
        )


if __name__ == "__main__":
    main()
