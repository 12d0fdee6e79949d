"""Sliding-window perplexity tokens/s: ours (tools/evaluate.py's text task: windows batched, the
LM head and the loss at the scored positions only) against the standard transformers recipe
(one window at a time through GPT2LMHeadModel, labels -100 but at the scored targets, the mean
loss times their count) on the same checkpoint exported to HF.

Same process, same threads, same token stream, the same windows (``SlidingWindows``: --seq-length
inputs every --stride tokens, each target scored once); the two alternate (ours, HF, ours, ...)
so a busy neighbour slows both alike. Without --load the checkpoint is one training step of
bench_pretrain's 4-layer, hidden-256 GPT with a 32768-piece sentencepiece vocabulary over the
sample corpus: a vocabulary that makes the LM head the largest GEMM, as GPT-2's does. The text
is --input, or the sample corpus beside the tokenizer, cut to --tokens. Prints one JSON line:
{ours_tok_s, hf_tok_s, ratio, ours_ppl, hf_ppl, ppl_rel_diff, tokens, windows, shape, threads,
loadavg}; the rates are medians of scored target tokens per second.

    .venv/bin/python benchmarks/bench_evaluate.py
"""

from __future__ import annotations

import argparse
import json
import math
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

from benchmarks.bench_generate import scratch_checkpoint  # noqa: E402
from megatron.checkpoint import find_checkpoint  # noqa: E402
from megatron.inference.evaluation import SlidingWindows  # noqa: E402
from megatron.inference.loading import load_for_inference  # noqa: E402
from megatron.inference.tasks import token_stream  # noqa: E402
from megatron.interop.export import export_hf  # noqa: E402
from megatron.parallel.state import shutdown  # noqa: E402
from tools.evaluate import Evaluator  # noqa: E402

VOCAB = 32768


def corpus_text(load: str) -> str:
    """The documents of the sample corpus beside the checkpoint's tokenizer, as one text."""
    _, meta = find_checkpoint(load)
    path = Path(meta["config"]["tokenizer"]["model"]).parent / "corpus.jsonl"
    with open(path, encoding="utf-8") as f:
        return "\n\n".join(json.loads(line)["text"] for line in f)


def timed(fn: Callable[[], float]) -> tuple[float, float]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def measure(
    load: str,
    text: str,
    tokens: int,
    seq_length: int,
    stride: int,
    micro_batch_size: int,
    repeats: int,
    hf_dir: str,
) -> dict:
    """Both sides on the first ``tokens`` + 1 tokens of ``text``: median tokens/s (after one
    warm-up round) and perplexity."""
    loaded = load_for_inference(load, [])
    args = argparse.Namespace(
        seq_length=seq_length, stride=stride, micro_batch_size=micro_batch_size, task="text"
    )
    ev = Evaluator(args, loaded)
    ids = token_stream(text, loaded.tokenizer, "corpus")[: tokens + 1]
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    hf = transformers.GPT2LMHeadModel.from_pretrained(export_hf(load, hf_dir)).eval()
    stream = torch.from_numpy(ids)
    windows = SlidingWindows(len(ids), seq_length, stride)

    def run_ours() -> float:
        return ev.stream_loss(ids).ppl

    @torch.inference_mode()
    def run_hf() -> float:
        nll, scored = 0.0, 0
        for w in windows:
            inputs = stream[None, w.start : w.start + w.length]
            # our windows' targets, already one position on: HF's pre-shifted labels
            targets = stream[None, w.start + 1 : w.start + w.length + 1].clone()
            targets[:, : w.first_scored] = -100
            loss = hf(input_ids=inputs, labels=targets, shift_labels=targets).loss
            count = w.length - w.first_scored
            nll, scored = nll + loss.item() * count, scored + count
        return math.exp(nll / scored)

    runs = {"ours": run_ours, "hf": run_hf}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    ppl: dict[str, float] = {}
    for i in range(1 + repeats):  # one warm-up round, then interleaved timed rounds
        for name, run in runs.items():
            s, ppl[name] = timed(run)
            if i:
                seconds[name].append(s)
    shutdown()
    targets = len(ids) - 1
    ours_tok_s = targets / statistics.median(seconds["ours"])
    hf_tok_s = targets / statistics.median(seconds["hf"])
    m = loaded.cfg.model
    return {
        "ours_tok_s": round(ours_tok_s, 1),
        "hf_tok_s": round(hf_tok_s, 1),
        "ratio": round(ours_tok_s / hf_tok_s, 3),
        "ours_ppl": ppl["ours"],
        "hf_ppl": ppl["hf"],
        "ppl_rel_diff": abs(ppl["ours"] - ppl["hf"]) / ppl["hf"],
        "tokens": targets,
        "windows": len(windows),
        "shape": {
            "seq_length": seq_length,
            "stride": stride,
            "micro_batch_size": micro_batch_size,
            "layers": m.num_layers,
            "hidden": m.hidden_size,
            "vocab": loaded.tokenizer.vocab_size,
        },
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load", help="checkpoint to use (default: a scratch one)")
    parser.add_argument(
        "--input", help="text file to score (default: the corpus beside the tokenizer)"
    )
    parser.add_argument("--tokens", type=int, default=8192, help="targets scored per run")
    parser.add_argument("--seq-length", type=int, default=256, help="window length")
    parser.add_argument("--stride", type=int, default=128, help="window step")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="our windows per batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as work:
        # A vocabulary near GPT-2's: the LM head's share of the time is then realistic.
        load = args.load or scratch_checkpoint(Path(work), VOCAB, size_mb=2)
        result = measure(
            load,
            Path(args.input).read_text(encoding="utf-8") if args.input else corpus_text(load),
            args.tokens,
            args.seq_length,
            args.stride,
            args.micro_batch_size,
            args.repeats,
            f"{work}/hf",
        )
    result |= {
        "threads": torch.get_num_threads(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
