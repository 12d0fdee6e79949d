"""Benchmark tools/preprocess_data.py against a plain per-line loop; prints one JSON line.

    .venv/bin/python benchmarks/bench_preprocess.py [--size-mb 24] [--tokenizer-type gpt2|hf ...]
        [--input-format jsonl|parquet]

The baseline is what one writes first: for each line ``json.loads`` (Parquet: for each row of
each record batch), encode the document, append EOD, append the list to a Python list; at the end
convert to numpy and write the tokens. Both run in the same run on the same corpus and tokenizer
(by default the GPT-2 BPE test fixture; ``--tokenizer-type hf`` without ``--tokenizer-model``
generates a Llama-3-style tokenizer.json, ``tests/fixtures/llama3_tokenizer.py``), and the token
files must be byte-identical. ``library_batch`` is the tokenizer's own batch call on the
documents already in memory, in chunks of the tool's size, on one thread (what a worker calls per
chunk, without the reading, parsing, packing and writing around it): the speed a worker can at
most reach; for HF tokenizers ``library_batch_threads`` is the same calls on the tokenizers
library's thread pool. The baseline and those runs each run in a forked child (timed there), so
the memory they leave behind does not slow the forks of the later runs. The corpus is the
standard-library sample corpus, repeated up to ``--size-mb``; ``--input-format parquet`` writes it
as Parquet (row groups of 4096 rows) first. Each figure is the best of ``--rounds`` interleaved
runs; the machine's load (``os.getloadavg``) before and after goes in the JSON, and so do the CPU
seconds of each run (children included), which other load disturbs less than wall time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.data.indexed_dataset import best_dtype  # noqa: E402
from megatron.data.tokenizers.factory import build_tokenizer, family  # noqa: E402
from megatron.data.tokenizers.hf import HFBacked  # noqa: E402
from tests.fixtures.llama3_tokenizer import write_llama3_style_tokenizer  # noqa: E402
from tools.make_sample_corpus import write_corpus  # noqa: E402
from tools.preprocess_data import CHUNK_BYTES, build_parser, preprocess  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "tokenizers")
GPT2_FILES = {
    "--vocab-file": os.path.join(FIXTURES, "gpt2-vocab.json"),
    "--merge-file": os.path.join(FIXTURES, "gpt2-merges.txt"),
}
ROW_GROUP_ROWS = 4096


def documents(path: str):
    """The plain loop's reading: each line's JSON, or each row of each Parquet record batch."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(columns=["text"]):
            yield from batch.column(0).to_pylist()
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def baseline(path: str, tokenizer, out: str) -> None:
    """The plain loop."""
    docs = []
    for text in documents(path):
        ids = tokenizer.encode(text)
        ids.append(tokenizer.eod)
        docs.append(ids)
    dtype = best_dtype(tokenizer.vocab_size)
    np.concatenate([np.asarray(d, dtype=dtype) for d in docs]).tofile(out + ".bin")
    np.array([len(d) for d in docs], dtype=np.int32).tofile(out + ".lengths")


def chunked(texts: list[str]) -> list[list[str]]:
    """``texts`` in consecutive groups of about CHUNK_BYTES characters, as the tool chunks them."""
    groups, group, size = [], [], 0
    for text in texts:
        group.append(text)
        size += len(text)
        if size >= CHUNK_BYTES:
            groups.append(group)
            group, size = [], 0
    return [*groups, group] if group else groups


def library_batch(tokenizer, groups: list[list[str]], parallelism: str) -> None:
    """The tokenizer's batch call (``encode_packed``, as a worker makes it) on each group, with
    TOKENIZERS_PARALLELISM=``parallelism`` (HF's thread pool on or off)."""
    os.environ["TOKENIZERS_PARALLELISM"] = parallelism
    for group in groups:
        tokenizer.encode_packed(group)


def timed_in_child(fn, *args) -> tuple[float, float, None]:
    """``timed(fn, *args)`` in a forked child, so fn's garbage never enlarges this process.

    The baseline leaves ~150 MB of freed Python ints in its process; forking the workers of a
    later preprocessing run from there costs it ~15% (a real run starts in a fresh process).
    """
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=lambda: send.send(timed(fn, *args)[:2]))
    child.start()
    wall, cpu = receive.recv()
    child.join()
    return wall, cpu, None


