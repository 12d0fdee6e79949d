"""MMIDIDX writer/reader: round trips, an independent parser, corruption errors, megatron-core."""

from __future__ import annotations

import importlib.metadata
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from megatron.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    data_path,
    index_path,
)
from megatron.errors import ConfigError


def _documents(rng: np.random.Generator, vocab: int, n_docs: int) -> list[list[np.ndarray]]:
    """Documents of 1-3 sequences each; some sequences empty, like blank sentences can be."""
    return [
        [rng.integers(0, vocab, rng.integers(0, 20)) for _ in range(rng.integers(1, 4))]
        for _ in range(n_docs)
    ]


def _write(prefix: str, docs: list[list[np.ndarray]], dtype: np.dtype) -> None:
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document(doc)


def _parse(prefix: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray, bytes]:
    """Read the files straight from the layout in issue 3, sharing no code with the reader."""
    codes = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack("<Q", raw[9:17])
    assert version == 1
    code = raw[17]
    s, d = struct.unpack("<QQ", raw[18:34])
    lengths = np.frombuffer(raw[34 : 34 + 4 * s], "<i4")
    pointers = np.frombuffer(raw[34 + 4 * s : 34 + 12 * s], "<i8")
    docs = np.frombuffer(raw[34 + 12 * s : 34 + 12 * s + 8 * d], "<i8")
    assert len(raw) == 34 + 12 * s + 8 * d
    return np.dtype(codes[code]), lengths, pointers, docs, open(prefix + ".bin", "rb").read()


@pytest.mark.parametrize("vocab", [1000, 70000])
def test_round_trip_and_independent_parser(tmp_path, vocab):
    dtype = best_dtype(vocab)
    assert dtype == (np.uint16 if vocab < 65500 else np.int32)
    docs = _documents(np.random.default_rng(vocab), vocab, 30)
    prefix = str(tmp_path / "ds")
    _write(prefix, docs, dtype)
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]

    ds = IndexedDataset(prefix)
    flat = [seq for doc in docs for seq in doc]
    assert ds.dtype == dtype and len(ds) == len(flat)
    assert ds.num_documents == len(docs)
    assert ds.num_tokens == sum(len(s) for s in flat)
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(ds[i], seq)
        if len(seq) >= 3:
            np.testing.assert_array_equal(ds.get(i, 1, 2), seq[1:3])
            np.testing.assert_array_equal(ds.get(i, 2), seq[2:])

    p_dtype, lengths, pointers, doc_idx, raw_bin = _parse(prefix)
    assert p_dtype == dtype
    np.testing.assert_array_equal(lengths, [len(s) for s in flat])
    np.testing.assert_array_equal(doc_idx, np.cumsum([0] + [len(d) for d in docs]))
    tokens = np.frombuffer(raw_bin, p_dtype)
    for ptr, n, seq in zip(pointers, lengths, flat, strict=True):
        start = ptr // p_dtype.itemsize
        np.testing.assert_array_equal(tokens[start : start + n], seq)


def test_sequences_then_end_document(tmp_path):
    prefix = str(tmp_path / "ds")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_sequence([1, 2])
        w.add_sequence(np.array([3], dtype=np.int64))
        w.end_document()
        w.add_sequence([4])
        w.end_document()
    ds = IndexedDataset(prefix)
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds.sequence_pointers.tolist() == [0, 4, 6]


def test_add_documents_equals_one_by_one(tmp_path):
    """The bulk write gives the same bytes as add_document per document, in any batching."""
    docs = _documents(np.random.default_rng(7), 1000, 40)
    with IndexedDatasetWriter(str(tmp_path / "bulk"), np.uint16) as w:
        for batch in (docs[:1], docs[1:25], [], docs[25:]):
            seqs = [seq for doc in batch for seq in doc]
            w.add_documents(
                np.concatenate([np.zeros(0, dtype=np.int64), *seqs]),
                [len(seq) for seq in seqs],
                [len(doc) for doc in batch],
            )
        w.add_document([[5, 6]])  # one by one after bulk still lines up
    _write(str(tmp_path / "one"), [*docs, [np.array([5, 6])]], np.uint16)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"bulk{ext}").read_bytes() == (tmp_path / f"one{ext}").read_bytes()


def test_add_documents_rejects_inconsistent_sizes(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "ds"), np.uint16) as w:
        with pytest.raises(ValueError, match="do not match"):
            w.add_documents(np.arange(5), [2, 2], [2])
        with pytest.raises(ValueError, match="do not match"):
            w.add_documents(np.arange(4), [2, 2], [1])
        with pytest.raises(ConfigError, match="does not fit uint16"):
            w.add_documents(np.array([70000]), [1], [1])
        w.add_sequence([1])
        with pytest.raises(ValueError, match="open document"):
            w.add_documents(np.arange(2), [2], [1])
        w.end_document()


