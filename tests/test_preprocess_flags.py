"""tools/preprocess_data.py as a Megatron-LM user meets it: every flag of Megatron's own script
honoured, noted or refused, its README command unchanged, progress lines, and the sidecar."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from megatron.data.indexed_dataset import IndexedDataset
from tests.test_preprocess_data import (
    DOCS,
    FIXTURES,
    ROOT,
    _files,
    _gpt2,
    _no_outputs,
    _run,
    _write_jsonl,
    small_chunks,
)
from tools import preprocess_data
from tools.merge_datasets import main as merge_main
from tools.preprocess_data import main

__all__ = ["small_chunks"]  # a fixture: pytest finds it by name here


def _tool(cwd, *argv: str) -> subprocess.CompletedProcess:
    script = os.path.join(ROOT, "tools", "preprocess_data.py")
    return subprocess.run(
        [sys.executable, script, *argv], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_megatron_readme_command_with_partitions(tmp_path):
    """Megatron's README GPT-2 command (+ --keep-newlines --workers 2 --partitions 2) runs as is
    and writes the bytes it writes without --partitions, under Megatron's final names."""
    _write_jsonl(tmp_path / "my-corpus.json", DOCS[:120])
    for name in ("gpt2-vocab.json", "gpt2-merges.txt"):
        os.symlink(os.path.join(FIXTURES, name), tmp_path / name)
    readme = [
        "--input", "my-corpus.json",
        "--output-prefix", "my-gpt2",
        "--vocab-file", "gpt2-vocab.json",
        "--tokenizer-type", "GPT2BPETokenizer",
        "--merge-file", "gpt2-merges.txt",
        "--append-eod",
    ]  # fmt: skip
    done = _tool(tmp_path, *readme, "--keep-newlines", "--workers", "2", "--partitions", "2")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("note: --partitions is not needed here") == 1
    with_partitions = _files(tmp_path / "my-gpt2")
    assert list(with_partitions) == [
        "_text_document.bin",
        "_text_document.idx",
        "_text_document.json",
    ]
    for path in glob.glob(str(tmp_path / "my-gpt2*")):
        os.remove(path)
    assert _tool(tmp_path, *readme, "--keep-newlines", "--workers", "2").returncode == 0
    assert _files(tmp_path / "my-gpt2") == with_partitions
    # Nothing else written: Megatron leaves my-corpus_0.json ... and my-gpt2_0_* behind.
    assert sorted(os.listdir(tmp_path)) == sorted(
        [
            "gpt2-merges.txt",
            "gpt2-vocab.json",
            "my-corpus.json",
            *(f"my-gpt2{k}" for k in with_partitions),
        ]
    )


def test_keep_newlines_keeps_the_whitespace_between_sentences(tmp_path):
    docs = ["First one.  Second one!\n\nA new paragraph.\nLast line.  \n", "Alone.\n"]
    path = _write_jsonl(tmp_path / "in.jsonl", docs)
    assert _run(path, tmp_path / "keep", "--split-sentences", "--keep-newlines") == 0
    assert _run(path, tmp_path / "strip", "--split-sentences") == 0
    tok = _gpt2()
    keep = IndexedDataset(str(tmp_path / "keep_text_sentence"))
    strip = IndexedDataset(str(tmp_path / "strip_text_sentence"))
    pieces = ["First one.  ", "Second one!\n\n", "A new paragraph.\n", "Last line.", "Alone."]
    assert [keep[i].tolist() for i in range(5)] == [tok.encode(p) for p in pieces]
    assert [strip[i].tolist() for i in range(5)] == [tok.encode(p.strip()) for p in pieces]
    assert keep.document_indices.tolist() == strip.document_indices.tolist() == [0, 4, 5]


def test_log_interval_prints_progress_lines(tmp_path, small_chunks, capsys):
    path = _write_jsonl(tmp_path / "in.jsonl", DOCS)
    assert _run(path, tmp_path / "out", "--log-interval", "100") == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("Processed ")]
    assert len(lines) == 3 and all("docs/s" in x and "MB/s" in x for x in lines)
    counts = [int(x.split()[1]) for x in lines]
    assert counts == sorted(counts) and counts[0] >= 100 and counts[-1] == len(DOCS)


# Every flag of Megatron-LM's tools/preprocess_data.py: main (d98e8a6: the file's own flags and
# those TokenizerConfig generates) and core_v0.16.1's older spellings, plus --dataset-impl.
MEGATRON_FLAGS = """--input --json-keys --split-sentences --keep-newlines --append-eod --lang
    --output-prefix --workers --find-optimal-num-workers --workers-to-check --max-documents
    --partitions --log-interval --keep-sequential-samples --vocab-size --padded-vocab-size
    --no-pad-vocab-size --disable-pad-vocab-size --vocab-file --merge-file --vocab-extra-ids
    --tokenizer-type --tokenizer-model --tokenizer-metadata --tokenizer-special-tokens
    --tiktoken-pattern --tiktoken-num-special-tokens --tokenizer-sentencepiece-legacy
    --no-tokenizer-sentencepiece-ignore-extra-whitespaces
    --disable-tokenizer-sentencepiece-ignore-extra-whitespaces --tokenizer-hf-no-use-fast
    --tokenizer-hf-no-include-special-tokens --trust-remote-code --null-tokenizer-eod-id
    --null-tokenizer-pad-id --chat-template --use-gigatoken --legacy-tokenizer
    --tiktoken-special-tokens --tokenizer-hf-use-fast --tokenizer-hf-include-special-tokens
    --dataset-impl""".split()
