"""tools/preprocess_data.py on the formats open corpora ship as (Parquet, zstd and gzip JSONL, mixed
in one run), and the HF tokenizer's batch path: the same bytes as plain JSONL, one line per bad
input."""

from __future__ import annotations

import gzip
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megatron.data.corpus_files import Chunk
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.jsonl_encoder import JsonlEncoder
from megatron.data.tokenizers.factory import build_tokenizer
from tests.fixtures.llama3_tokenizer import write_llama3_style_tokenizer
from tests.test_preprocess_data import (
    DOCS,
    FIXTURES,
    _files,
    _no_outputs,
    _run,
    small_chunks,
)
from tools import preprocess_data
from tools.preprocess_data import main

__all__ = ["small_chunks"]  # a fixture: pytest finds it by name here

RECORDS = [{"text": d, "title": d[:30], "id": i} for i, d in enumerate(DOCS)]
KEYS = ["--json-keys", "text", "title"]


def _jsonl_bytes(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _parquet(path, records, row_group_size=40) -> str:
    """``records`` as Parquet (several row groups), their non-key ``id`` column included."""
    columns = {k: [r[k] for r in records] for k in records[0]}
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return str(path)


def _zstd(path, records) -> str:
    """``records`` as zstd JSONL in two frames (as concatenated dumps are), with checksums."""
    half = len(records) // 2
    compress = zstandard.ZstdCompressor(write_checksum=True).compress
    path.write_bytes(
        compress(_jsonl_bytes(records[:half])) + compress(_jsonl_bytes(records[half:]))
    )
    return str(path)


def _gzip(path, records) -> str:
    path.write_bytes(gzip.compress(_jsonl_bytes(records)))
    return str(path)


def _inputs(tmp_path, kind: str) -> list[str]:
    """RECORDS in the format ``kind``; ``mixed``: a quarter each as Parquet, zstd, plain and
    gzip JSONL."""
    if kind == "parquet":
        return [_parquet(tmp_path / "all.parquet", RECORDS)]
    if kind == "zst":
        return [_zstd(tmp_path / "all.jsonl.zst", RECORDS)]
    if kind == "gz":
        return [_gzip(tmp_path / "all.jsonl.gz", RECORDS)]
    (tmp_path / "c.jsonl").write_bytes(_jsonl_bytes(RECORDS[150:225]))
    return [
        _parquet(tmp_path / "a.parquet", RECORDS[:75]),
        _zstd(tmp_path / "b.jsonl.zstd", RECORDS[75:150]),
        str(tmp_path / "c.jsonl"),
        _gzip(tmp_path / "d.jsonl.gz", RECORDS[225:]),
    ]


@pytest.fixture
def plain(tmp_path):
    """The files of RECORDS given as plain JSONL (two keys, EOD appended)."""
    path = tmp_path / "input.jsonl"
    path.write_bytes(_jsonl_bytes(RECORDS))
    assert _run(str(path), tmp_path / "plain", *KEYS, "--append-eod") == 0
    return _files(tmp_path / "plain")


@pytest.mark.parametrize("kind", ["parquet", "zst", "gz", "mixed"])
def test_formats_write_the_bytes_of_plain_jsonl(tmp_path, small_chunks, plain, kind):
    inputs = _inputs(tmp_path, kind)
    assert _run(inputs, tmp_path / "out", *KEYS, "--append-eod") == 0
    assert _files(tmp_path / "out") == plain
    assert len(plain) == 6  # text and title: .bin, .idx, .json each


def test_mixed_inputs_workers_1_and_2_identical(tmp_path, small_chunks):
    inputs = _inputs(tmp_path, "mixed")
    assert _run(inputs, tmp_path / "w1", *KEYS, "--split-sentences", "--workers", "1") == 0
    assert _run(inputs, tmp_path / "w2", *KEYS, "--split-sentences", "--workers", "2") == 0
    assert _files(tmp_path / "w1") == _files(tmp_path / "w2")


def test_parquet_lists_of_strings_are_sentences(tmp_path):
    """A list<string> column is a document's sentences, as a JSON list is."""
    docs = [["One sentence.", "Two."], ["Alone."]]
    parquet = _parquet(tmp_path / "s.parquet", [{"text": d} for d in docs])
    jsonl = tmp_path / "s.jsonl"
    jsonl.write_bytes(_jsonl_bytes([{"text": d} for d in docs]))
    assert _run(parquet, tmp_path / "p", "--append-eod") == 0
    assert _run(str(jsonl), tmp_path / "j", "--append-eod") == 0
    assert _files(tmp_path / "p") == _files(tmp_path / "j")
    assert IndexedDataset(str(tmp_path / "p_text_document")).document_indices.tolist() == [0, 2, 3]


def _one_line_error(capsys, tmp_path) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and _no_outputs(tmp_path)
    return err


def test_parquet_column_errors_name_file_and_column(tmp_path, capsys):
    path = _parquet(tmp_path / "in.parquet", RECORDS[:10])
    assert _run(path, tmp_path / "out", "--json-keys", "body") == 2
    err = _one_line_error(capsys, tmp_path)
    assert err == f"{path}: no column 'body' (--json-keys); its columns: text, title, id"
    assert _run(path, tmp_path / "out", "--json-keys", "text", "id") == 2
    err = _one_line_error(capsys, tmp_path)
    assert err.startswith(f"{path}: column 'id' is int64, not text; give string columns")


def test_unreadable_parquet_names_the_file(tmp_path, capsys):
    """A Parquet file cut short has no footer: refused before any work (the good file before it
    is not encoded either)."""
    path = tmp_path / "cut.parquet"
    _parquet(path, RECORDS)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    good = _parquet(tmp_path / "good.parquet", RECORDS[:10])
    assert _run([good, str(path)], tmp_path / "out") == 2
    err = _one_line_error(capsys, tmp_path)
    assert err.startswith(f"{path}: not a readable Parquet file (")
    assert err.endswith("); re-download or re-write it")


def test_corrupt_parquet_row_group_names_the_file(tmp_path, small_chunks, capsys):
    """Damaged pages past a good footer: found when their row group is read, after work began;
    the temporary outputs are removed."""
    path = tmp_path / "in.parquet"
    _parquet(path, RECORDS)
    column = pq.ParquetFile(path).metadata.row_group(2).column(0)
    data = bytearray(path.read_bytes())
    middle = column.data_page_offset + column.total_compressed_size // 2
    data[middle : middle + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))
    assert _run(str(path), tmp_path / "out", *KEYS) == 2
    err = _one_line_error(capsys, tmp_path)
    assert re.fullmatch(
        re.escape(f"{path}: row group ") + r"\d \(rows from \d+\) is unreadable \(.+\); "
        "re-download or re-write it",
        err,
    ), err


