"""Tokenize JSONL into Megatron's .bin/.idx files: ``{prefix}_{key}_{document|sentence}``.

Takes Megatron's flags, so existing scripts run unchanged::

    python tools/preprocess_data.py --input data/corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 4

Streams: lines are read in chunks and encoded by a worker pool (``megatron.data.jsonl_encoder``)
with a bounded number of chunks in flight; results are written in input order, one bulk write per
chunk, so memory stays flat and ``--workers 1`` and ``--workers N`` write byte-identical files.
Outputs live under temporary names until complete.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import multiprocessing
import multiprocessing.pool
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.indexed_dataset import IndexedDatasetWriter  # noqa: E402
from megatron.data.jsonl_encoder import ChunkResult, JsonlEncoder  # noqa: E402
from megatron.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402

# Bytes of input per chunk of work: small enough to balance the workers, large enough that
# the per-chunk costs (a task, a pickled result, a write) stay negligible.
CHUNK_BYTES = 1 << 18


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files named by ``--input``: paths or globs (sorted), in the order given."""
    paths = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [p for p in matches if os.path.exists(p) and not os.path.isdir(p)]
        if not matches:
            raise ConfigError(f"--input {pattern}: no such file; give JSONL files or globs")
        paths.extend(matches)
    return paths


def open_binary(path: str) -> BinaryIO:
    """A binary line reader of a plain or gzip (``.gz``) file."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb", buffering=1 << 20)


def read_chunks(paths: list[str]) -> Iterator[tuple[str, int, list[bytes]]]:
    """``(path, first line number, raw lines)`` chunks of whole lines, about CHUNK_BYTES each."""
    for path in paths:
        with open_binary(path) as f:
            first = 1
            # readlines(hint) stops after the line that crosses the hint: one C loop per chunk
            while lines := f.readlines(CHUNK_BYTES):
                yield path, first, lines
                first += len(lines)


def build_encoder(args: argparse.Namespace) -> JsonlEncoder:
    """The encoder of the command line (also checks the tokenizer files)."""
    tokenizer = build_tokenizer(
        args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file, args.lower_case
    )
    return JsonlEncoder(
        tokenizer, args.json_keys, args.split_sentences, args.append_eod, args.skip_bad_lines
    )


_WORKER: JsonlEncoder | None = None


def _init_worker(args: argparse.Namespace) -> None:
    global _WORKER
    # The parent handles Ctrl-C and tears the pool down; HF tokenizers must not fork threads.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = build_encoder(args)


def _start_pool(args: argparse.Namespace) -> multiprocessing.pool.Pool:
    """The worker pool, forked with SIGTERM at its default action (the kernel ends the process).

    Workers would otherwise inherit main()'s Python SIGTERM handler. A SIGTERM from
    Pool.terminate() that reaches a worker before its interpreter has finished forking is then
    dropped (CPython clears signals caught before that point), the worker waits for tasks on a
    lock terminate() holds, and the run hangs: 1 run in 40 on a loaded machine, before this.
    """
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args,))
    finally:
        signal.signal(signal.SIGTERM, previous)


def _encode_in_worker(chunk: tuple[str, int, list[bytes]]) -> ChunkResult:
    return _WORKER.encode_chunk(chunk)


def ordered_map(
    pool: multiprocessing.pool.Pool, fn: Callable, items: Iterable, depth: int
) -> Iterator:
    """``pool.imap(fn, items)`` with at most ``depth`` items in flight.

    Pool.imap reads its whole input ahead of the workers, so memory would grow with the file.
    """
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


@dataclass
class Summary:
    """What a run read and wrote."""

    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bad_lines: collections.Counter = field(default_factory=collections.Counter)
    first_bad: str = ""
    outputs: list[str] = field(default_factory=list)


def output_prefixes(args: argparse.Namespace) -> dict[str, str]:
    """Megatron's naming: ``{prefix}_{key}_{document|sentence}`` per JSON key."""
    level = "sentence" if args.split_sentences else "document"
    return {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}


