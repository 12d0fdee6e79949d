"""pretrain_bert.py end to end (torchrun, TP=2 x DP=2) and its data providers.

The corpus is generated so that both tasks are learnable within a few dozen steps: every document
is a short sentence of one made-up vocabulary followed by a long one of another. Sentence order
is then visible in how many tokens carry token type 1, so a falling sentence-order loss shows
that the labels, the pooler and the binary head are wired right (on real text SOP stays at
chance for the first hundreds of steps, which would prove nothing).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import pretrain_bert
from megatron.config.checks import check_all
from megatron.config.load import load_config
from megatron.data.hdf5_dataset import write_shard
from megatron.errors import ConfigError
from tests.gpt_run import _tool, read_metrics, run_pretrain, tiny_overrides

VOCAB_FILE = "tests/fixtures/tokenizers/bert-vocab.txt"


def write_corpus(path: Path, num_docs: int = 800, seed: int = 0) -> None:
    """JSONL documents: a sentence of 2-4 words, then one of 10-14 words from other syllables."""
    rng = random.Random(seed)
    first, second = "ka ri to mo na shi lu ve".split(), "en ar ex po qui th str ing".split()

    def sentence(syllables: list[str], lo: int, hi: int) -> str:
        words = (
            "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
            for _ in range(rng.randint(lo, hi))
        )
        return " ".join(words).capitalize() + "."

    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_docs):
            text = f"{sentence(first, 2, 4)} {sentence(second, 10, 14)}"
            f.write(json.dumps({"text": text}) + "\n")


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory) -> dict[str, str]:
    """The generated corpus, split into sentences and tokenized with the fixture WordPiece vocab."""
    out = tmp_path_factory.mktemp("bert_data")
    write_corpus(out / "corpus.jsonl")
    _tool(
        "tools/preprocess_data.py",
        "--input", str(out / "corpus.jsonl"),
        "--output-prefix", str(out / "bert"),
        "--tokenizer-type", "BertWordPieceCase",
        "--vocab-file", VOCAB_FILE,
        "--split-sentences",
        "--workers", "1",
    )  # fmt: skip
    return {"tokenizer": None, "data": str(out / "bert_text_sentence")}


def bert_overrides(data: dict[str, str], run_dir: Path, **extra: object) -> list[str]:
    """gpt_run's tiny model, fp32 and without dropout, on the BERT corpus and vocabulary."""
    keys = {
        "tokenizer.vocab_file": VOCAB_FILE,
        "model.seq_length": 64,
        "model.max_position_embeddings": 64,
        "data.split": "80,10,10",
        "training.micro_batch_size": 4,
        "training.global_batch_size": 16,
        "training.train_iters": 30,
        "training.eval_interval": 30,
        "training.eval_iters": 1,
        "optimizer.lr": 2e-3,
        "optimizer.lr_warmup_iters": 3,
        **extra,
    }
    return tiny_overrides(data, run_dir, **keys)


@pytest.mark.slow
def test_tp2_dp2_trains_both_heads_and_resumes_at_tp1(bert_data, tmp_path):
    run_dir, ckpt = tmp_path / "tp2dp2", tmp_path / "ckpt"
    overrides = bert_overrides(
        bert_data, run_dir, **{"parallel.tensor_parallel_size": 2, "checkpoint.save": ckpt}
    )
    run_pretrain("pretrain_bert.py", "configs/bert_tiny.yaml", overrides, nproc=4)
    run = read_metrics(run_dir / "metrics.jsonl")
    assert [e["iteration"] for e in run] == list(range(1, 31))
    first = {k: np.mean([e[k] for e in run[:5]]) for k in ("lm_loss", "sop_loss")}
    last = {k: np.mean([e[k] for e in run[-5:]]) for k in ("lm_loss", "sop_loss")}
    assert last["lm_loss"] < first["lm_loss"] - 1.0, (first, last)
    assert first["sop_loss"] > 0.6 and last["sop_loss"] < 0.3, (first, last)  # chance is ln 2
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    valid = [e for e in lines if "lm_loss_validation" in e]
    assert len(valid) == 1 and valid[0]["sop_loss_validation"] < 0.6

    # The checkpoint reshards to TP=1, where the vocabulary is padded to 1408 rows, not 1536:
    # the word table and the LM head's output bias both lose and regain their padding.
    resumed_dir = tmp_path / "tp1"
    overrides = bert_overrides(
        bert_data,
        resumed_dir,
        **{
            "parallel.tensor_parallel_size": 1,
            "checkpoint.save": ckpt,
            "training.train_iters": 32,
            "training.eval_iters": 0,
        },
    )
    run_pretrain("pretrain_bert.py", "configs/bert_tiny.yaml", overrides, nproc=1)
    resumed = read_metrics(resumed_dir / "metrics.jsonl")
    assert [e["iteration"] for e in resumed] == [31, 32]
    assert resumed[0]["lm_loss"] < first["lm_loss"] - 1.0 and resumed[0]["sop_loss"] < 0.3