def test_parquet_null_is_a_bad_row(tmp_path, capsys):
    """A null stops the run naming its row (counted from 0), as a JSON null names its line; with
    --skip-bad-lines it is counted and the other rows kept."""
    records = [dict(r) for r in RECORDS[:60]]
    records[45]["title"] = None
    path = _parquet(tmp_path / "in.parquet", records)
    assert _run(path, tmp_path / "out", *KEYS) == 2
    err = _one_line_error(capsys, tmp_path)
    assert err == f"{path}: row 45: null in column 'title'; fix the row or pass --skip-bad-lines"
    assert _run(path, tmp_path / "out", *KEYS, "--skip-bad-lines") == 0
    assert f"skipped 1 bad lines (1 null in column 'title'); first: {path}: row 45" in (
        capsys.readouterr().out
    )
    assert IndexedDataset(str(tmp_path / "out_text_document")).num_documents == 59


def test_truncated_zstd_names_the_file_and_last_good_line(tmp_path, capsys):
    path = tmp_path / "in.jsonl.zst"
    _zstd(path, RECORDS)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])  # inside the second frame
    assert _run(str(path), tmp_path / "out", "--workers", "2") == 2
    err = _one_line_error(capsys, tmp_path)
    good = len(RECORDS) // 2  # the first frame's lines; the cut frame's block is lost whole
    assert err == (
        f"{path}: truncated or corrupt zstd stream after line {good}; re-download or re-compress it"
    )


def test_not_zstd_is_one_line(tmp_path, capsys):
    path = tmp_path / "in.jsonl.zst"
    path.write_bytes(_jsonl_bytes(RECORDS[:5]))  # plain text under a .zst name
    assert _run(str(path), tmp_path / "out") == 2
    err = _one_line_error(capsys, tmp_path)
    assert err.startswith(f"{path}: truncated or corrupt zstd stream after line 0")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("llama3"))
    write_llama3_style_tokenizer(directory, vocab_size=600)
    return directory


def _hf_flags(model: str) -> list[str]:
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model]


