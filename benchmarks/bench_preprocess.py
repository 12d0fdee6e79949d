"""Benchmark tools/preprocess_data.py against a plain per-line loop; prints one JSON line.

    .venv/bin/python benchmarks/bench_preprocess.py [--size-mb 24] [--tokenizer-type gpt2 ...]

The baseline is what one writes first: for each line ``json.loads``, encode the document, append
EOD, append the list to a Python list; at the end convert to numpy and write the tokens. Both run
in the same run on the same corpus and tokenizer (by default the GPT-2 BPE test fixture), and the
token files must be byte-identical. The baseline runs in a forked child (timed there), so the
memory it leaves behind does not slow the forks of the later runs. The corpus is the
standard-library sample corpus, repeated up to ``--size-mb``. Each figure is the best of
``--rounds`` interleaved runs; the machine's load (``os.getloadavg``) before and after goes in the
JSON, and so do the CPU seconds of each run (children included), which other load disturbs less
than wall time.
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
from megatron.data.tokenizers.factory import build_tokenizer  # noqa: E402
from tools.make_sample_corpus import write_corpus  # noqa: E402
from tools.preprocess_data import build_parser, preprocess  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "tokenizers")


def baseline(path: str, tokenizer, out: str) -> None:
    """The plain loop."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            ids = tokenizer.encode(json.loads(line)["text"])
            ids.append(tokenizer.eod)
            docs.append(ids)
    dtype = best_dtype(tokenizer.vocab_size)
    np.concatenate([np.asarray(d, dtype=dtype) for d in docs]).tofile(out + ".bin")
    np.array([len(d) for d in docs], dtype=np.int32).tofile(out + ".lengths")


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
    """Make the corpus, run the baseline and 1 and 2 workers, print the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size-mb", type=float, default=24.0, help="corpus size (sample repeated)")
    p.add_argument("--tokenizer-type", default="gpt2")
    p.add_argument("--vocab-file", default=os.path.join(FIXTURES, "gpt2-vocab.json"))
    p.add_argument("--merge-file", default=os.path.join(FIXTURES, "gpt2-merges.txt"))
    p.add_argument("--tokenizer-model")
    p.add_argument("--rounds", type=int, default=3, help="best of this many runs each")
    args = p.parse_args()
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
        size = os.path.getsize(corpus)
        load_before = os.getloadavg()
        tokenizer = build_tokenizer(
            args.tokenizer_type,
            model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merges_file=args.merge_file,
        )
        flags = ["--input", corpus, "--append-eod", "--tokenizer-type", args.tokenizer_type]
        for flag, value in (
            ("--vocab-file", args.vocab_file),
            ("--merge-file", args.merge_file),
            ("--tokenizer-model", args.tokenizer_model),
        ):
            if value:
                flags += [flag, value]
        # Rounds interleave the three runs; the best of each resists other load on the machine.
        best = {}
        for _ in range(args.rounds):
            base = os.path.join(tmp, "base")
            runs = {"baseline": timed_in_child(baseline, corpus, tokenizer, base)}
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
            "corpus_mb": round(size / 1e6, 1),
            "tokenizer": args.tokenizer_type,
            "cpus": os.cpu_count(),
            "rounds": args.rounds,
            "baseline": rates(*best["baseline"], *counts),
        }
        for workers in (1, 2):
            result[f"workers_{workers}"] = rates(*best[workers], *counts)
            result[f"speedup_{workers}"] = round(best["baseline"][0] / best[workers][0], 2)
        result["loadavg_before"] = [round(x, 2) for x in load_before]
        result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(result))
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