def test_merge_equals_writing_everything(tmp_path):
    rng = np.random.default_rng(0)
    parts = [_documents(rng, 500, n) for n in (5, 0, 7)]
    for i, docs in enumerate(parts):
        _write(str(tmp_path / f"p{i}"), docs, np.uint16)
    _write(str(tmp_path / "all"), [d for docs in parts for d in docs], np.uint16)
    with IndexedDatasetWriter(str(tmp_path / "merged"), np.uint16) as w:
        w.add_document([[7, 7]])
        for i in range(3):
            w.add_dataset(str(tmp_path / f"p{i}"))
    _write(str(tmp_path / "expect"), [[[7, 7]]] + [d for docs in parts for d in docs], np.uint16)
    for ext in (".bin", ".idx"):
        merged = open(str(tmp_path / "merged") + ext, "rb").read()
        assert merged == open(str(tmp_path / "expect") + ext, "rb").read()


def test_merge_rejects_other_dtype(tmp_path):
    _write(str(tmp_path / "a"), [[[1, 2]]], np.int32)
    with pytest.raises(ConfigError, match="a.idx"):
        with IndexedDatasetWriter(str(tmp_path / "b"), np.uint16) as w:
            w.add_dataset(str(tmp_path / "a"))
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx"]


def test_error_leaves_no_files(tmp_path):
    prefix = str(tmp_path / "ds")
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([[1, 2, 3]])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_failed_finalize_leaves_no_files(tmp_path):
    with pytest.raises(ValueError, match="close the document first"):
        with IndexedDatasetWriter(str(tmp_path / "ds"), np.uint16) as w:
            w.add_sequence([1, 2])  # never closed by end_document()
    assert os.listdir(tmp_path) == []


def test_token_out_of_range_for_dtype(tmp_path):
    with pytest.raises(ConfigError, match="70000 does not fit uint16"):
        with IndexedDatasetWriter(str(tmp_path / "ds"), np.uint16) as w:
            w.add_document([[1, 70000]])
    assert os.listdir(tmp_path) == []


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "ds")
    _write(prefix, [], np.uint16)
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0


def _corrupt(prefix: str, path: str, edit) -> None:
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(edit(data)))


@pytest.mark.parametrize(
    "which, edit, message",
    [
        ("idx", lambda b: b[:20], r"ds.idx: truncated"),
        ("idx", lambda b: b[:-3], r"ds.idx: \d+ bytes but its header"),
        ("idx", lambda b: b"XXXXXXXX" + b[8:], r"ds.idx: not a Megatron MMIDIDX"),
        ("idx", lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], r"ds.idx: index version 2"),
        ("idx", lambda b: b[:17] + bytes([9]) + b[18:], r"ds.idx: unknown dtype code 9"),
        ("idx", lambda b: b[:-8] + struct.pack("<q", 99), r"ds.idx: document indices"),
        ("bin", lambda b: b[:-2], r"ds.bin: \d+ bytes but .*ds.idx describes"),
        ("bin", lambda b: b + b"\0\0", r"ds.bin: \d+ bytes but"),
    ],
)
def test_corrupted_files_name_the_problem(tmp_path, which, edit, message):
    prefix = str(tmp_path / "ds")
    _write(prefix, [[[1, 2, 3]], [[4, 5]]], np.uint16)
    path = index_path(prefix) if which == "idx" else data_path(prefix)
    _corrupt(prefix, path, edit)
    with pytest.raises(ConfigError, match=message):
        IndexedDataset(prefix)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.idx: file not found"):
        IndexedDataset(str(tmp_path / "nope"))


def test_pickles_by_prefix(tmp_path):
    import pickle

    prefix = str(tmp_path / "ds")
    _write(prefix, [[[1, 2, 3]]], np.uint16)
    clone = pickle.loads(pickle.dumps(IndexedDataset(prefix)))
    assert clone[0].tolist() == [1, 2, 3]


# Runs in a clean interpreter outside the repo: our package is also named `megatron`.
_MCORE_READ = """
import json, sys
from megatron.core.datasets.indexed_dataset import IndexedDataset
for prefix in sys.argv[1:]:
    ds = IndexedDataset(prefix)
    print(json.dumps({
        "dtype": ds.index.dtype.__name__,
        "docs": ds.document_indices.tolist(),
        "seqs": [ds[i].tolist() for i in range(len(ds))],
    }))
"""


def run_megatron_core(script: str, *args: str) -> str:
    """Run ``script`` with megatron-core in a subprocess whose imports cannot see this repo."""
    try:
        importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-core (the test oracle) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(
            [sys.executable, "-c", script, *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_megatron_core_reads_our_files(tmp_path):
    vocabs = (1000, 70000)
    all_docs = [_documents(np.random.default_rng(v), v, 12) for v in vocabs]
    prefixes = [str(tmp_path / f"ds{v}") for v in vocabs]
    for prefix, docs, vocab in zip(prefixes, all_docs, vocabs, strict=True):
        _write(prefix, docs, best_dtype(vocab))
    lines = run_megatron_core(_MCORE_READ, *prefixes).strip().splitlines()[-2:]
    for line, docs, vocab in zip(lines, all_docs, vocabs, strict=True):
        got = json.loads(line)
        assert got["dtype"] == best_dtype(vocab).name
        assert got["docs"] == np.cumsum([0] + [len(d) for d in docs]).tolist()
        assert got["seqs"] == [seq.tolist() for doc in docs for seq in doc]
