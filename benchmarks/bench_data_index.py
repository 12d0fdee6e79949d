"""Index-build time: GPT document/sample/shuffle indices and blend indices, ours vs megatron-core.

Synthetic corpora of ~1k-token documents (lengths uniform in [512, 1536)) at 1e8 and 1e9 tokens
(add 1e10 with --big), seq_length 1024, one epoch of samples. The megatron-core baseline is its
own pipeline: numpy tile + RandomState.shuffle for the document index, its compiled
``build_sample_idx`` for the sample index, arange + shuffle for the shuffle index; its C++ helper
is loaded by path because our package is also named ``megatron``. Both outputs are compared.
Each figure is the best of --repeats runs. Prints one JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_data_index.py
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import sys
import sysconfig
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.blended_dataset import blend_indices  # noqa: E402
from megatron.data.gpt_dataset import build_gpt_indices  # noqa: E402


def load_megatron_helpers():
    """megatron-core's helpers_cpp extension, or None when megatron-core is not installed."""
    pattern = os.path.join(
        sysconfig.get_paths()["purelib"], "megatron/core/datasets/helpers_cpp*.so"
    )
    found = glob.glob(pattern)
    if not found:
        return None
    spec = importlib.util.spec_from_file_location("helpers_cpp", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def megatron_gpt_indices(helpers, lengths: np.ndarray, num_samples: int, seq_length: int, seed):
    """megatron-core's one-epoch GPT index build (its Python steps, its C++ sample index)."""
    rng = np.random.RandomState(seed)
    document_index = np.arange(len(lengths), dtype=np.int32)
    rng.shuffle(document_index)
    tokens = int(lengths.sum(dtype=np.int64))
    sample_index = helpers.build_sample_idx_int32(
        lengths, document_index, seq_length, 1, tokens, True, 1
    )
    shuffle_index = np.arange(len(sample_index) - 1, dtype=np.uint32)
    rng.shuffle(shuffle_index)
    return {
        "document_index": document_index,
        "sample_index": sample_index,
        "shuffle_index": shuffle_index,
    }


def best_time(fn, repeats: int):
    """(best wall seconds, last result) over ``repeats`` calls."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="also 1e10 tokens (~1.5 GB of RAM)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--blend-samples", type=int, default=10**7)
    args = parser.parse_args()
    helpers = load_megatron_helpers()
    seed, seq_length = 1234, args.seq_length

    gpt = []
    for tokens in [1e8, 1e9] + ([1e10] if args.big else []):
        num_docs = int(tokens // 1024)
        lengths = np.random.default_rng(0).integers(512, 1536, num_docs, dtype=np.int32)
        num_samples = (int(lengths.sum(dtype=np.int64)) - 1) // seq_length
        ours_s, ours = best_time(
            lambda lengths=lengths, n=num_samples: build_gpt_indices(
                lengths, (0, len(lengths)), n, seq_length, seed
            ),
            args.repeats,
        )
        row = {
            "tokens": int(lengths.sum(dtype=np.int64)),
            "documents": num_docs,
            "samples": num_samples,
            "ours_s": round(ours_s, 4),
        }
        if helpers is not None:
            mcore_s, ref = best_time(
                lambda lengths=lengths, n=num_samples: megatron_gpt_indices(
                    helpers, lengths, n, seq_length, seed
                ),
                args.repeats,
            )
            row["megatron_core_s"] = round(mcore_s, 4)
            row["identical"] = all(np.array_equal(ours[k], ref[k]) for k in ref)
        gpt.append(row)

    weights = np.array([0.5, 0.3, 0.2])
    blend_s, (dataset_index, _) = best_time(
        lambda: blend_indices(weights, args.blend_samples), args.repeats
    )
    blend = {"samples": args.blend_samples, "datasets": 3, "ours_s": round(blend_s, 4)}
    if helpers is not None:

        def greedy():
            index = np.zeros(args.blend_samples, dtype=np.int16)
            sample = np.zeros(args.blend_samples, dtype=np.int64)
            helpers.build_blending_indices(
                index, sample, weights, len(weights), args.blend_samples, False
            )
            return index

        greedy_s, greedy_index = best_time(greedy, args.repeats)
        blend["megatron_core_greedy_s"] = round(greedy_s, 4)
        ours_counts = np.bincount(dataset_index, minlength=3)
        greedy_counts = np.bincount(greedy_index, minlength=3)
        blend["final_count_diff"] = int(np.abs(ours_counts - greedy_counts).max())

    print(
        json.dumps(
            {
                "benchmark": "data_index_build",
                "seq_length": seq_length,
                "load_avg_1m": os.getloadavg()[0],
                "cpus": os.cpu_count(),
                "gpt": gpt,
                "blend": blend,
            }
        )
    )


if __name__ == "__main__":
    main()