def timed(fn, *args) -> tuple[float, float, object]:
    """Wall seconds, CPU seconds (this process and its finished children) and the result."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = usage.ru_utime + usage.ru_stime
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn(*args)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, cpu + usage.ru_utime + usage.ru_stime - children, result


def rates(wall: float, cpu: float, docs: int, size: int, tokens: int) -> dict:
    """docs/s, MB/s, tokens/s of one run, and the CPU seconds it used."""
    return {
        "seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "docs_per_s": round(docs / wall),
        "mb_per_s": round(size / 1e6 / wall, 2),
        "tokens_per_s": round(tokens / wall),
    }


def main() -> None:
    """Make the corpus, run the baseline, the library's batch call and 1 and 2 workers, print
    the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size-mb", type=float, default=24.0, help="corpus size (sample repeated)")
    p.add_argument("--input-format", choices=["jsonl", "parquet"], default="jsonl")
    p.add_argument("--tokenizer-type", default="gpt2")
    p.add_argument("--vocab-file", help="default: the GPT-2 fixture's, for gpt2")
    p.add_argument("--merge-file", help="default: the GPT-2 fixture's, for gpt2")
    p.add_argument("--tokenizer-model", help="default: a Llama-3-style tokenizer.json, for hf")
    p.add_argument("--hf-vocab-size", type=int, default=32000, help="merges of the generated one")
    p.add_argument("--rounds", type=int, default=3, help="best of this many runs each")
    args = p.parse_args()
    kind = family(args.tokenizer_type)
    tmp = tempfile.mkdtemp(prefix="bench_preprocess_")
    try:
        sample = os.path.join(tmp, "sample.jsonl")
        write_corpus(sample, args.size_mb)
        corpus = os.path.join(tmp, "corpus.jsonl")
        with open(sample, "rb") as src:
            data = src.read()
        with open(corpus, "wb") as dst:
            for _ in range(max(1, round(args.size_mb * 1e6 / len(data)))):
                dst.write(data)
        size = os.path.getsize(corpus)  # MB/s are of the JSONL text, whatever the input format
        texts = list(documents(corpus))
        groups = chunked(texts)
        if args.input_format == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            corpus = os.path.join(tmp, "corpus.parquet")
            pq.write_table(pa.table({"text": texts}), corpus, row_group_size=ROW_GROUP_ROWS)
        files = {"--vocab-file": args.vocab_file, "--merge-file": args.merge_file}
        files["--tokenizer-model"] = args.tokenizer_model
        if kind == "gpt2":
            files = {flag: files[flag] or default for flag, default in GPT2_FILES.items()}
        elif kind == "hf" and not args.tokenizer_model:
            files["--tokenizer-model"] = os.path.join(tmp, "llama3")
            write_llama3_style_tokenizer(files["--tokenizer-model"], args.hf_vocab_size)
        load_before = os.getloadavg()
        tokenizer = build_tokenizer(
            args.tokenizer_type,
            model=files.get("--tokenizer-model"),
            vocab_file=files.get("--vocab-file"),
            merges_file=files.get("--merge-file"),
        )
        flags = ["--input", corpus, "--append-eod", "--tokenizer-type", args.tokenizer_type]
        flags += [item for flag, value in files.items() if value for item in (flag, value)]
        libraries = {"library_batch": "false"}
        if isinstance(tokenizer, HFBacked):
            libraries["library_batch_threads"] = "true"
        # Rounds interleave the runs; the best of each resists other load on the machine.
        best = {}
        for _ in range(args.rounds):
            base = os.path.join(tmp, "base")
            runs = {"baseline": timed_in_child(baseline, corpus, tokenizer, base)}
            for name, parallelism in libraries.items():
                runs[name] = timed_in_child(library_batch, tokenizer, groups, parallelism)
            for workers in (1, 2):
                prefix = os.path.join(tmp, f"ours{workers}")
                argv = [*flags, "--output-prefix", prefix, "--workers", str(workers)]
                runs[workers] = timed(preprocess, build_parser().parse_args(argv))
                with (
                    open(prefix + "_text_document.bin", "rb") as a,
                    open(os.path.join(tmp, "base.bin"), "rb") as b,
                ):
                    if a.read() != b.read():
                        raise AssertionError(f"workers={workers}: tokens differ from the baseline")
            for name, (wall, cpu, _) in runs.items():
                old = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(old[0], wall), min(old[1], cpu))
        summary = runs[1][2]
        counts = (summary.documents, size, summary.tokens)
        result = {
            "bench": "preprocess",
            "input_format": args.input_format,
            "corpus_mb": round(size / 1e6, 1),
            "input_mb": round(os.path.getsize(corpus) / 1e6, 1),
            "tokenizer": args.tokenizer_type,
            "vocab_size": tokenizer.vocab_size,
            "cpus": os.cpu_count(),
            "rounds": args.rounds,
            "baseline": rates(*best["baseline"], *counts),
        }
        for name in libraries:
            result[name] = rates(*best[name], *counts)
        for workers in (1, 2):
            result[f"workers_{workers}"] = rates(*best[workers], *counts)
            result[f"speedup_{workers}"] = round(best["baseline"][0] / best[workers][0], 2)
        # The share of the library's batch speed reached (1.0: ours costs nothing around it).
        result["of_library_batch_1"] = round(best["library_batch"][0] / best[1][0], 2)
        if "library_batch_threads" in libraries:
            threads = best["library_batch_threads"][0]
            result["of_library_batch_threads_2"] = round(threads / best[2][0], 2)
        result["loadavg_before"] = [round(x, 2) for x in load_before]
        result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(result))
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