@pytest.mark.parametrize("specials", [False, True])
def test_hf_batch_path_equals_per_document_encode(tmp_path, monkeypatch, llama3, specials):
    """A Llama-3-style tokenizer.json: each chunk is one encode_batch call per key (never a
    per-text encode), and the ids equal encode() of each document, BOS included with
    --tokenizer-hf-include-special-tokens."""
    from megatron.data.tokenizers.hf import HFBacked

    monkeypatch.setattr(preprocess_data, "CHUNK_BYTES", 8192)
    tok = build_tokenizer("hf", model=llama3, hf_include_special_tokens=specials)
    expected = [tok.encode(d) + [tok.eod] for d in DOCS]
    calls = []
    batch = HFBacked.encode_batch

    def counted(self, texts):
        calls.append(len(texts))
        return batch(self, texts)

    def refused(self, text):
        raise AssertionError("per-text encode in the pipeline")

    monkeypatch.setattr(HFBacked, "encode_batch", counted)
    monkeypatch.setattr(HFBacked, "encode", refused)
    path = _parquet(tmp_path / "in.parquet", RECORDS, row_group_size=100)
    flags = ["--tokenizer-hf-include-special-tokens"] if specials else []
    argv = ["--input", path, "--output-prefix", str(tmp_path / "out"), *_hf_flags(llama3)]
    assert main([*argv, *flags, "--append-eod"]) == 0
    assert len(calls) > 3 and sum(calls) == len(DOCS)  # one call per chunk, every text once
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(DOCS))] == expected
    if specials:
        assert all(ids[0] == tok._tok.token_to_id("<|begin_of_text|>") for ids in expected)


TOKENIZERS = {
    "gpt2": {"vocab_file": "gpt2-vocab.json", "merges_file": "gpt2-merges.txt"},
    "wordpiece": {"vocab_file": "bert-vocab.txt"},
    "sentencepiece": {"model": "sp-unigram.model"},
    "hf": {"model": "hf-tokenizer.json"},
    "TikTokenizer": {"model": "tiktoken-vocab.json"},
}
OPTIONS = {"TikTokenizer": {"vocab_size": 2024}}  # the fixture's 1024 ranks + 1000 specials


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_every_batch_tokenizer_gets_a_chunk_per_call(kind):
    """The encoder hands each key's texts to encode_packed once per chunk, and no tokenizer that
    has a batch or buffer call falls back to its per-text ``encode`` there."""
    files = {k: os.path.join(FIXTURES, v) for k, v in TOKENIZERS[kind].items()}
    tok = build_tokenizer(kind, **files, **OPTIONS.get(kind, {}))
    encoder = JsonlEncoder(tok, ["text", "title"], append_eod=True)
    expected = {key: [tok.encode(r[key]) for r in RECORDS[:50]] for key in ("text", "title")}
    calls = []
    packed = tok.encode_packed
    tok.encode_packed = lambda texts: calls.append(len(texts)) or packed(texts)
    tok.encode = lambda text: pytest.fail(f"{kind}: per-text encode")
    lines = [(json.dumps(r) + "\n").encode() for r in RECORDS[:50]]
    result = encoder.encode_chunk(Chunk("x.jsonl", 1, lines, None, sum(map(len, lines))))
    assert calls == [50, 50]
    for key, docs in expected.items():
        ends = [0, *(result.sequence_lengths[key].cumsum())]
        got = [result.tokens[key][a : b - 1].tolist() for a, b in zip(ends, ends[1:])]
        assert got == docs


def _parallelism_setting() -> str | None:
    return os.environ.get("TOKENIZERS_PARALLELISM")


def test_tokenizers_parallelism_is_off_for_the_run_and_restored(tmp_path, monkeypatch, llama3):
    """One tokenizer thread per process (--workers is the parallelism): the library sees
    TOKENIZERS_PARALLELISM=false while it encodes here and in the workers; the variable is
    unset again after the run; a user's ``true`` is kept with --workers 1, noted with more."""
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    seen = []
    encode_chunk = JsonlEncoder.encode_chunk

    def spy(self, chunk):
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return encode_chunk(self, chunk)

    monkeypatch.setattr(JsonlEncoder, "encode_chunk", spy)
    path = tmp_path / "in.jsonl"
    path.write_bytes(_jsonl_bytes(RECORDS[:20]))
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "out"), *_hf_flags(llama3)]
    assert main(argv) == 0
    assert seen == ["false"] and "TOKENIZERS_PARALLELISM" not in os.environ
    args = preprocess_data.build_parser().parse_args([*argv, "--workers", "2"])
    with preprocess_data._start_pool(args) as pool:
        assert pool.apply(_parallelism_setting) == "false"
    assert preprocess_data.parallelism_notes(args) == []
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    assert main(argv) == 0
    assert seen[-1] == "true"  # the user's choice, in the one process
    with preprocess_data._start_pool(args) as pool:
        assert pool.apply(_parallelism_setting) == "false"
    (note,) = preprocess_data.parallelism_notes(args)
    assert note.startswith("note: TOKENIZERS_PARALLELISM=true is not used by the --workers")
