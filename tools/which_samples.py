"""Which documents one training step saw: for each sample of iteration N's global batch, its
source dataset, the document (sequence) ids it spans, the offset into the first, and the first
words of its text.

    python tools/which_samples.py --load runs/gpt_tiny/checkpoints --iteration 120
    python tools/which_samples.py --config configs/gpt_tiny.yaml --iteration 3 --json

``--load`` takes the run's config from the checkpoint (its data, seed, batch size: what it
trained on); ``--config`` (and ``section.key=value`` overrides) a config of your own. The
sample order does not depend on the number of processes: step N reads samples (N-1)*gbs to
N*gbs - 1 of the train split, DP rank r the r-th contiguous share of them. Skipped batches (the
checkpoint's skip list, which the spike guard writes, and ``data.skip_batches``) are passed over
as the run passes over them. ``--json`` prints one JSON object per sample. GPT data only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint.load import find_checkpoint  # noqa: E402
from megatron.config import skip_list  # noqa: E402
from megatron.config.load import config_from_dict, load_config  # noqa: E402
from megatron.data.provenance import provenance, step_samples  # noqa: E402
from megatron.data.splits import samples_per_split  # noqa: E402
from megatron.data.tokenizers.factory import build_tokenizer  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from megatron.launch.torchrun import exit_with  # noqa: E402
from pretrain_gpt import datasets_provider  # noqa: E402


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--load", help="a save directory or checkpoint: its run's config")
    given.add_argument("--config", action="append", help="YAML config (repeatable)")
    p.add_argument("--iteration", type=int, required=True, help="the step, from 1")
    p.add_argument("--words", type=int, default=12, help="words of each sample's text shown")
    p.add_argument("--json", action="store_true", help="one JSON object per sample")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _args(argv)
    try:
        skip: skip_list.Ranges = []
        if args.load:
            path, meta = find_checkpoint(args.load)
            cfg = config_from_dict(meta["config"], f"{path}/meta.json", args.overrides)
            skip = meta["progress"].get("skip_batches", [])
        else:
            cfg = load_config(args.config, args.overrides)
        skip = skip_list.with_config(skip, cfg)
        if cfg.model.type == "bert":
            raise ConfigError("which_samples.py reads GPT data; this config trains BERT")
        t = cfg.training
        if not 1 <= args.iteration <= t.train_iters:
            raise ConfigError(
                f"--iteration {args.iteration}: the run has iterations 1 to {t.train_iters}"
            )
        tokenizer = build_tokenizer(**asdict(cfg.tokenizer))
        needed = samples_per_split(t, skip_list.headroom(cfg))
        train, _, _ = datasets_provider(cfg, tokenizer, needed)
    except ConfigError as err:
        return exit_with(err)
    for k, idx in enumerate(step_samples(args.iteration, t.global_batch_size, skip)):
        where = provenance(train, idx)
        text = " ".join(tokenizer.decode(where.tokens[:64].tolist()).split()[: args.words])
        row = {"iteration": args.iteration, "sample": k, "source": where.source,
               "documents": where.documents, "offset": where.offset, "text": text}  # fmt: skip
        if args.json:
            print(json.dumps(row))
        else:
            docs = ",".join(map(str, where.documents))
            print(f"{k:4d}  {where.source}  documents {docs} (from token {where.offset})  {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
