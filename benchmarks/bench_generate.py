"""Greedy generation tokens/s: ours (KV cache through the TP=1 model) against HF's
``generate`` on the same checkpoint exported as GPT2LMHeadModel.

Same process, same threads, same prompts (a batch of equal-length random token ids, so neither
side pads), eod ignored on both sides so every run makes exactly ``--new-tokens`` per prompt;
the two alternate (ours, HF, ours, ...) so a busy neighbour slows both alike. Without --load the
checkpoint is one training step of a 4-layer, hidden-256 GPT over the sample corpus (vocab 512).
Prints one JSON line: {ours_tok_s, hf_tok_s, ratio, same_tokens, shape, threads, loadavg}; the
rates are medians.

    .venv/bin/python benchmarks/bench_generate.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_pretrain import SHAPE  # noqa: E402
from megatron.inference.generation import generate  # noqa: E402
from megatron.inference.loading import load_for_inference  # noqa: E402
from megatron.interop.export import export_hf  # noqa: E402
from megatron.parallel.state import shutdown  # noqa: E402
from tests.gpt_run import prepare_gpt_data, run_pretrain, tiny_overrides  # noqa: E402


def scratch_checkpoint(work: Path, vocab_size: int = 512, size_mb: float = 0.5) -> str:
    """A save directory holding one training step of bench_pretrain's model with a
    ``vocab_size``-piece tokenizer over a ``size_mb`` sample corpus (the real tools and
    entrypoint)."""
    data = prepare_gpt_data(work, vocab_size, size_mb)
    extra = {
        **SHAPE,
        "checkpoint.save": work / "ckpt",
        "parallel.tensor_parallel_size": 1,
        "training.train_iters": 1,
        "optimizer.lr_warmup_iters": 0,
    }
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", tiny_overrides(data, work, **extra))
    return str(work / "ckpt")


def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load", help="checkpoint to use (default: a scratch one)")
    parser.add_argument("--batch", type=int, default=4, help="prompts per batch")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as work:
        load = args.load or scratch_checkpoint(Path(work))
        ours = load_for_inference(load, [])
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        hf = transformers.GPT2LMHeadModel.from_pretrained(export_hf(load, f"{work}/hf")).eval()
    eod = ours.tokenizer.eod
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ours.tokenizer.vocab_size, (args.batch, args.prompt_tokens), generator=g)
    n = args.new_tokens

    def run_ours() -> list[list[int]]:
        return [r.tokens for r in generate(ours.model, ids.tolist(), n, eod, stop_at_eod=False)]

    @torch.inference_mode()
    def run_hf() -> list[list[int]]:
        # eos given per call: a generation_config saying None gets the model's eos merged in.
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,  # run the full length, like ours
            pad_token_id=eod,
        )
        return out[:, args.prompt_tokens :].tolist()

    runs = {"ours": run_ours, "hf": run_hf}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, list[list[int]]] = {}
    for i in range(1 + args.repeats):  # one warm-up round, then interleaved timed rounds
        for name, run in runs.items():
            s, tokens[name] = timed(run)
            if i:
                seconds[name].append(s)
    shutdown()

    ours_tok_s = args.batch * n / statistics.median(seconds["ours"])
    hf_tok_s = args.batch * n / statistics.median(seconds["hf"])
    result = {
        "ours_tok_s": round(ours_tok_s, 1),
        "hf_tok_s": round(hf_tok_s, 1),
        "ratio": round(ours_tok_s / hf_tok_s, 3),
        "same_tokens": tokens["ours"] == tokens["hf"],
        "shape": {
            "batch": args.batch,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": n,
            "layers": ours.cfg.model.num_layers,
            "hidden": ours.cfg.model.hidden_size,
            "vocab": ours.tokenizer.vocab_size,
        },
        "threads": torch.get_num_threads(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
