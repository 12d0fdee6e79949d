"""The dataset sidecar: training and the dry run warn once when the config's tokenizer is not the
data's; data without one (made by Megatron) is not checked; Megatron still reads the files."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil

import pytest

from megatron.config.load import load_config
from megatron.config.schema import DataConfig
from megatron.config.tokenizer import TokenizerConfig
from megatron.data.sidecar import check_data_tokenizer, read_sidecar, sidecar_path
from megatron.errors import ConfigError
from megatron.launch.dry_run import dry_run
from tests.fixtures import GPT2_MERGES, GPT2_VOCAB, SP_BPE
from tests.fixtures.make_tokenizer_fixtures import synthetic_documents
from tests.test_indexed_dataset import _MCORE_READ, run_megatron_core
from tools.preprocess_data import main as preprocess

GPT2 = TokenizerConfig(type="GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merges_file=GPT2_MERGES)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """A GPT-2 BPE dataset with its sidecar."""
    tmp = tmp_path_factory.mktemp("sidecar")
    corpus = tmp / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in synthetic_documents(40, seed=1)),
        encoding="utf-8",
    )
    argv = ["--input", str(corpus), "--output-prefix", str(tmp / "gpt2"), "--append-eod"]
    argv += [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        GPT2_VOCAB,
        "--merge-file",
        GPT2_MERGES,
    ]
    assert preprocess(argv) == 0
    return str(tmp / "gpt2_text_document")


def _warnings(tokenizer: TokenizerConfig, paths: list) -> list[str]:
    said: list[str] = []
    check_data_tokenizer(tokenizer, DataConfig(paths=paths), said.append)
    return said


def test_the_same_tokenizer_by_any_name_or_copy_is_quiet(data, tmp_path):
    assert _warnings(GPT2, [data]) == []
    assert (
        _warnings(
            TokenizerConfig(type="gpt2", vocab_file=GPT2_VOCAB, merges_file=GPT2_MERGES), [data]
        )
        == []
    )
    copies = [shutil.copy(f, tmp_path / os.path.basename(f)) for f in (GPT2_VOCAB, GPT2_MERGES)]
    copied = TokenizerConfig(type="gpt2", vocab_file=str(copies[0]), merges_file=str(copies[1]))
    assert _warnings(copied, [0.5, data, 0.5, data]) == []


def _reordered_merges(tmp_path) -> TokenizerConfig:
    """GPT-2 BPE of the same size and EOD with two merges swapped: only the files differ."""
    merges = tmp_path / "merges.txt"
    lines = open(GPT2_MERGES, encoding="utf-8").read().splitlines()
    merges.write_text("\n".join([lines[0], lines[2], lines[1], *lines[3:]]) + "\n", "utf-8")
    return TokenizerConfig(type="gpt2", vocab_file=GPT2_VOCAB, merges_file=str(merges))


def test_another_tokenizer_warns_in_one_line(data, tmp_path):
    (said,) = _warnings(TokenizerConfig(type="sentencepiece", model=SP_BPE), [data, data])
    assert "\n" not in said and data in said and "(and 1 more datasets)" in said
    assert "GPT2BPETokenizer (vocab 1025, eod 1024" in said and "sentencepiece (vocab 1000" in said
    assert "family gpt2 vs sentencepiece" in said
    (said,) = _warnings(_reordered_merges(tmp_path), [data])
    assert "the tokenizer files differ" in said


def test_data_without_sidecar_is_not_checked(data, tmp_path):
    for ext in (".bin", ".idx"):
        shutil.copy(data + ext, tmp_path / f"megatron{ext}")
    megatron_made = str(tmp_path / "megatron")
    assert read_sidecar(megatron_made) is None
    assert _warnings(TokenizerConfig(type="sentencepiece", model=SP_BPE), [megatron_made]) == []
    hdf5 = DataConfig(paths=[data], format="hdf5")
    said: list[str] = []
    check_data_tokenizer(TokenizerConfig(type="sentencepiece", model=SP_BPE), hdf5, said.append)
    assert said == []
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable dataset sidecar"):
        read_sidecar(str(tmp_path / "bad"))


def test_dry_run_reports_the_mismatch(data, tmp_path):
    tok = _reordered_merges(tmp_path)
    overrides = [f"data.paths=[{data}]", "data.cache_dir=null", "tokenizer.type=gpt2"]
    overrides += [
        f"tokenizer.vocab_file={tok.vocab_file}",
        f"tokenizer.merges_file={tok.merges_file}",
    ]
    cfg = load_config(["configs/gpt_tiny.yaml"], [*overrides, "tokenizer.model=null"])
    out = io.StringIO()
    dry_run(cfg, argparse.Namespace(world_size=None, gpu_memory_gb=None), out=out)
    warnings = [line for line in out.getvalue().splitlines() if line.startswith("WARNING:")]
    assert len(warnings) == 1 and "the tokenizer files differ" in warnings[0]


def test_megatron_core_reads_data_beside_its_sidecar(data):
    assert os.path.isfile(sidecar_path(data))
    (line,) = run_megatron_core(_MCORE_READ, data).strip().splitlines()[-1:]
    assert len(json.loads(line)["docs"]) == 41
