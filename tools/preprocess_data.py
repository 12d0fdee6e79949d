"""Tokenize JSONL into Megatron's .bin/.idx files: ``{prefix}_{key}_{document|sentence}``.

Takes Megatron's flags, so existing scripts run unchanged::

    python tools/preprocess_data.py --input data/corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 4

Streams: lines are read in chunks and encoded by a worker pool with a bounded number of chunks in
flight, results are written in input order, so memory stays flat and ``--workers 1`` and
``--workers N`` write byte-identical files. Outputs live under temporary names until complete.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import multiprocessing
import multiprocessing.pool
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.indexed_dataset import IndexedDatasetWriter, best_dtype  # noqa: E402
from megatron.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402

CHUNK_LINES = 1024
CHUNK_BYTES = 4 << 20
# A sentence ends at . ! ? or an ellipsis (plus closing quotes/brackets) followed by whitespace and
# a word that does not start lower-case; at CJK full stops; or at a blank line.
_BOUNDARY = re.compile(
    r"(?P<stop>[.!?…]+)[\"'”’»)\]]*\s+(?=[\"'“‘«(\[]?(?P<next>\w))"
    r"|[。！？]+[」』”’）]*\s*"
    r"|\n[ \t]*\n\s*"
)
# Words whose trailing period is not a sentence end (compared lower-case, without the period).
_ABBREVIATIONS = frozenset(
    """
    mr mrs ms dr prof sr jr st mt vs fig figs eq eqs no nos vol vols pp ch sec approx dept est inc
    ltd co corp gen gov sen rep rev cf al jan feb mar apr jun jul aug sep sept oct nov dec
    """.split()
)
_WORD_BEFORE = re.compile(r"[\w.]+$")
_PARAGRAPH = re.compile(r"\n[ \t]*\n")


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences with a regex; no model or download needed.

    A period after an abbreviation (Dr., e.g., U.S.), an initial (J.) or a one- or two-digit list
    number (1.) does not end a sentence. Sentences come back stripped; empty ones are dropped.
    """
    sentences, start = [], 0
    for m in _BOUNDARY.finditer(text):
        # A paragraph break ends a sentence whatever precedes or follows it.
        if m.group("stop") is not None and not _PARAGRAPH.search(m.group()):
            if m.group("next").islower():
                continue
            if m.group("stop") == ".":
                # A bounded look back keeps long documents linear.
                before = _WORD_BEFORE.search(text, max(0, m.start() - 32), m.start())
                word = before.group().lower() if before else ""
                if (
                    word in _ABBREVIATIONS
                    or "." in word
                    or (len(word) == 1 and word.isalpha())
                    or (len(word) <= 2 and word.isdigit())
                ):
                    continue
        sentence = text[start : m.end()].strip()
        if sentence:
            sentences.append(sentence)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


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
    """``(path, first line number, raw lines)`` chunks of up to CHUNK_LINES lines / CHUNK_BYTES."""
    for path in paths:
        with open_binary(path) as f:
            lines: list[bytes] = []
            size, first = 0, 1
            for lineno, line in enumerate(f, 1):
                lines.append(line)
                size += len(line)
                if len(lines) >= CHUNK_LINES or size >= CHUNK_BYTES:
                    yield path, first, lines
                    lines, size, first = [], 0, lineno + 1
            if lines:
                yield path, first, lines


class BadLine(Exception):
    """One input line that cannot become a document; the message is the reason."""


@dataclass
class ChunkResult:
    """Encoded documents of one chunk, per JSON key, plus what was wrong with the bad lines."""

    path: str
    tokens: dict[str, np.ndarray]  # all sequences back to back
    sequence_lengths: dict[str, np.ndarray]
    document_sizes: dict[str, np.ndarray]  # sequences per document
    bad: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)
    documents: int = 0
    bytes: int = 0


