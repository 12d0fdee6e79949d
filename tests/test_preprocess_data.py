"""tools/preprocess_data.py, tools/merge_datasets.py and tools/make_sample_corpus.py."""

from __future__ import annotations

import glob
import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.sentences import split_sentences
from megatron.data.tokenizers.factory import build_tokenizer
from tests.fixtures.make_tokenizer_fixtures import synthetic_documents
from tools import preprocess_data
from tools.make_sample_corpus import write_corpus
from tools.merge_datasets import main as merge_main
from tools.preprocess_data import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "tokenizers")
GPT2_FLAGS = [
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    os.path.join(FIXTURES, "gpt2-vocab.json"),
    "--merge-file",
    os.path.join(FIXTURES, "gpt2-merges.txt"),
]
DOCS = synthetic_documents(300, seed=21)


def _gpt2():
    return build_tokenizer("gpt2", vocab_file=GPT2_FLAGS[3], merges_file=GPT2_FLAGS[5])


def _write_jsonl(path, docs, key="text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({key: doc, "id": len(doc)}) + "\n")
    return str(path)


def _run(inputs, prefix, *flags) -> int:
    inputs = [inputs] if isinstance(inputs, str) else inputs
    return main(["--input", *inputs, "--output-prefix", str(prefix), *GPT2_FLAGS, *flags])


def _files(prefix) -> dict[str, bytes]:
    return {p[len(str(prefix)) :]: open(p, "rb").read() for p in sorted(glob.glob(f"{prefix}*"))}


@pytest.fixture
def small_chunks(monkeypatch):
    """Many chunks from little data, so ordering across chunks and workers is exercised."""
    monkeypatch.setattr(preprocess_data, "CHUNK_BYTES", 4096)  # about 11 lines


def test_documents_read_back(tmp_path, small_chunks, capsys):
    path = _write_jsonl(tmp_path / "in.jsonl", DOCS)
    assert _run(path, tmp_path / "out", "--append-eod") == 0
    tok = _gpt2()
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.uint16
    assert ds.document_indices.tolist() == list(range(len(DOCS) + 1))
    for i, doc in enumerate(DOCS):
        assert ds[i].tolist() == tok.encode(doc) + [tok.eod]
    summary = capsys.readouterr().out
    assert f"{len(DOCS):,} documents" in summary and "tokens/s" in summary and "MB/s" in summary


@pytest.mark.slow
def test_workers_1_and_4_byte_identical(tmp_path, small_chunks):
    path = _write_jsonl(tmp_path / "in.jsonl", DOCS)
    assert _run(path, tmp_path / "w1", "--append-eod", "--split-sentences", "--workers", "1") == 0
    assert _run(path, tmp_path / "w4", "--append-eod", "--split-sentences", "--workers", "4") == 0
    one, four = _files(tmp_path / "w1"), _files(tmp_path / "w4")
    assert list(one) == ["_text_sentence.bin", "_text_sentence.idx", "_text_sentence.json"]
    assert one == four


def test_split_sentences_one_sequence_each(tmp_path):
    docs = ["First one. Second one! Third?", "Alone", "Dr. Smith came. He left.\n\nNew part"]
    path = _write_jsonl(tmp_path / "in.jsonl", docs)
    assert _run(path, tmp_path / "out", "--split-sentences", "--append-eod") == 0
    tok = _gpt2()
    ds = IndexedDataset(str(tmp_path / "out_text_sentence"))
    expected = [
        ["First one.", "Second one!", "Third?"],
        ["Alone"],
        ["Dr. Smith came.", "He left.", "New part"],
    ]
    assert ds.document_indices.tolist() == [0, 3, 4, 7]
    seq = 0
    for sentences in expected:
        for j, sentence in enumerate(sentences):
            eod = [tok.eod] if j == len(sentences) - 1 else []
            assert ds[seq].tolist() == tok.encode(sentence) + eod
            seq += 1


@pytest.mark.parametrize(
    "text, sentences",
    [
        ("One. Two. Three.", ["One.", "Two.", "Three."]),
        (
            "Mr. and Mrs. Smith met Dr. Who. Then e.g. this stays.",
            ["Mr. and Mrs. Smith met Dr. Who.", "Then e.g. this stays."],
        ),
        ("J. R. Tolkien wrote. It sold.", ["J. R. Tolkien wrote.", "It sold."]),
        (
            "Pi is 3.14 or so. Steps: 1. Open it. 2. Close it.",
            ["Pi is 3.14 or so.", "Steps: 1. Open it.", "2. Close it."],
        ),
        (
            'He said "Stop." Then left... Why? "Because!" (Indeed.) Done',
            ['He said "Stop."', "Then left...", "Why?", '"Because!"', "(Indeed.)", "Done"],
        ),
        ("not a sentence end. because lower case", ["not a sentence end. because lower case"]),
        ("東京は大きい。大阪も大きい！本当？", ["東京は大きい。", "大阪も大きい！", "本当？"]),
        ("title line\n\nbody text\nwrapped here", ["title line", "body text\nwrapped here"]),
        ("See Dr.\n\nthen e.g.\n \nmore", ["See Dr.", "then e.g.", "more"]),
        ("In 1990. The year.", ["In 1990.", "The year."]),
        ("  ", []),
    ],
)
def test_split_sentences(text, sentences):
    assert split_sentences(text) == sentences


def test_json_keys_and_lists(tmp_path):
    path = tmp_path / "in.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "Body one.", "title": "T1"}) + "\n")
        f.write(json.dumps({"text": ["Pre split.", "Sentences."], "title": "T2"}) + "\n")
    assert _run(str(path), tmp_path / "out", "--json-keys", "text", "title") == 0
    tok = _gpt2()
    body = IndexedDataset(str(tmp_path / "out_text_document"))
    title = IndexedDataset(str(tmp_path / "out_title_document"))
    assert [body[i].tolist() for i in range(3)] == [
        tok.encode(t) for t in ("Body one.", "Pre split.", "Sentences.")
    ]
    assert body.document_indices.tolist() == [0, 1, 3]
    assert [title[i].tolist() for i in range(2)] == [tok.encode("T1"), tok.encode("T2")]


def test_gz_and_glob_inputs(tmp_path):
    plain = _write_jsonl(tmp_path / "all.jsonl", DOCS)
    _write_jsonl(tmp_path / "part-a.jsonl", DOCS[:100])
    with gzip.open(tmp_path / "part-b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS[100:])
    assert _run(plain, tmp_path / "plain", "--append-eod") == 0
    assert _run(str(tmp_path / "part-*"), tmp_path / "parts", "--append-eod") == 0
    assert _files(tmp_path / "plain") == _files(tmp_path / "parts")


def test_other_tokenizers(tmp_path):
    """WordPiece ends documents with [SEP], sentencepiece with eos; Megatron's extra flags pass."""
    path = _write_jsonl(tmp_path / "in.jsonl", DOCS[:20])
    vocab = os.path.join(FIXTURES, "bert-vocab.txt")
    assert (
        main(
            [
                "--input",
                path,
                "--output-prefix",
                str(tmp_path / "wp"),
                "--tokenizer-type",
                "BertWordPieceLowerCase",
                "--vocab-file",
                vocab,
                "--append-eod",
                "--lang",
                "english",
                "--partitions",
                "2",
                "--dataset-impl",
                "mmap",
            ]
        )
        == 0
    )
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab)
    ds = IndexedDataset(str(tmp_path / "wp_text_document"))
    assert ds[3].tolist() == tok.encode(DOCS[3]) + [tok.sep]
    model = os.path.join(FIXTURES, "sp-unigram.model")
    assert (
        main(
            [
                "--input",
                path,
                "--output-prefix",
                str(tmp_path / "sp"),
                "--tokenizer-type",
                "sentencepiece",
                "--tokenizer-model",
                model,
                "--append-eod",
            ]
        )
        == 0
    )
    ds = IndexedDataset(str(tmp_path / "sp_text_document"))
    assert ds[5].tolist() == build_tokenizer("sentencepiece", model=model).encode(DOCS[5]) + [3]


BAD_LINES = {
    "malformed": (b'{"text": "unterminated}\n', "malformed JSON"),
    "blank": (b"\n", "blank line"),
    "missing": (b'{"body": "x"}\n', "missing key 'text'"),
    "utf8": (b'{"text": "caf\xe9"}\n', "invalid UTF-8 (byte 13)"),
    "empty": (b'{"text": ""}\n', "empty document in key 'text'"),
    "whitespace": (b'{"text": "  \\n "}\n', "empty document in key 'text'"),
    "number": (b'{"text": 7}\n', "not a string in key 'text' (a int)"),
    "array": (b'["text"]\n', "not a JSON object (a list)"),
    "surrogate": (b'{"text": "a\\ud800b"}\n', "unpaired surrogate escape"),
    "no_sentences": (b'{"text": []}\n', "empty document in key 'text' (no tokens)"),
}


def _input_with_bad_line(tmp_path, line: bytes, at: int) -> str:
    path = tmp_path / "in.jsonl"
    good = [(json.dumps({"text": d}) + "\n").encode() for d in DOCS]
    path.write_bytes(b"".join(good[: at - 1]) + line + b"".join(good[at - 1 :]))
    return str(path)


def _no_outputs(tmp_path, prefix="out") -> bool:
    return not glob.glob(str(tmp_path / f"{prefix}_*"))


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_line_stops_with_file_and_line(tmp_path, small_chunks, capsys, kind):
    line, reason = BAD_LINES[kind]
    path = _input_with_bad_line(tmp_path, line, at=37)
    assert _run(path, tmp_path / "out", "--append-eod") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{path}:37: {reason}") and "--skip-bad-lines" in err
    assert "\n" not in err
    assert _no_outputs(tmp_path)  # neither final-named nor temporary files remain


@pytest.mark.slow
def test_late_bad_line_with_workers_leaves_nothing(tmp_path, small_chunks, capsys):
    path = _input_with_bad_line(tmp_path, BAD_LINES["malformed"][0], at=len(DOCS))
    assert _run(path, tmp_path / "out", "--workers", "2") == 2
    assert capsys.readouterr().err.startswith(f"{path}:{len(DOCS)}: malformed JSON")
    assert _no_outputs(tmp_path)


def test_skip_bad_lines(tmp_path, small_chunks, capsys):
    path = tmp_path / "in.jsonl"
    lines = [(json.dumps({"text": d}) + "\n").encode() for d in DOCS[:50]]
    lines[10] = BAD_LINES["malformed"][0]
    lines[20] = BAD_LINES["empty"][0]
    lines[30] = BAD_LINES["utf8"][0]
    path.write_bytes(b"".join(lines))
    assert _run(str(path), tmp_path / "out", "--skip-bad-lines") == 0
    out = capsys.readouterr().out
    assert "skipped 3 bad lines" in out and f"first: {path}:11: malformed JSON" in out
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    kept = [d for i, d in enumerate(DOCS[:50]) if i not in (10, 20, 30)]
    assert ds.num_documents == len(kept)
    assert ds[25].tolist() == _gpt2().encode(kept[25])


def test_a_key_without_tokens_drops_its_line_from_every_key(tmp_path, small_chunks, capsys):
    records = [{"text": d, "title": d[:30]} for d in DOCS[:40]]
    records[12]["title"] = []  # found only after the chunk is encoded
    records[30]["text"] = 5  # found while parsing, in the same chunk
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    flags = ["--json-keys", "text", "title", "--skip-bad-lines"]
    assert _run(str(path), tmp_path / "out", *flags) == 0
    assert f"first: {path}:13: empty document in key 'title' (no tokens)" in capsys.readouterr().out
    kept = [r for i, r in enumerate(records) if i not in (12, 30)]
    tok = _gpt2()
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / f"out_{key}_document"))
        assert ds.num_documents == len(kept)
        assert [ds[i].tolist() for i in (11, 12, 29)] == [
            tok.encode(kept[i][key]) for i in (11, 12, 29)
        ]


