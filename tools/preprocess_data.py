"""Tokenize JSONL or Parquet into Megatron's .bin/.idx: ``{prefix}_{key}_{document|sentence}``.

Takes every flag of Megatron-LM's preprocess_data.py (``megatron.data.preprocess_args``: each
honoured, or refused in one line saying why), so existing scripts run unchanged::

    python tools/preprocess_data.py --input data/corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 4

Inputs are JSONL (plain, ``.gz``, ``.zst``) or ``.parquet`` (its ``--json-keys`` columns), mixed
freely (``megatron.data.corpus_files``). Streams: records are read in chunks and encoded by a
worker pool (``megatron.data.jsonl_encoder``) with a bounded number of chunks in flight; results
are written in input order, one bulk write per chunk, so memory stays flat and ``--workers 1``
and ``--workers N`` write byte-identical files.
Outputs live under temporary names until complete; then ``{prefix}.json`` (``megatron.data.
sidecar``) records the tokenizer, level and tool beside each dataset.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing
import multiprocessing.pool
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.atomic_file import free_bytes, mib, refusal  # noqa: E402
from megatron.data.corpus_files import (  # noqa: E402
    Chunk,
    check_inputs,
    expand_inputs,
    read_chunks,
    record_name,
    where,
)
from megatron.data.indexed_dataset import IndexedDatasetWriter  # noqa: E402
from megatron.data.jsonl_encoder import ChunkResult, JsonlEncoder  # noqa: E402
from megatron.data.preprocess_args import (  # noqa: E402
    add_megatron_flags,
    check_megatron_flags,
    tokenizer_options,
)
from megatron.data.sidecar import remove_sidecar, tokenizer_record, write_sidecar  # noqa: E402
from megatron.data.tokenizers.factory import build_tokenizer  # noqa: E402
from megatron.errors import ConfigError, StorageError  # noqa: E402

# Bytes of input per chunk of work: small enough to balance the workers, large enough that
# the per-chunk costs (a task, a pickled result, a write) stay negligible.
CHUNK_BYTES = 1 << 18
# The HF tokenizers library's thread pool stays off: the unit of parallelism is the --workers
# process. A chunk's Python half (UTF-8, JSON, checks, packing) holds the GIL, so only processes
# scale it; one tokenizer thread per process keeps processes x threads = --workers, as tiktoken
# and sentencepiece run (num_threads=1); and a process that used the pool and then forks (the
# --find-optimal-num-workers trials, in-process callers) is the deadlock the library guards
# against (tokenizers >= 0.22.2 turns the pool off in such a child silently; older ones warned).
# Each chunk is still one batch call (encode_batch_fast), which saves the per-text overhead.
PARALLELISM = "TOKENIZERS_PARALLELISM"
# The values the tokenizers library reads as off.
_PARALLELISM_OFF = ("", "0", "f", "false", "n", "no", "off")


def build_encoder(args: argparse.Namespace) -> JsonlEncoder:
    """The encoder of the command line (also checks the tokenizer files)."""
    return JsonlEncoder(
        build_tokenizer(**tokenizer_options(args)),
        args.json_keys,
        args.split_sentences,
        args.append_eod,
        args.skip_bad_lines,
        args.keep_newlines,
    )


_WORKER: JsonlEncoder | None = None


@contextlib.contextmanager
def _tokenizer_threads_off() -> Iterator[None]:
    """TOKENIZERS_PARALLELISM=false for the run (see PARALLELISM), unless the user set it: with
    --workers 1 a user's ``true`` encodes on the library's threads in this one process."""
    if PARALLELISM in os.environ:
        yield
        return
    os.environ[PARALLELISM] = "false"
    try:
        yield
    finally:
        os.environ.pop(PARALLELISM, None)


def parallelism_notes(args: argparse.Namespace) -> list[str]:
    """The note that a user's TOKENIZERS_PARALLELISM=true does not reach the --workers."""
    value = os.environ.get(PARALLELISM, "")
    if args.workers == 1 or value.lower() in _PARALLELISM_OFF:
        return []
    return [
        f"note: {PARALLELISM}={value} is not used by the --workers processes: each encodes on "
        "one thread, so N workers use N cores (with --workers 1 the tokenizers library's "
        "threads encode)"
    ]