def preprocess(args: argparse.Namespace) -> Summary:
    """Run the whole conversion; raises ConfigError on the first bad line unless skipping."""
    paths = expand_inputs(args.input)
    encoder = build_encoder(args)  # checks the tokenizer files before any work
    prefixes = output_prefixes(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    summary = Summary(outputs=list(prefixes.values()))
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        writers = {
            k: stack.enter_context(IndexedDatasetWriter(p, encoder.dtype))
            for k, p in prefixes.items()
        }
        if args.workers > 1:
            pool = stack.enter_context(_start_pool(args))
            results = ordered_map(pool, _encode_in_worker, read_chunks(paths), 2 * args.workers)
        else:
            results = map(encoder.encode_chunk, read_chunks(paths))
        progress = stack.enter_context(_progress())
        for result in results:
            _record_bad(summary, result.path, result.bad, args.skip_bad_lines)
            for key, writer in writers.items():
                writer.add_documents(
                    result.tokens[key], result.sequence_lengths[key], result.document_sizes[key]
                )
            summary.documents += result.documents
            summary.sequences += sum(len(v) for v in result.sequence_lengths.values())
            summary.tokens += sum(len(v) for v in result.tokens.values())
            summary.bytes += result.bytes
            _update(progress, summary, result.documents, time.perf_counter() - start)
    summary.seconds = time.perf_counter() - start
    return summary


def _record_bad(summary: Summary, path: str, bad: list[tuple[int, str]], skip: bool) -> None:
    for lineno, reason in bad:
        where = f"{path}:{lineno}: {reason}"
        if not skip:
            raise ConfigError(f"{where}; fix the line or pass --skip-bad-lines")
        summary.bad_lines[reason.split(" (")[0]] += 1
        summary.first_bad = summary.first_bad or where


@contextlib.contextmanager
def _progress():
    from tqdm import tqdm

    # disable=None: a bar on a terminal, silence in logs and tests.
    with tqdm(unit="doc", unit_scale=True, disable=None, file=sys.stderr) as bar:
        yield bar


def _update(bar, summary: Summary, documents: int, elapsed: float) -> None:
    bar.update(documents)
    bar.set_postfix_str(
        f"{summary.bytes / 1e6 / elapsed:.1f} MB/s, {summary.tokens / elapsed:,.0f} tokens/s",
        refresh=False,
    )


def build_parser() -> argparse.ArgumentParser:
    """Megatron's preprocess_data.py flags, plus --skip-bad-lines and --lower-case."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = p.add_argument
    add("--input", nargs="+", required=True, help="JSONL files or globs (plain or .gz)")
    add("--json-keys", nargs="+", default=["text"], help="keys to tokenize, one dataset each")
    split_help = (
        "one sequence per sentence. The splitter is a regex on sentence punctuation (. ! ? ... "
        "and CJK stops before a word that is not lower-case, except after abbreviations, "
        "initials and list numbers; blank lines), so it needs no model or download. A list of "
        "strings is taken as sentences."
    )
    add("--split-sentences", action="store_true", help=split_help)
    skip_help = "count and report bad lines instead of stopping at the first with file:line"
    add("--skip-bad-lines", action="store_true", help=skip_help)
    add("--tokenizer-type", required=True, choices=list(TOKENIZER_TYPES))
    add("--tokenizer-model", help="sentencepiece .model or HF tokenizer.json")
    add("--vocab-file", help="GPT-2 vocab.json or BERT vocab.txt")
    add("--merge-file", help="GPT-2 merges.txt")
    add("--lower-case", action="store_true", help="lower-case WordPiece input")
    add("--append-eod", action="store_true", help="end each document with the EOD id")
    add("--output-prefix", required=True, help="writes {prefix}_{key}_{document|sentence}")
    add("--workers", type=int, default=1, help="encoding processes (1: in this process)")
    # Megatron flags that change nothing here (the splitter needs no language data, streaming
    # needs no partitions, the format is always mmap), accepted so existing scripts run.
    for flag, kwargs in (
        ("--lang", {"default": "english"}),
        ("--partitions", {"type": int, "default": 1}),
        ("--log-interval", {"type": int, "default": 1000}),
        ("--dataset-impl", {"choices": ["mmap"], "default": "mmap"}),
    ):
        add(flag, **kwargs, help="accepted for Megatron compatibility")
    return p


def format_summary(summary: Summary) -> str:
    """The closing report: counts, rates, skipped lines, output files."""
    s = summary
    seconds = max(s.seconds, 1e-9)
    lines = [
        f"{s.documents:,} documents, {s.sequences:,} sequences, {s.tokens:,} tokens from "
        f"{s.bytes / 1e6:.1f} MB in {s.seconds:.1f} s: {s.documents / seconds:,.0f} docs/s, "
        f"{s.bytes / 1e6 / seconds:.1f} MB/s, {s.tokens / seconds:,.0f} tokens/s"
    ]
    if s.bad_lines:
        counts = ", ".join(f"{n} {reason}" for reason, n in s.bad_lines.most_common())
        lines.append(f"skipped {s.bad_lines.total():,} bad lines ({counts}); first: {s.first_bad}")
    lines += [f"wrote {prefix}.bin and {prefix}.idx" for prefix in s.outputs]
    return "\n".join(lines)


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like an exception, so the writers remove their temporary files.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; a user mistake prints one line and returns 1."""
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        if args.workers < 1:
            raise ConfigError(f"--workers {args.workers}: must be at least 1")
        summary = preprocess(args)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