def test_missing_tokenizer_file(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "in.jsonl", DOCS[:2])
    assert (
        main(
            [
                "--input",
                path,
                "--output-prefix",
                str(tmp_path / "out"),
                "--tokenizer-type",
                "gpt2",
                "--vocab-file",
                str(tmp_path / "none.json"),
                "--merge-file",
                "x",
            ]
        )
        == 2
    )
    assert "tokenizer.vocab_file=" in capsys.readouterr().err
    assert (
        main(
            [
                "--input",
                str(tmp_path / "nothing*.jsonl"),
                "--output-prefix",
                str(tmp_path / "out"),
                *GPT2_FLAGS,
            ]
        )
        == 2
    )
    assert "no such file" in capsys.readouterr().err
    assert _no_outputs(tmp_path)


def _kill_midway(tmp_path, sig: int) -> None:
    """Feed a FIFO part of the input and keep it open; signal the tool while it waits for more."""
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    prefix = tmp_path / "out"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "tools", "preprocess_data.py"),
        "--input",
        str(fifo),
        "--output-prefix",
        str(prefix),
        *GPT2_FLAGS,
        "--append-eod",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    release = threading.Event()

    def feed() -> None:
        # Four chunks of 1024 lines, then the FIFO stays open: the tool writes, then waits.
        try:
            with open(fifo, "w", encoding="utf-8") as f:
                for _ in range(4):
                    f.writelines(json.dumps({"text": d}) + "\n" for d in (DOCS * 4)[:1024])
                f.flush()
                release.wait(60)
        except BrokenPipeError:
            pass  # the tool died while this thread was still writing

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    deadline = time.monotonic() + 60
    # Wait until the tool has written tokens (to its temporary .bin, whatever the writer names it).
    while not any(os.path.getsize(p) for p in glob.glob(f"{prefix}_text_document.bin*")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.wait(30)
    release.set()
    feeder.join(10)
    assert proc.returncode != 0
    assert not glob.glob(f"{prefix}_text_document.bin") + glob.glob(f"{prefix}_*.idx")
    if sig == signal.SIGTERM:  # a catchable signal also removes the temporary files
        assert _no_outputs(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_midway_leaves_no_final_output(tmp_path, sig):
    _kill_midway(tmp_path, sig)


def test_workers_end_on_sigterm_without_python():
    """Pool.terminate() must not rely on a Python handler in the workers.

    A SIGTERM that reaches a just-forked worker before CPython's after-fork setup is dropped when
    a Python handler is installed, and terminate() then waits for that worker forever.
    """
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as main() installs
    try:
        args = preprocess_data.build_parser().parse_args(
            ["--input", "x", "--output-prefix", "y", *GPT2_FLAGS, "--workers", "2"]
        )
        with preprocess_data._start_pool(args) as pool:
            assert pool.apply(signal.getsignal, (signal.SIGTERM,)) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the parent's is back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_merge_equals_preprocessing_the_concatenation(tmp_path, capsys):
    a = _write_jsonl(tmp_path / "a.jsonl", DOCS[:120])
    b = _write_jsonl(tmp_path / "b.jsonl", DOCS[120:])
    os.makedirs(tmp_path / "parts")
    assert _run([a, b], tmp_path / "whole", "--split-sentences", "--append-eod") == 0
    assert _run(a, tmp_path / "parts" / "a", "--split-sentences", "--append-eod") == 0
    assert _run(b, tmp_path / "parts" / "b", "--split-sentences", "--append-eod") == 0
    whole = _files(tmp_path / "whole_text_sentence")
    parts = [str(tmp_path / "parts" / f"{x}_text_sentence") for x in "ab"]
    assert merge_main(["--input", *parts, "--output-prefix", str(tmp_path / "m1")]) == 0
    assert (
        merge_main(["--input", str(tmp_path / "parts"), "--output-prefix", str(tmp_path / "m2")])
        == 0
    )
    merged = [_files(tmp_path / m) for m in ("m1", "m2")]
    sidecars = [json.loads(files.pop(".json")) for files in [*merged, whole]]
    assert merged[0] == merged[1] == whole
    assert sidecars[0] == sidecars[1] == {**sidecars[2], "tool": "tools/merge_datasets.py"}
    assert merge_main(["--input", parts[0], "--output-prefix", parts[0]]) == 2
    assert "also an input" in capsys.readouterr().err


def test_sample_corpus_is_deterministic_jsonl(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    count, size, _ = write_corpus(str(a), size_mb=0.05)
    write_corpus(str(b), size_mb=0.05)
    assert a.read_bytes() == b.read_bytes()
    assert 0 < size <= 50_000 and size == a.stat().st_size
    records = [json.loads(line) for line in a.read_text(encoding="utf-8").splitlines()]
    assert len(records) == count
    assert all(set(r) == {"id", "text"} and len(r["text"]) >= 40 for r in records)
    assert len({r["id"] for r in records}) == count