def _init_worker(args: argparse.Namespace) -> None:
    global _WORKER
    # The parent handles Ctrl-C and tears the pool down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One tokenizer thread per worker (see PARALLELISM), whatever the parent's environment.
    os.environ[PARALLELISM] = "false"
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


def _encode_in_worker(chunk: Chunk) -> ChunkResult:
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


def level(args: argparse.Namespace) -> str:
    """``sentence`` with --split-sentences, else ``document``."""
    return "sentence" if args.split_sentences else "document"


def output_prefixes(args: argparse.Namespace) -> dict[str, str]:
    """Megatron's naming: ``{prefix}_{key}_{document|sentence}`` per JSON key."""
    return {key: f"{args.output_prefix}_{key}_{level(args)}" for key in args.json_keys}


def preprocess(args: argparse.Namespace, max_lines: int | None = None) -> Summary:
    """Run the whole conversion; raises ConfigError on the first bad line unless skipping, and
    StorageError when the output's disk refuses a write (full, read-only), by when the writers
    have removed their temporary files."""
    paths = expand_inputs(args.input)
    check_inputs(paths, args.json_keys)  # Parquet columns, before any work
    encoder = build_encoder(args)  # checks the tokenizer files before any work
    summary = Summary(outputs=list(output_prefixes(args).values()))
    # The directories the run creates for the output, deepest first: removed on a refusal.
    made, parent = [], os.path.dirname(os.path.abspath(args.output_prefix))
    while not os.path.exists(parent):
        made, parent = [*made, parent], os.path.dirname(parent)
    try:
        with _tokenizer_threads_off():
            _convert(args, paths, encoder, summary, max_lines)
    except ConfigError:
        _remove_empty(made)
        raise
    except OSError as e:
        _remove_empty(made)
        refused = refusal(e)
        if refused is None or e.filename in paths:  # an unreadable input is not the output's
            raise
        reason, fix = refused
        written = mib(summary.tokens * encoder.dtype.itemsize)
        raise StorageError(
            f"--output-prefix {args.output_prefix}: cannot write there ({reason}: {written} "
            f"written, {mib(free_bytes(args.output_prefix))} free); no partial output is left; "
            f"{fix} or give another --output-prefix"
        ) from None
    return summary