REFUSED = {
    "--padded-vocab-size": ["128"],
    "--no-pad-vocab-size": [],
    "--disable-pad-vocab-size": [],
    "--tokenizer-metadata": ["meta.json"],
    "--tokenizer-hf-no-use-fast": [],
    "--trust-remote-code": [],
    "--chat-template": ["{{ x }}"],
    "--legacy-tokenizer": [],
    "--lang": ["german", "--split-sentences"],
    "--tokenizer-model": ["x.model"],  # GPT2BPETokenizer reads no model file
    "--vocab-size": ["7"],
    "--vocab-extra-ids": ["3"],
    "--tokenizer-special-tokens": ["<x>"],
    "--tiktoken-pattern": ["v1"],
    "--tokenizer-sentencepiece-legacy": [],
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": [],
    "--tokenizer-hf-include-special-tokens": [],
    "--null-tokenizer-eod-id": ["3"],
}
NOTED = {
    "--partitions": ["4"],
    "--keep-sequential-samples": [],
    "--use-gigatoken": [],
    "--keep-newlines": [],
    "--lang": ["english"],
    "--workers-to-check": ["2", "4"],
    "--max-documents": ["10"],
}


def test_parser_takes_every_megatron_flag():
    options = {o for a in preprocess_data.build_parser()._actions for o in a.option_strings}
    assert set(MEGATRON_FLAGS) <= options


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_flags_that_cannot_apply_are_refused_in_one_line(tmp_path, capsys, flag):
    path = _write_jsonl(tmp_path / "in.jsonl", DOCS[:3])
    assert _run(path, tmp_path / "out", flag, *REFUSED[flag]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err, err
    assert _no_outputs(tmp_path)


@pytest.mark.parametrize("flag", sorted(NOTED))
def test_flags_with_no_effect_print_one_note(tmp_path, capsys, flag):
    path = _write_jsonl(tmp_path / "in.jsonl", DOCS[:3])
    assert _run(path, tmp_path / "plain") == 0
    capsys.readouterr()
    assert _run(path, tmp_path / "out", flag, *NOTED[flag]) == 0
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note:")]
    assert len(notes) == 1 and flag in notes[0]
    assert _files(tmp_path / "out_") == _files(tmp_path / "plain_")


def test_find_optimal_num_workers_times_and_writes_nothing(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "in.jsonl", DOCS)
    flags = ["--find-optimal-num-workers", "--workers-to-check", "1", "2", "--max-documents", "50"]
    assert _run(path, tmp_path / "out", *flags) == 0
    out = capsys.readouterr().out
    assert "Performance results (fastest → slowest):" in out
    assert "1 workers → avg. docs/s" in out and "2 workers → avg. docs/s" in out
    assert "The most optimal num of workers is" in out
    assert _no_outputs(tmp_path)


def test_null_tokenizer_names_a_bad_line(tmp_path, capsys):
    path = tmp_path / "ids.jsonl"
    path.write_text('{"text": "1 2 3"}\n{"text": "4 five"}\n', encoding="utf-8")
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "out")]
    assert main([*argv, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{path}:2: not an integer id: 'five'") and "\n" not in err


def test_tiktoken_special_tokens_is_the_older_spelling(tmp_path):
    path = _write_jsonl(tmp_path / "in.jsonl", DOCS[:20])
    specials = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<x>"]
    tik = ["--tokenizer-type", "TikTokenizer", "--vocab-size", "2024", "--append-eod"]
    tik += ["--tokenizer-model", os.path.join(FIXTURES, "tiktoken-vocab.json")]
    for name, flag in (("new", "--tokenizer-special-tokens"), ("old", "--tiktoken-special-tokens")):
        argv = ["--input", path, "--output-prefix", str(tmp_path / name), *tik, flag, *specials]
        assert main(argv) == 0
    assert _files(tmp_path / "new_") == _files(tmp_path / "old_")


def test_sidecar_and_merge_refusing_a_mix(tmp_path, capsys):
    a = _write_jsonl(tmp_path / "a.jsonl", DOCS[:30])
    os.makedirs(tmp_path / "parts")
    assert _run(a, tmp_path / "parts" / "gpt2", "--append-eod") == 0
    sidecar = json.loads((tmp_path / "parts" / "gpt2_text_document.json").read_text())
    tok = _gpt2()
    assert sidecar["tool"] == "tools/preprocess_data.py" and sidecar["tool_version"]
    assert (sidecar["level"], sidecar["append_eod"]) == ("document", True)
    assert sidecar["tokenizer"]["type"] == "GPT2BPETokenizer"
    assert (sidecar["tokenizer"]["vocab_size"], sidecar["tokenizer"]["eod"]) == (1025, tok.eod)
    sp = ["--tokenizer-type", "sentencepiece", "--append-eod"]
    sp += ["--tokenizer-model", os.path.join(FIXTURES, "sp-bpe.model")]
    assert main(["--input", a, "--output-prefix", str(tmp_path / "parts" / "sp"), *sp]) == 0
    parts = [str(tmp_path / "parts" / f"{x}_text_document") for x in ("gpt2", "sp")]
    capsys.readouterr()
    assert merge_main(["--input", *parts, "--output-prefix", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert "made with sentencepiece (vocab 1000" in err and "merge only datasets" in err
    assert "\n" not in err and not glob.glob(str(tmp_path / "m*"))
    # A dataset without a sidecar (made by Megatron) merges; the result claims no tokenizer.
    os.remove(parts[1] + ".json")
    os.rename(parts[1] + ".bin", parts[0] + "2.bin")
    os.rename(parts[1] + ".idx", parts[0] + "2.idx")
    assert (
        merge_main(["--input", parts[0], parts[0] + "2", "--output-prefix", str(tmp_path / "m")])
        == 0
    )
    assert "has no sidecar" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == sorted(["a.jsonl", "parts", "m.bin", "m.idx"])
