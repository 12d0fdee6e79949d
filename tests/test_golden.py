"""The absolute reference for our numerics: fresh tiny GPT and BERT runs against the per-iteration
losses in tests/golden/.

Every other loss check is relative (a layout against one process, a resume against an unbroken
run), so a change that moves the numerics of every layout alike passes all of them; this one does
not. Each run is the real entrypoint, one process, TP=1, fp32, no dropout, 20 iterations from
``training.seed`` 1234, on a corpus generated here and tokenized with a committed fixture
tokenizer, so nothing depends on this machine's files.

The tolerance, 1e-6 relative, sits between the two things it must tell apart: a rerun on this
machine reproduces every loss exactly, while a change of a numerics default (the LayerNorm epsilon
from 1e-5 to 1e-6) moves the first iteration's loss by 2.6e-6 (GPT) and 1.2e-5 (BERT) relative.

Regenerate after a deliberate change of the numerics (then commit the files with a message that
says why the numbers moved):

    GOLDEN_REGENERATE=1 .venv/bin/python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tests.gpt_run import _tool, read_metrics, run_pretrain, tiny_overrides
from tests.test_pretrain_bert import VOCAB_FILE, bert_overrides, write_corpus

GOLDEN = Path(__file__).parent / "golden"
SP_MODEL = "tests/fixtures/tokenizers/sp-bpe.model"
RTOL = 1e-6
RUN = {"parallel.tensor_parallel_size": 1, "training.train_iters": 20, "training.eval_iters": 0}
HEADER = """\
# Per-iteration training losses of {what} (tests/test_golden.py: TP=1, fp32, no dropout,
# 20 iterations, training.seed 1234, on its generated corpus). Columns: iteration, then each loss.
# Regenerate only after a deliberate change of the numerics, and commit it saying why they moved:
#   GOLDEN_REGENERATE=1 .venv/bin/python -m pytest tests/test_golden.py
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    """The generated corpus as GPT data (sentencepiece fixture) and BERT data (WordPiece)."""
    out = tmp_path_factory.mktemp("golden_data")
    write_corpus(out / "corpus.jsonl")
    common = ["--input", str(out / "corpus.jsonl"), "--workers", "1"]
    _tool(
        "tools/preprocess_data.py", *common, "--output-prefix", str(out / "gpt"),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", SP_MODEL,
        "--append-eod",
    )  # fmt: skip
    _tool(
        "tools/preprocess_data.py", *common, "--output-prefix", str(out / "bert"),
        "--tokenizer-type", "BertWordPieceCase", "--vocab-file", VOCAB_FILE, "--split-sentences",
    )  # fmt: skip
    return {"gpt": str(out / "gpt_text_document"), "bert": str(out / "bert_text_sentence")}


def _losses(metrics: Path, names: list[str]) -> list[list[float]]:
    return [[e["iteration"], *(e[n] for n in names)] for e in read_metrics(metrics)]


def _compare(name: str, what: str, rows: list[list[float]]) -> None:
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("GOLDEN_REGENERATE"):
        lines = [" ".join([str(int(r[0])), *map(repr, r[1:])]) for r in rows]
        path.write_text(HEADER.format(what=what) + "\n".join(lines) + "\n")
    text = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    golden = [[float(x) for x in line.split()] for line in text]
    assert [r[0] for r in rows] == [g[0] for g in golden], "the run logged other iterations"
    for row, want in zip(rows, golden, strict=True):
        for got, ref in zip(row[1:], want[1:], strict=True):
            assert math.isclose(got, ref, rel_tol=RTOL), (
                f"{path.name} iteration {int(row[0])}: loss {got!r}, golden {ref!r}; if the "
                "numerics changed on purpose, regenerate (see tests/test_golden.py)"
            )


def test_gpt_losses_match_golden(corpus, tmp_path):
    data = {"tokenizer": SP_MODEL, "data": corpus["gpt"]}
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", tiny_overrides(data, tmp_path, **RUN))
    _compare("gpt_tiny", "a 2-layer GPT", _losses(tmp_path / "metrics.jsonl", ["lm_loss"]))


def test_bert_losses_match_golden(corpus, tmp_path):
    data = {"tokenizer": None, "data": corpus["bert"]}
    overrides = bert_overrides(data, tmp_path, **RUN)
    run_pretrain("pretrain_bert.py", "configs/bert_tiny.yaml", overrides)
    rows = _losses(tmp_path / "metrics.jsonl", ["lm_loss", "sop_loss"])
    _compare("bert_tiny", "a 2-layer BERT (masked LM + sentence order)", rows)


def test_moe_losses_match_golden(corpus, tmp_path):
    """configs/moe_tiny.yaml shrunk: 4 layers (the first dense), 8 experts of width 32, top-2,
    a shared expert of 64, auxiliary and z losses."""
    from tests.test_moe_training import SHAPE

    data = {"tokenizer": SP_MODEL, "data": corpus["gpt"]}
    overrides = tiny_overrides(data, tmp_path, **{**SHAPE, **RUN})
    run_pretrain("pretrain_gpt.py", "configs/moe_tiny.yaml", overrides)
    rows = _losses(tmp_path / "metrics.jsonl", ["lm_loss", "moe_aux_loss", "moe_z_loss"])
    _compare("moe_tiny", "a 4-layer mixture of experts (LM, auxiliary and z losses)", rows)