def _config(data: dict[str, str], tmp_path: Path, *extra: str):
    return load_config(
        ["configs/bert_tiny.yaml"], [*bert_overrides(data, tmp_path / "run"), *extra]
    )


def test_indexed_batches_carry_what_forward_step_reads(bert_data, tmp_path):
    from megatron.data.tokenizers.factory import build_tokenizer

    cfg = _config(bert_data, tmp_path)
    tokenizer = build_tokenizer("wordpiece", vocab_file=VOCAB_FILE)
    train, valid, test = pretrain_bert.datasets_provider(cfg, tokenizer, (64, 16, 0))
    assert len(train) >= 64 and len(valid) >= 16 and test is None
    sample = train[0]
    assert {"text", "types", "padding_mask", "labels", "loss_mask", "is_random"} <= sample.keys()
    with pytest.raises(ConfigError, match="needs a WordPiece vocabulary"):
        sp = build_tokenizer("sentencepiece", model="tests/fixtures/tokenizers/sp-bpe.model")
        pretrain_bert.datasets_provider(cfg, sp, (64, 16, 0))


def test_hdf5_shards_split_by_rows(tmp_path):
    s = 16
    samples = [
        {
            "text": np.arange(s) + i, "types": np.zeros(s, np.int64), "padding_mask": np.ones(s),
            "loss_mask": np.eye(s)[2], "labels": np.full(s, 7), "is_random": i % 2,
        }
        for i in range(10)
    ]  # fmt: skip
    write_shard(str(tmp_path / "a.hdf5"), samples[:6], max_predictions=4)
    write_shard(str(tmp_path / "b.hdf5"), samples[6:], max_predictions=4)
    base = [
        "data.format=hdf5", f"data.paths=[{tmp_path}]", "data.split=8,2,0",
        "model.seq_length=16", "model.max_position_embeddings=16",
    ]  # fmt: skip
    cfg = load_config(["configs/bert_tiny.yaml"], base)
    train, valid, test = pretrain_bert.datasets_provider(cfg, None, (8, 2, 0))
    assert (len(train), len(valid), test) == (8, 2, None)
    assert torch.equal(torch.as_tensor(valid[1]["text"]), torch.as_tensor(samples[9]["text"]))
    with pytest.raises(ConfigError, match="valid split 2 samples but the run needs 4"):
        pretrain_bert.datasets_provider(cfg, None, (8, 4, 0))
    weighted = load_config(["configs/bert_tiny.yaml"], [*base, f"data.paths=[1.0, {tmp_path}]"])
    with pytest.raises(ConfigError, match="weights are not supported"):
        pretrain_bert.datasets_provider(weighted, None, (8, 2, 0))


def test_config_check_rejects_one_token_type(bert_data, tmp_path):
    cfg = _config(bert_data, tmp_path, "bert.num_tokentypes=1")
    with pytest.raises(ConfigError, match="bert.num_tokentypes=1: sentence pairs"):
        check_all(cfg, None)
