"""The loss-spike guard on the real entrypoint: a two-source blend whose first source has the
documents of one iteration's batch replaced by random tokens (same lengths, so the sample order is
unchanged) spikes the loss there. The run rolls back to the checkpoint before the spike and skips
the batches since; what it trains after equals, bit for bit, a run given that skip list from the
start and a restart from a later checkpoint; past training.max_rollbacks it exits 5."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from megatron.config import skip_list
from megatron.config.load import load_config
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, best_dtype
from megatron.data.provenance import provenance, step_samples
from megatron.data.splits import samples_per_split
from megatron.data.tokenizers.factory import build_tokenizer
from pretrain_gpt import datasets_provider
from tests.gpt_run import ROOT, _tool, read_metrics, run_pretrain, tiny_overrides
from tests.test_pretrain_bert import write_corpus

pytestmark = pytest.mark.slow

POISONED, SAVE_INTERVAL, ITERS = 14, 5, 22
GUARD = {"training.spike_threshold": 1.1, "training.spike_window": 5,
         "checkpoint.save_interval": SAVE_INTERVAL, "training.train_iters": ITERS,
         "training.eval_iters": 1, "training.eval_interval": 10, "optimizer.lr": 3e-3,
         "parallel.tensor_parallel_size": 1, "checkpoint.keep_last": None}  # fmt: skip


def _poison(clean: str, out: str, documents: set[int], vocab: int) -> None:
    """``clean``'s documents, those in ``documents`` made of repeated random ids the corpus never
    holds (their end-of-document token kept), at the same lengths."""
    source = IndexedDataset(clean)
    every = np.concatenate([source[d] for d in range(source.num_documents)])
    seen = np.bincount(every, None, vocab)
    unseen = np.flatnonzero(seen == 0)
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(out, best_dtype(vocab)) as writer:
        for d in range(source.num_documents):
            tokens = source[d].copy()
            if d in documents:
                tokens[:-1] = np.resize(rng.choice(unseen, 4), len(tokens) - 1)
            writer.add_document([tokens])


@pytest.fixture(scope="module")
def blend(gpt_data, tmp_path_factory) -> dict:
    """Overrides of the guarded run over [0.5, poisoned, 0.5, other], and where each lives."""
    out = tmp_path_factory.mktemp("spike")
    write_corpus(out / "other.jsonl", num_docs=400, seed=5)
    _tool("tools/preprocess_data.py", "--input", str(out / "other.jsonl"),
          "--output-prefix", str(out / "other"), "--tokenizer-type", "sentencepiece",
          "--tokenizer-model", gpt_data["tokenizer"], "--append-eod")  # fmt: skip
    other = str(out / "other_text_document")

    def overrides(first: str, run: Path, **extra) -> list[str]:
        keys = {**GUARD, "data.paths": f"[0.8, {first}, 0.2, {other}]",
                "checkpoint.save": run / "ckpt", **extra}  # fmt: skip
        return tiny_overrides(gpt_data, run, **keys)

    # The documents the poisoned iteration reads from the first source, found on the clean one.
    cfg = load_config(["configs/gpt_tiny.yaml"], overrides(gpt_data["data"], out / "probe"))
    tokenizer = build_tokenizer(**asdict(cfg.tokenizer))
    extra = skip_list.headroom(cfg)
    train, _, _ = datasets_provider(cfg, tokenizer, samples_per_split(cfg.training, extra))
    docs = set()
    for idx in step_samples(POISONED, cfg.training.global_batch_size):
        where = provenance(train, idx)
        if where.source == gpt_data["data"]:
            docs |= set(where.documents)
    poisoned = str(out / "poisoned")
    _poison(gpt_data["data"], poisoned, docs, tokenizer.vocab_size)
    gbs = cfg.training.global_batch_size
    # Each iteration's samples of the first source (of a run that has not skipped).
    firsts = [int((train.dataset_index[step_samples(i, gbs)] == 0).sum()) for i in range(1, 11)]
    return {"overrides": overrides, "poisoned": poisoned, "out": out, "firsts": firsts}


def _run(blend: dict, name: str, check: bool = True, nproc: int = 1, **extra):
    run = blend["out"] / name
    args = blend["overrides"](blend["poisoned"], run, **extra)
    proc = run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", args, nproc, check=check)
    return proc, run


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    """The last logged loss of each iteration (a rollback logs some iterations twice)."""
    return {e["iteration"]: e["lm_loss"] for e in read_metrics(run / "metrics.jsonl")}


def _which(args: list[str]) -> list[dict]:
    argv = [sys.executable, "tools/which_samples.py", "--json", *args]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_spike_rolls_back_and_skips_like_a_run_given_the_skip_list(blend):
    proc, guarded = _run(blend, "guarded")
    rollbacks = [e for e in _records(guarded) if "rolled_back_to" in e]
    assert len(rollbacks) == 1, proc.stdout[-3000:]
    back = rollbacks[0]
    assert back["iteration"] == POISONED
    assert back["rolled_back_to"] == 10  # the newest checkpoint before the spike
    assert back["skip_batches"] == [[11, POISONED]]
    line = f"loss spike at iteration {POISONED}"
    assert line in proc.stderr + proc.stdout
    losses = _losses(guarded)
    assert sorted(losses) == list(range(1, ITERS + 1))

    # The loss of each source, weighted by its tokens (whole samples: no loss mask), adds up to
    # the step's; the spiked step's was the poisoned source's.
    lines = {e["iteration"]: e for e in read_metrics(guarded / "metrics.jsonl")}
    first, second = "lm_loss_by_source/poisoned", "lm_loss_by_source/other_text_document"
    for i, n in enumerate(blend["firsts"], 1):
        parts = [(n, lines[i].get(first, 0.0)), (8 - n, lines[i].get(second, 0.0))]
        assert sum(k * loss for k, loss in parts) / 8 == pytest.approx(losses[i], abs=1e-6)
    assert back[first] > 1.1 * lines[10][first]  # against the checkpoint's iteration
    assert back[second] < 1.05 * lines[10][second]
    evaluations = [e for e in _records(guarded) if "lm_loss_validation" in e]
    assert evaluations and all(f"{first}_validation" in e for e in evaluations)
    assert all(f"{second}_validation" in e for e in evaluations)

    _, given = _run(blend, "given", **{"data.skip_batches": "[[11, 14]]"})
    reference = _losses(given)
    assert [e for e in _records(given) if "rolled_back_to" in e] == []
    assert {i: losses[i] for i in range(1, ITERS + 1)} == reference

    # which_samples.py passes over the skip list as the run did: iteration 11 trained batch 15.
    after = _which(["--load", str(guarded / "ckpt"), "--iteration", "11"])
    unskipped = _which(["--config", "configs/gpt_tiny.yaml", "--iteration", "15",
                        *blend["overrides"](blend["poisoned"], guarded)])  # fmt: skip
    assert len(after) == 8
    assert [{**row, "iteration": 15} for row in after] == unskipped

    # A restart from a checkpoint after the rollback continues the same stream.
    restart = blend["out"] / "restart"
    shutil.copytree(guarded / "ckpt" / "iter_0000015", restart / "ckpt" / "iter_0000015")
    (restart / "ckpt" / "latest").write_text("15\n")
    _run(blend, "restart")
    resumed = _losses(restart)
    assert {i: resumed[i] for i in range(16, ITERS + 1)} == {
        i: losses[i] for i in range(16, ITERS + 1)
    }


def test_past_max_rollbacks_the_run_saves_and_exits_5(blend):
    proc, run = _run(blend, "limited", check=False, **{"training.max_rollbacks": 0})
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert "more than training.max_rollbacks=0 loss spikes" in proc.stderr + proc.stdout
    meta = json.loads((run / "ckpt" / "iter_0000010" / "meta.json").read_text())
    assert meta["progress"]["skip_batches"] == [[11, POISONED]]
    assert meta["progress"]["rollbacks"] == 1
    assert (run / "ckpt" / "latest").read_text().strip() == "10"


def test_every_rank_rolls_back_alike_at_tp2(blend):
    """At TP 2 each rank judges the same summed loss: one rollback, the same skip list, and the
    per-source losses counted once (not once per TP rank)."""
    _, run = _run(blend, "tp2", nproc=2, **{"parallel.tensor_parallel_size": 2})
    (back,) = [e for e in _records(run) if "rolled_back_to" in e]
    assert (back["iteration"], back["rolled_back_to"]) == (POISONED, 10)
    assert back["skip_batches"] == [[11, POISONED]]
    lines = {e["iteration"]: e for e in read_metrics(run / "metrics.jsonl")}
    first, second = "lm_loss_by_source/poisoned", "lm_loss_by_source/other_text_document"
    for i, n in enumerate(blend["firsts"], 1):
        parts = [(n, lines[i].get(first, 0.0)), (8 - n, lines[i].get(second, 0.0))]
        assert sum(k * loss for k, loss in parts) / 8 == pytest.approx(lines[i]["lm_loss"], 1e-6)
