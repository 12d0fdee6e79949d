"""Data whose ids reach past the tokenizer's vocabulary stops the run before step 1, in one line.

The scan itself: chunked reductions give the extremes of a plain numpy pass, and the offending
id's first offset is found; its result is cached by the file's size and mtime (a rewrite that
keeps both is not seen, one that changes the mtime is). Training's check runs on every rank,
and every rank raises (two real gloo processes). End to end, the real entrypoints stop with
exit code 2 and one error line for GPT-2 BPE data under a WordPiece tokenizer
(pretrain_bert.py) and for data with Megatron's appended sentencepiece extra ids under the
plain model (pretrain_gpt.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.config.schema import DataConfig
from megatron.data.hdf5_dataset import write_shard
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, data_path
from megatron.data.sidecar import describe, read_sidecar
from megatron.data.token_range import _first, _scan, check_data_ids, indexed_ids, spans
from megatron.data.tokenizers.factory import build_tokenizer
from megatron.errors import ConfigError
from tests.distributed import run_distributed
from tests.fixtures import BERT_VOCAB, GPT2_MERGES, GPT2_VOCAB, SP_BPE
from tests.gpt_run import ROOT, tiny_overrides

TEXTS = [
    "The quick brown fox <extra_id_0> jumps over the lazy dog.",
    "Plain prose, numbers 12345 and café, <extra_id_2> then more words.",
    "A third document without any sentinel at all, somewhat longer than the others are.",
] * 4


def _write(prefix: str, docs: list[list[int]], dtype: type = np.uint16) -> None:
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document([np.array(doc)])


def test_chunked_scan_equals_one_numpy_pass():
    rng = np.random.default_rng(0)
    ids = rng.integers(-50, 5000, 1000).astype(np.int32)
    for step in (1, 7, 64, 1000):
        found = _scan(lambda lo, hi: ids[lo:hi], [(0, len(ids))], step)
        assert (found.lowest, found.highest, found.sampled) == (ids.min(), ids.max(), False)
    rows = ids.reshape(100, 10)  # hdf5 rows
    found = _scan(lambda lo, hi: rows[lo:hi], spans(100, 10), 3)
    assert found.sampled and ids.min() <= found.lowest <= found.highest <= ids.max()
    assert _first(ids, ids.max()) == np.argmax(ids) and _first(ids, 6000) is None


def test_the_cache_is_keyed_by_size_and_mtime(tmp_path):
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    _write(prefix, [[1, 2, 3], [9, 4]])
    assert indexed_ids(prefix, cache).highest == 9
    st = os.stat(data_path(prefix))
    with open(data_path(prefix), "r+b") as f:  # same size, a larger id, the old mtime kept
        f.write(np.array([700], np.uint16).tobytes())
    os.utime(data_path(prefix), ns=(st.st_atime_ns, st.st_mtime_ns))
    assert indexed_ids(prefix, cache).highest == 9  # the cached entry answers
    assert indexed_ids(prefix, None).highest == 700  # no cache: scanned
    os.utime(data_path(prefix), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert (indexed_ids(prefix, cache).highest, indexed_ids(prefix, cache).lowest) == (700, 2)
    assert len(os.listdir(cache)) == 4  # two entries, each an array and its description


def _check_on_rank(prefix: str, cache: str, vocab_size: int) -> str:
    torch.distributed.init_process_group("gloo")
    try:
        check_data_ids(DataConfig(paths=[prefix], cache_dir=cache), vocab_size)
    except ConfigError as err:
        return str(err)
    return "passed"


@pytest.mark.slow
def test_every_rank_raises_the_same_error(tmp_path):
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    _write(prefix, [[1, 2], [3, 1000, 4]])
    errors = run_distributed(_check_on_rank, 2, prefix, cache, 1000)
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"{data_path(prefix)} (sequence 1, token 3): token id 1000 (")
    assert len(os.listdir(cache)) == 2  # one entry, written by the node's builder (LOCAL_RANK 0)


def test_hdf5_shards_are_checked(tmp_path):
    s = 8
    sample = {
        "text": np.arange(s), "types": np.zeros(s, np.int64), "padding_mask": np.ones(s),
        "loss_mask": np.eye(s)[2], "labels": np.full(s, 7), "is_random": 0,
    }  # fmt: skip
    write_shard(str(tmp_path / "a.hdf5"), [sample] * 3, max_predictions=2)
    data = DataConfig(paths=[str(tmp_path)], format="hdf5", cache_dir=str(tmp_path / "cache"))
    check_data_ids(data, 8)
    sample["text"] = np.full(s, 8)
    write_shard(str(tmp_path / "b.hdf5"), [sample], max_predictions=2)
    with pytest.raises(ConfigError, match=r"b.hdf5 \(input_ids\): token id 8 \(the data's"):
        check_data_ids(data, 8)


def _preprocess(tmp_path: Path, name: str, *flags: str) -> str:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prefix = tmp_path / name
    cmd = ["tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix)]
    subprocess.run([sys.executable, *cmd, *flags, "--append-eod"], cwd=ROOT, check=True)
    return f"{prefix}_text_document"


def _expected(prefix: str, vocab_size: int) -> str:
    """The error line, from the data read independently of the check."""
    ds = IndexedDataset(prefix)
    tokens = np.fromfile(data_path(prefix), ds.dtype)
    pos = int(np.argmax(tokens))
    seq = int(np.searchsorted(np.cumsum(ds.sequence_lengths), pos, "right"))
    return (
        f"error: {data_path(prefix)} (sequence {seq}, token {pos}): token id {tokens[pos]} "
        f"(the data's largest) is outside the tokenizer's vocabulary [0, {vocab_size}); the data "
        f"was made with {describe(read_sidecar(prefix)['tokenizer'])}: re-run "
        "tools/preprocess_data.py with this tokenizer, or train with the tokenizer the data was "
        "made with"
    )


def _run(script: str, config: str, overrides: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, script, "--config", config, *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _assert_stopped(proc: subprocess.CompletedProcess, expected: str, run_dir: Path) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == expected
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # stopped before step 1


@pytest.mark.slow
def test_gpt2_data_under_a_wordpiece_tokenizer_stops_pretrain_bert(tmp_path):
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", GPT2_VOCAB]
    prefix = _preprocess(tmp_path, "gpt2", *flags, "--merge-file", GPT2_MERGES)
    # A WordPiece vocabulary smaller than the BPE's (as 30k is smaller than GPT-2's 50k).
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(Path(BERT_VOCAB).read_text().splitlines(True)[:900]))
    keys = {
        "tokenizer.type": "BertWordPieceLowerCase",
        "tokenizer.vocab_file": vocab,
        "tokenizer.model": None,
        "parallel.tensor_parallel_size": 1,
    }
    overrides = tiny_overrides({"tokenizer": None, "data": prefix}, tmp_path, **keys)
    proc = _run("pretrain_bert.py", "configs/bert_tiny.yaml", overrides)
    size = build_tokenizer(type="BertWordPieceLowerCase", vocab_file=str(vocab)).vocab_size
    _assert_stopped(proc, _expected(prefix, size), tmp_path)


@pytest.mark.slow
def test_sentencepiece_extra_ids_stop_pretrain_gpt(tmp_path):
    flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", SP_BPE]
    prefix = _preprocess(tmp_path, "sp", *flags, "--vocab-extra-ids", "3")
    keys = {"tokenizer.type": "SentencePieceTokenizer", "parallel.tensor_parallel_size": 1}
    overrides = tiny_overrides({"tokenizer": SP_BPE, "data": prefix}, tmp_path, **keys)
    proc = _run("pretrain_gpt.py", "configs/gpt_tiny.yaml", overrides)
    size = build_tokenizer(type="SentencePieceTokenizer", model=SP_BPE).vocab_size
    _assert_stopped(proc, _expected(prefix, size), tmp_path)
