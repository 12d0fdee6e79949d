"""Evaluate a GPT checkpoint: sliding-window perplexity of a text or WikiText file, LAMBADA
last-word accuracy, or the loss on one split of indexed data. Prints one JSON line on rank 0.

    python tools/evaluate.py --load runs/gpt/checkpoints --task wikitext --input wiki.test.tokens \\
        --stride 64
    python -m megatron.launch.torchrun --standalone --nproc-per-node 4 tools/evaluate.py \\
        --tensor-parallel-size 2 --load runs/gpt/checkpoints --task lambada \\
        --input lambada_test.jsonl
    python tools/evaluate.py --load runs/gpt/checkpoints --task lm --split valid
    torchrun --standalone --nproc-per-node 2 tools/evaluate.py --load runs/gpt/checkpoints \\
        --task lm-eval --tasks hellaswag,arc_easy --num-fewshot 0 --batch-size 16

The TP size is --tensor-parallel-size (default: the world size), whatever the checkpoint's; the
data is split over DP = world / TP. Windows are --seq-length tokens (default: the model's
seq_length) every --stride tokens (default: --seq-length, no overlap). The tokenizer is the
checkpoint's unless the Megatron-style tokenizer flags name another. --output FILE appends the
same JSON line to FILE. ``--task lm-eval`` runs lm-eval-harness tasks on the checkpoint as it
is (megatron/inference/lm_eval_adapter.py), prints lm-eval's table and one JSON line per task,
and --output FILE writes lm-eval's results JSON. A user mistake prints one line ("error: ...")
on rank 0 and exits 2.
See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.splits import SPLIT_NAMES, parse_data_paths  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from megatron.inference.detokenize import wikitext_detokenize  # noqa: E402
from megatron.inference.evaluation import (  # noqa: E402
    LossTotal,
    SlidingWindows,
    score_last_words,
    score_windows,
)
from megatron.inference.jsonl import check_output  # noqa: E402
from megatron.inference.lm_eval_tasks import (  # noqa: E402
    run_tasks,
    split_names,
    task_lines,
    task_manager,
)
from megatron.inference.loading import (  # noqa: E402
    Loaded,
    add_tokenizer_flags,
    load_for_inference,
    tokenizer_overrides,
)
from megatron.inference.tasks import (  # noqa: E402
    lambada_examples,
    read_lambada,
    read_text,
    split_stream,
    token_stream,
    word_count,
)
from megatron.launch.torchrun import exit_with  # noqa: E402
from megatron.parallel import state as parallel_state  # noqa: E402
from megatron.parallel.launcher import launcher_env  # noqa: E402

TASKS = ("text", "wikitext", "lambada", "lm", "lm-eval")


def build_parser() -> argparse.ArgumentParser:
    """The command line, tokenizer flags included."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--load", required=True, help="a save directory, one iter_* directory, or a merged one"
    )
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--input", help="text file (text, wikitext) or JSONL file (lambada)")
    p.add_argument("--seq-length", type=int, help="window length (default: the model's)")
    p.add_argument("--stride", type=int, help="window step (default: --seq-length)")
    p.add_argument("--micro-batch-size", type=int, help="default: the checkpoint's")
    p.add_argument("--tensor-parallel-size", type=int, help="default: the world size")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="default: the checkpoint's")
    p.add_argument("--output", help="also append the JSON line to this file")
    lm = p.add_argument_group("lm task")
    lm.add_argument(
        "--data-path", nargs="+", help="indexed prefixes (default: the checkpoint's data.paths)"
    )
    lm.add_argument("--split", choices=SPLIT_NAMES, default="test")
    lm.add_argument("--split-weights", help='e.g. "949,50,1" (default: the checkpoint\'s)')
    harness = p.add_argument_group("lm-eval task")
    harness.add_argument("--tasks", help="lm-eval task names, comma-separated")
    harness.add_argument("--num-fewshot", type=int, help="default: each task's own")
    harness.add_argument("--limit", type=int, help="at most this many documents per task")
    harness.add_argument("--batch-size", type=int, help="requests per forward pass (default: 8)")
    harness.add_argument("--include-path", help="a directory of your own task YAMLs")
    harness.add_argument(
        "--log-samples", action="store_true", help="--output also holds every request's result"
    )
    add_tokenizer_flags(p)
    return p


HARNESS_FLAGS = ("tasks", "num_fewshot", "limit", "batch_size", "include_path", "log_samples")