class Encoder:
    """Turns raw JSONL lines into token sequences; built once per worker process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.tokenizer = build_tokenizer(
            args.tokenizer_type,
            args.tokenizer_model,
            args.vocab_file,
            args.merge_file,
            args.lower_case,
        )
        self.dtype = best_dtype(self.tokenizer.vocab_size)
        self.keys, self.split = args.json_keys, args.split_sentences
        self.append_eod, self.skip_bad_lines = args.append_eod, args.skip_bad_lines
        self._encode = self.tokenizer.encode_np

    def encode_line(self, raw: bytes) -> list[list[np.ndarray]]:
        """The sequences of each key's document (EOD not yet appended), or BadLine."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadLine(f"invalid UTF-8 (byte {e.start})") from None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            if not text.strip():
                raise BadLine("blank line (expected a JSON object)") from None
            raise BadLine(f"malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise BadLine(f"not a JSON object (a {type(record).__name__})")
        # A \ud800-style escape without its pair decodes to a lone surrogate no tokenizer takes.
        surrogates = b"\\ud" in raw or b"\\uD" in raw
        documents = []
        for key in self.keys:
            if key not in record:
                raise BadLine(f"missing key {key!r}")
            value = record[key]
            if isinstance(value, str):
                if not value or value.isspace():  # isspace stops at the first other character
                    raise BadLine(f"empty document in key {key!r}")
                pieces = split_sentences(value) if self.split else [value]
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                pieces = value  # already split into sentences, as Megatron accepts
            else:
                raise BadLine(f"not a string in key {key!r} (a {type(value).__name__})")
            if surrogates:
                for piece in pieces:
                    try:
                        piece.encode("utf-8")
                    except UnicodeEncodeError:
                        raise BadLine(f"unpaired surrogate escape in key {key!r}") from None
            sequences = [ids for ids in map(self._encode, pieces) if ids.size]
            if not sequences:
                raise BadLine(f"empty document in key {key!r} (no tokens)")
            documents.append(sequences)
        return documents

    def encode_chunk(self, chunk: tuple[str, int, list[bytes]]) -> ChunkResult:
        """Encode every line of a chunk; without --skip-bad-lines stop at the first bad one."""
        path, first, lines = chunk
        sequences: list[list[np.ndarray]] = [[] for _ in self.keys]  # per key, in order
        sizes: list[list[int]] = [[] for _ in self.keys]  # per key: sequences per document
        bad = []
        for offset, raw in enumerate(lines):
            try:
                documents = self.encode_line(raw)
            except BadLine as e:
                bad.append((first + offset, str(e)))
                if self.skip_bad_lines:
                    continue
                break
            for k, document in enumerate(documents):
                sequences[k] += document
                sizes[k].append(len(document))
        result = ChunkResult(path, {}, {}, {}, bad, len(sizes[0]), sum(map(len, lines)))
        for key, key_sequences, key_sizes in zip(self.keys, sequences, sizes):
            self._pack(result, key, key_sequences, np.asarray(key_sizes, dtype=np.int64))
        return result

    def _pack(self, result: ChunkResult, key: str, sequences: list, sizes: np.ndarray) -> None:
        """Concatenate one key's sequences; EOD goes after each document's last sequence."""
        lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        tokens = np.concatenate(sequences) if sequences else np.empty(0)
        tokens = tokens.astype(self.dtype, copy=False)
        if self.append_eod:
            last = np.cumsum(sizes) - 1
            tokens = np.insert(tokens, np.cumsum(lengths)[last], self.tokenizer.eod)
            lengths[last] += 1
        result.tokens[key] = tokens
        result.sequence_lengths[key] = lengths
        result.document_sizes[key] = sizes


_WORKER: Encoder | None = None


def _init_worker(args: argparse.Namespace) -> None:
    global _WORKER
    # The parent handles Ctrl-C and tears the pool down; HF tokenizers must not fork threads.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = Encoder(args)


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
    encoder = Encoder(args)  # also checks the tokenizer files before any work
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
            pool = stack.enter_context(
                multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args,))
            )
            results = ordered_map(pool, _encode_in_worker, read_chunks(paths), 2 * args.workers)
        else:
            results = map(encoder.encode_chunk, read_chunks(paths))
        progress = stack.enter_context(_progress())
        for result in results:
            _record_bad(summary, result.path, result.bad, args.skip_bad_lines)
            for key, writer in writers.items():
                _write(writer, result, key)
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


def _write(writer: IndexedDatasetWriter, result: ChunkResult, key: str) -> None:
    tokens = result.tokens[key]
    bounds = np.concatenate(([0], np.cumsum(result.sequence_lengths[key]))).tolist()
    seq = 0
    for size in result.document_sizes[key].tolist():
        for start, end in zip(bounds[seq : seq + size], bounds[seq + 1 : seq + size + 1]):
            writer.add_sequence(tokens[start:end])
        seq += size
        writer.end_document()


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
