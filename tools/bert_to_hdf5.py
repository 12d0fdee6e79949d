"""Write BERT samples of sentence-split data as NVIDIA-style pre-masked HDF5 shards.

Sample i of the shards (in shard order) is ``BertDataset[i]`` for the same data, split, seed and
options, so a run reading the shards sees exactly the batches it would have made itself::

    python tools/bert_to_hdf5.py --data-path data/corpus_text_sentence --vocab-file vocab.txt \\
        --output-prefix data/shards/train --seq-length 128 --num-samples 1000000

Each shard ``{output_prefix}_{k:05d}.hdf5`` is written under a temporary name and renamed when
complete. Layout: megatron/data/hdf5_dataset.py.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.bert_dataset import BertDataset, BertVocab, masked_count  # noqa: E402
from megatron.data.hdf5_dataset import write_shard  # noqa: E402
from megatron.data.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.data.splits import SPLIT_NAMES, split_ranges  # noqa: E402
from megatron.data.tokenizers.factory import build_tokenizer  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-path", required=True, help="sentence-split dataset prefix")
    p.add_argument("--vocab-file", required=True, help="the BERT vocab.txt the data was made with")
    p.add_argument("--output-prefix", required=True, help="shards are {prefix}_{k:05d}.hdf5")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-samples", type=int, default=None, help="default: one epoch")
    p.add_argument("--split", default="1,0,0", help='documents split as in data.split, "949,50,1"')
    p.add_argument("--split-name", choices=SPLIT_NAMES, default="train")
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--max-ngram", type=int, default=3)
    p.add_argument(
        "--no-binary-head",
        action="store_true",
        help="samples for BERT without the sentence-order head: [CLS] A [SEP], never swapped",
    )
    p.add_argument(
        "--max-predictions-per-seq",
        type=int,
        default=None,
        help="width of masked_lm_positions; default: the most a sample can mask",
    )
    p.add_argument("--samples-per-shard", type=int, default=1 << 16)
    p.add_argument("--cache-dir", default=None, help="where the sample mapping is cached")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers making samples")
    return p


def _as_list(batch: list) -> list:
    """Collate into a plain list: the shard writer wants the numpy sample dicts, not tensors."""
    return batch


def convert(args: argparse.Namespace) -> list[str]:
    """Write the shards; returns their paths."""
    stale = glob.glob(f"{glob.escape(args.output_prefix)}_[0-9][0-9][0-9][0-9][0-9].hdf5")
    if stale:
        raise ConfigError(
            f"--output-prefix={args.output_prefix}: {len(stale)} shards already exist (e.g. "
            f"{stale[0]}); remove them or choose another prefix, so old and new shards never mix"
        )
    vocab = BertVocab.from_tokenizer(build_tokenizer("wordpiece", vocab_file=args.vocab_file))
    indexed = IndexedDataset(args.data_path)
    documents = split_ranges(args.split, indexed.num_documents)[SPLIT_NAMES.index(args.split_name)]
    if documents is None or documents[0] == documents[1]:
        raise ConfigError(
            f'--split="{args.split}" gives the {args.split_name} split no documents of '
            f"{args.data_path}; give it weight"
        )
    dataset = BertDataset(
        indexed,
        documents,
        args.num_samples,
        args.seq_length,
        args.seed,
        args.cache_dir,
        vocab,
        args.masked_lm_prob,
        args.short_seq_prob,
        args.max_ngram,
        not args.no_binary_head,
    )
    bound = masked_count(args.seq_length - 3, args.masked_lm_prob)
    max_predictions = args.max_predictions_per_seq or bound
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.samples_per_shard,
        num_workers=args.workers,
        collate_fn=_as_list,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    paths = []
    with tqdm(total=len(dataset), unit="sample", desc="bert_to_hdf5") as progress:
        for k, samples in enumerate(loader):
            path = f"{args.output_prefix}_{k:05d}.hdf5"
            write_shard(path, samples, max_predictions)
            paths.append(path)
            progress.update(len(samples))
    return paths


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; a user mistake prints one line and returns its exit code (2;
    4: storage refused a write)."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        paths = convert(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(
        f"wrote {len(paths)} shards to {args.output_prefix}_*.hdf5 in "
        f"{time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