def check_harness_args(args: argparse.Namespace) -> None:
    """The lm-eval task's flags; lm-eval itself and the task names are checked by
    ``task_manager``."""
    if args.input or args.data_path or args.split_weights or args.stride:
        raise ConfigError("--task lm-eval takes --tasks, not --input, --data-path or --stride")
    if not args.tasks:
        raise ConfigError("--task lm-eval needs --tasks T1,T2 (lm-eval task names)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot {args.num_fewshot}: must be >= 0 (0: no examples)")
    for flag in ("limit", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: must be >= 1")


def check_args(args: argparse.Namespace) -> None:
    """Flag mistakes, found before anything is loaded."""
    if args.task == "lm-eval":
        check_harness_args(args)
    elif any(getattr(args, flag) not in (None, False) for flag in HARNESS_FLAGS):
        raise ConfigError(
            "--tasks, --num-fewshot, --limit, --batch-size, --include-path and "
            "--log-samples go with --task lm-eval"
        )
    elif args.task == "lm":
        if args.input:
            raise ConfigError("--input goes with text, wikitext and lambada; lm takes --data-path")
    elif not args.input:
        raise ConfigError(f"--task {args.task} needs --input FILE")
    elif args.data_path or args.split_weights:
        raise ConfigError("--data-path and --split-weights go with --task lm")
    if args.task == "lambada" and args.stride:
        raise ConfigError("--stride goes with text, wikitext and lm; lambada has no windows")
    for flag in ("seq_length", "stride", "micro_batch_size", "tensor_parallel_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: must be >= 1")
    if args.output:
        check_output(args.output)


def window_lengths(args: argparse.Namespace, loaded: Loaded) -> tuple[int, int]:
    """(seq_length, stride): the flags, else the model's seq_length and no overlap."""
    model = loaded.cfg.model
    length = args.seq_length or model.seq_length
    if length > model.max_position_embeddings:
        raise ConfigError(
            f"--seq-length {length} exceeds the checkpoint's model.max_position_embeddings="
            f"{model.max_position_embeddings}; use at most {model.max_position_embeddings}"
        )
    stride = args.stride or length
    if stride > length:
        raise ConfigError(
            f"--stride {stride} exceeds --seq-length {length}: targets between windows would "
            "go unscored"
        )
    return length, stride


def loss_fields(total: LossTotal) -> dict[str, Any]:
    """The JSON fields of a summed loss."""
    return {"tokens": total.tokens, "loss": total.loss, "ppl": total.ppl}


class Evaluator:
    """The loaded model and the window settings, shared by the tasks."""

    def __init__(self, args: argparse.Namespace, loaded: Loaded) -> None:
        self.args, self.loaded = args, loaded
        self.seq_length, self.stride = window_lengths(args, loaded)
        self.micro_batch_size = args.micro_batch_size or loaded.cfg.training.micro_batch_size

    def stream_loss(self, tokens: np.ndarray) -> LossTotal:
        """Sliding-window loss of one token stream, every target once."""
        windows = SlidingWindows(len(tokens), self.seq_length, self.stride)
        return score_windows(
            self.loaded.model, tokens, windows, self.loaded.state, self.micro_batch_size
        )

    def text(self, text: str) -> dict[str, Any]:
        """Perplexity of the raw text, tokenized in one piece."""
        return loss_fields(
            self.stream_loss(token_stream(text, self.loaded.tokenizer, self.args.input))
        )

    def wikitext(self, text: str) -> dict[str, Any]:
        """Perplexity of the detokenized text, and per word of the original."""
        detokenized = wikitext_detokenize(text)
        total = self.stream_loss(token_stream(detokenized, self.loaded.tokenizer, self.args.input))
        words = word_count(text)
        return loss_fields(total) | {"words": words, "word_ppl": total.ppl_per(words)}

    def lambada(self, texts: list[str]) -> dict[str, Any]:
        """Strict last-word accuracy, and the loss over the last words' tokens."""
        tok = self.loaded.tokenizer
        examples = lambada_examples(texts, tok, self.seq_length, self.args.input)
        counts = score_last_words(
            self.loaded.model,
            examples,
            self.loaded.state,
            self.micro_batch_size,
            self.seq_length,
            tok.vocab_size,
        )
        accuracy = {"n": counts.n, "correct": counts.correct, "accuracy": counts.accuracy}
        return accuracy | loss_fields(counts.target)

    def lm(self) -> dict[str, Any]:
        """Each prefix's split scored on its own (windows never cross datasets), totals summed."""
        args, data = self.args, self.loaded.cfg.data
        prefixes, _ = parse_data_paths(args.data_path or data.paths)
        weights = args.split_weights or data.split
        per_dataset, loss_sum, tokens = [], 0.0, 0
        for prefix in prefixes:
            total = self.stream_loss(split_stream(prefix, weights, args.split))
            per_dataset.append({"prefix": prefix, **loss_fields(total)})
            loss_sum, tokens = loss_sum + total.loss_sum, tokens + total.tokens
        fields = loss_fields(LossTotal(loss_sum, tokens))
        return fields | {"split": args.split, "split_weights": weights, "datasets": per_dataset}

    def settings(self) -> dict[str, Any]:
        """How the result was computed."""
        state = self.loaded.state
        return {
            "seq_length": self.seq_length,
            "stride": None if self.args.task == "lambada" else self.stride,
            "micro_batch_size": self.micro_batch_size,
            "tensor_parallel_size": state.tp_size,
            "data_parallel_size": state.dp_size,
            "checkpoint": self.loaded.path,
        }


def harness(args: argparse.Namespace) -> dict[str, Any]:
    """lm-eval's tasks on the checkpoint: {"task", "results" (lm-eval's, None off DP rank 0),
    "lines" (one per task)}. Every check that needs no model runs before it is built."""
    from megatron.inference.lm_eval_adapter import MegatronLM

    names = split_names(args.tasks, "--tasks")
    manager = task_manager(names, args.include_path, "--task lm-eval")
    loaded = load_for_inference(
        args.load, tokenizer_overrides(args), args.tensor_parallel_size, args.dtype
    )
    if loaded.kind != "gpt":
        raise ConfigError(f"--load {args.load}: a {loaded.kind} checkpoint; evaluation needs GPT")
    batch_size = args.batch_size or 8
    lm = MegatronLM(loaded.model, loaded.tokenizer, loaded.state, batch_size)
    results = run_tasks(lm, names, manager, args.num_fewshot, args.limit, args.log_samples)
    settings = {
        "num_fewshot": args.num_fewshot,
        "limit": args.limit,
        "batch_size": batch_size,
        "tensor_parallel_size": loaded.state.tp_size,
        "data_parallel_size": loaded.state.dp_size,
        "checkpoint": loaded.path,
    }
    lines = task_lines(results, settings) if results is not None else []
    return {"task": args.task, "results": results, "lines": lines}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Read the input, load the checkpoint, score the task; the result (on every rank)."""
    check_args(args)
    if args.task == "lm-eval":
        return harness(args)
    # Inputs are read first, so that a bad file stops the run before the model loads.
    text = read_text(args.input) if args.task in ("text", "wikitext") else None
    texts = read_lambada(args.input) if args.task == "lambada" else None
    loaded = load_for_inference(
        args.load, tokenizer_overrides(args), args.tensor_parallel_size, args.dtype
    )
    if loaded.kind != "gpt":
        raise ConfigError(f"--load {args.load}: a {loaded.kind} checkpoint; evaluation needs GPT")
    ev = Evaluator(args, loaded)
    if args.task == "lambada":
        scores = ev.lambada(texts)
    elif args.task == "lm":
        scores = ev.lm()
    else:
        scores = getattr(ev, args.task)(text)
    return {"task": args.task} | scores | ev.settings()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; a user mistake is one line on rank 0 and exit 2."""
    args = build_parser().parse_args(argv)
    rank0 = int(launcher_env()["RANK"]) == 0
    try:
        result = run(args)
    except ConfigError as err:
        return exit_with(err)
    finally:
        parallel_state.shutdown()
    if not rank0:
        return 0
    if args.task == "lm-eval":
        print_harness(result, args.output)
        return 0
    line = json.dumps(result)
    print(line)
    if args.output:
        with open(args.output, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0


def print_harness(result: dict[str, Any], output: str | None) -> None:
    """lm-eval's table, one JSON line per task, and its results JSON into ``output``."""
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(result["results"]))
    for line in result["lines"]:
        print(json.dumps(line))
    if output:
        with open(output, "w", encoding="utf-8") as f:
            json.dump(result["results"], f, indent=2, default=handle_non_serializable)
            f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