def _convert(
    args: argparse.Namespace,
    paths: list[str],
    encoder: JsonlEncoder,
    summary: Summary,
    max_lines: int | None,
) -> None:
    """Encode ``paths`` into the datasets and sidecars of ``args``, counting in ``summary``."""
    prefixes = output_prefixes(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    start = time.perf_counter()
    chunks = read_chunks(paths, args.json_keys, CHUNK_BYTES, max_lines)
    with contextlib.ExitStack() as stack:
        writers = {
            k: stack.enter_context(IndexedDatasetWriter(p, encoder.dtype))
            for k, p in prefixes.items()
        }
        if args.workers > 1:
            pool = stack.enter_context(_start_pool(args))
            results = ordered_map(pool, _encode_in_worker, chunks, 2 * args.workers)
        else:
            results = map(encoder.encode_chunk, chunks)
        progress = stack.enter_context(Progress(args.log_interval))
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
            progress.update(summary, result.documents, time.perf_counter() - start)
        if summary.documents == 0:  # raised in the writers' scope: they remove their files
            raise ConfigError(_no_documents(args, paths, summary))
        # The old sidecars go before the new .bin/.idx replace their data (as the writers exit).
        for prefix in prefixes.values():
            remove_sidecar(prefix)
    record = tokenizer_record(args.tokenizer_type, encoder.tokenizer)
    for prefix in prefixes.values():
        write_sidecar(prefix, "tools/preprocess_data.py", record, level(args), args.append_eod)
    summary.seconds = time.perf_counter() - start


def _remove_empty(directories: list[str]) -> None:
    """Removes ``directories`` (deepest first) while they are empty."""
    for directory in directories:
        try:
            os.rmdir(directory)
        except OSError:
            return


def _no_documents(args: argparse.Namespace, paths: list[str], summary: Summary) -> str:
    """The one line refusing an input with no document to write."""
    inputs = " ".join(paths)
    skipped = f" ({summary.bad_lines.total():,} bad lines skipped)" if summary.bad_lines else ""
    keys = " ".join(args.json_keys)
    return (
        f"--input {inputs}: no document with text under --json-keys {keys}{skipped}; nothing "
        "written; give input that holds documents"
    )


def _record_bad(summary: Summary, path: str, bad: list[tuple[int, str]], skip: bool) -> None:
    for number, reason in bad:
        place = f"{where(path, number)}: {reason}"
        if not skip:
            raise ConfigError(f"{place}; fix the {record_name(path)} or pass --skip-bad-lines")
        summary.bad_lines[reason.split(" (")[0]] += 1
        summary.first_bad = summary.first_bad or place


class Progress(contextlib.AbstractContextManager):
    """A tqdm bar when stderr is a terminal, else Megatron's line every ``interval`` documents:
    ``Processed 2000 documents (1234.5 docs/s, 3.2 MB/s).``"""

    def __init__(self, interval: int) -> None:
        self.interval, self.next = interval, interval
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(unit="doc", unit_scale=True, file=sys.stderr)

    def update(self, summary: Summary, documents: int, elapsed: float) -> None:
        """Count ``documents`` more; ``summary`` holds the totals so far."""
        rate = summary.bytes / 1e6 / elapsed
        if self.bar is not None:
            self.bar.update(documents)
            tokens = f"{summary.tokens / elapsed:,.0f} tokens/s"
            self.bar.set_postfix_str(f"{rate:.1f} MB/s, {tokens}", refresh=False)
        elif summary.documents >= self.next:
            # Chunks hold many documents: one line per interval crossed, with the count reached.
            self.next = (summary.documents // self.interval + 1) * self.interval
            print(
                f"Processed {summary.documents} documents "
                f"({summary.documents / elapsed:.1f} docs/s, {rate:.1f} MB/s).",
                file=sys.stderr,
            )

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def find_optimal_workers(args: argparse.Namespace) -> str:
    """Megatron's --find-optimal-num-workers: time the first --max-documents documents at each
    of --workers-to-check into a scratch directory (no dataset is kept); the ranking."""
    counts = args.workers_to_check or [16, 32, 64]
    limit = args.max_documents or 100_000
    rates = {}
    with tempfile.TemporaryDirectory() as scratch:
        for workers in counts:
            trial = argparse.Namespace(**vars(args))
            trial.workers, trial.output_prefix = workers, os.path.join(scratch, f"w{workers}")
            summary = preprocess(trial, max_lines=limit)
            rates[workers] = summary.documents / max(summary.seconds, 1e-9)
    ranked = sorted(rates.items(), key=lambda kv: kv[1], reverse=True)
    lines = ["Performance results (fastest → slowest):"]
    lines += [f"{i}. {w} workers → avg. docs/s: {r:.4f}" for i, (w, r) in enumerate(ranked, 1)]
    best, rate = ranked[0]
    lines.append(
        f"The most optimal num of workers is {best} with avg. preprocessed docs/s: {rate:.4f}."
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Megatron's preprocess_data.py flags (``preprocess_args``), plus --skip-bad-lines and
    --lower-case."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_megatron_flags(p)
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
    lines += [f"wrote {prefix}.bin, {prefix}.idx and {prefix}.json" for prefix in s.outputs]
    return "\n".join(lines)


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like an exception, so the writers remove their temporary files.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; a user mistake prints one line and returns 2 (4: the output's
    disk refused a write)."""
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        for note in [*check_megatron_flags(args), *parallelism_notes(args)]:
            print(note, file=sys.stderr)
        if args.find_optimal_num_workers:
            print(find_optimal_workers(args))
            return 0
        summary = preprocess(args)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return e.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
