"""Generate text from a checkpoint, at the TP size of the launch (the world size).

    python tools/generate.py --load runs/gpt/checkpoints --prompt "def main(" --max-new-tokens 32
    python -m megatron.launch.torchrun --standalone --nproc-per-node 2 tools/generate.py \\
        --load runs/gpt/checkpoints --input prompts.jsonl --output out.jsonl --top-p 0.9 --seed 7

Greedy unless one of --temperature, --top-k, --top-p is given. --input lines are JSON objects
with a "prompt"; each output line is that object plus "text" and "tokens" (the continuation
only) and "stop" ("eod", "max_new_tokens" or "max_positions"). An empty prompt starts from
end-of-document, the token every document of the training data follows. Only rank 0 prints and
writes; the output file appears complete or not at all. A user mistake prints one line
("error: ...") on rank 0 and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.atomic_file import write_atomic  # noqa: E402
from megatron.data.tokenizers.base import Tokenizer  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from megatron.inference.generation import Generation, check_prompts, generate  # noqa: E402
from megatron.inference.jsonl import check_output, read_records  # noqa: E402
from megatron.inference.loading import (  # noqa: E402
    add_tokenizer_flags,
    load_for_inference,
    tokenizer_overrides,
)
from megatron.inference.sampling import SamplingParams  # noqa: E402
from megatron.launch.torchrun import exit_with  # noqa: E402
from megatron.parallel import state as parallel_state  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command line, tokenizer flags included."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--load", required=True, help="a save directory, one iter_* directory, or a merged one"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt; its continuation goes to stdout")
    source.add_argument("--input", help='JSONL file of {"prompt": ...} objects')
    parser.add_argument("--output", help="JSONL file to write (with --input)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, help="sample at this temperature")
    parser.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    parser.add_argument("--top-p", type=float, help="sample from the top-p probability mass")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the sampling generator")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per batch (--input)")
    parser.add_argument(
        "--ignore-eod", action="store_true", help="keep generating past end-of-document"
    )
    add_tokenizer_flags(parser)
    return parser


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """Greedy unless a sampling flag is given; then 1.0, 0 and 1.0 stand for the others."""
    flags = (args.temperature, args.top_k, args.top_p)
    if all(f is None for f in flags):
        return SamplingParams()
    t, k, p = (d if f is None else f for f, d in zip(flags, (1.0, 0, 1.0)))
    return SamplingParams(greedy=False, temperature=t, top_k=k, top_p=p)


def read_requests(path: str) -> list[dict]:
    """The JSON objects of ``path``, each with a string "prompt"; blank lines are skipped."""
    return [record for _, record in read_records(path, "prompt", '{"prompt": "..."}')]


def check_args(args: argparse.Namespace) -> None:
    """Flag mistakes, found before anything is loaded."""
    if args.input and not args.output:
        raise ConfigError("--input needs --output FILE")
    if args.output and not args.input:
        raise ConfigError("--output goes with --input; --prompt prints to stdout")
    if args.output:
        check_output(args.output)
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 0")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: must be >= 1")


def continuation(tokenizer: Tokenizer, prompt: list[int], gen: list[int]) -> str:
    """The text ``gen`` adds to ``prompt``: decoded with the prompt, so that a sentencepiece
    word boundary at the seam keeps its space; alone where decoding is not prefix-stable."""
    head, whole = tokenizer.decode(prompt), tokenizer.decode(prompt + gen)
    return whole[len(head) :] if whole.startswith(head) else tokenizer.decode(gen)


def run(args: argparse.Namespace) -> int:
    """Load, generate every prompt, and print or write the results on rank 0."""
    check_args(args)
    params = sampling_params(args)
    requests = read_requests(args.input) if args.input else [{"prompt": args.prompt}]
    loaded = load_for_inference(args.load, tokenizer_overrides(args))
    if loaded.kind != "gpt":
        raise ConfigError(f"--load {args.load}: a {loaded.kind} checkpoint; generation needs GPT")
    tok = loaded.tokenizer
    encoded = [tok.encode(r["prompt"]) for r in requests]
    prompts = [ids or [tok.eod] for ids in encoded]
    check_prompts(prompts, loaded.cfg.model.max_position_embeddings)
    generator = torch.Generator(loaded.state.device).manual_seed(args.seed)
    results: list[Generation] = []
    for i in range(0, len(prompts), args.batch_size):
        batch = prompts[i : i + args.batch_size]
        results += generate(
            loaded.model,
            batch,
            args.max_new_tokens,
            tok.eod,
            params,
            generator,
            stop_at_eod=not args.ignore_eod,
        )
    if not loaded.state.is_first:
        return 0
    texts = [continuation(tok, ids, g.tokens) for ids, g in zip(encoded, results)]
    if args.prompt is not None:
        print(texts[0])
        print(f"stop: {results[0].stop} after {len(results[0].tokens)} tokens", file=sys.stderr)
        return 0
    lines = [
        json.dumps({**r, "text": text, "tokens": g.tokens, "stop": g.stop}) + "\n"
        for r, text, g in zip(requests, texts, results)
    ]

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)

    write_atomic(args.output, write)
    stops = ", ".join(f"{k}: {v}" for k, v in sorted(Counter(g.stop for g in results).items()))
    print(f"wrote {len(lines)} lines to {args.output} (stop {stops})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; a user mistake is one line on rank 0 and exit 2."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ConfigError as err:
        return exit_with(err)
    finally:
        parallel_state.shutdown()


if __name__ == "__main__":
    sys.exit(main())
