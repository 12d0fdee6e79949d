"""tools/which_samples.py against the loader the run trains from: for three iterations, at DP 1
and DP 2, the documents it names for each sample of a two-source blend, read directly from the
indexed datasets at the offset it names, are the tokens that DP rank's micro-batches hold."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest

from megatron.config.load import load_config
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.loader import build_loader
from megatron.data.splits import samples_per_split
from megatron.data.tokenizers.factory import build_tokenizer
from pretrain_gpt import datasets_provider
from tests.gpt_run import ROOT, _tool, tiny_overrides
from tests.test_pretrain_bert import write_corpus

GBS, MBS = 8, 2


@pytest.fixture(scope="module")
def blend(gpt_data, tmp_path_factory) -> list[str]:
    """The tiny GPT's overrides over a blend of the shared corpus (0.6) and a second one
    tokenized by the same tokenizer (0.4)."""
    out = tmp_path_factory.mktemp("second_source")
    write_corpus(out / "other.jsonl", num_docs=300, seed=3)
    _tool("tools/preprocess_data.py", "--input", str(out / "other.jsonl"),
          "--output-prefix", str(out / "other"), "--tokenizer-type", "sentencepiece",
          "--tokenizer-model", gpt_data["tokenizer"], "--append-eod")  # fmt: skip
    paths = f"[0.6, {gpt_data['data']}, 0.4, {out / 'other_text_document'}]"
    keys = {"data.paths": paths, "training.global_batch_size": GBS,
            "training.micro_batch_size": MBS, "training.train_iters": 3}  # fmt: skip
    return tiny_overrides(gpt_data, out / "run", **keys)


def _direct(row: dict, length: int) -> np.ndarray:
    """The sample's tokens read straight from its source: its documents from its offset."""
    indexed = IndexedDataset(row["source"])
    first, *rest = row["documents"]
    parts = [indexed.get(first, row["offset"]), *(indexed.get(d) for d in rest)]
    return np.concatenate(parts)[:length]


def test_named_documents_are_what_each_dp_rank_trains_on(blend):
    cfg = load_config(["configs/gpt_tiny.yaml"], blend)
    tokenizer = build_tokenizer(**asdict(cfg.tokenizer))
    train, _, _ = datasets_provider(cfg, tokenizer, samples_per_split(cfg.training))
    sources = set()
    for iteration in (1, 2, 3):
        argv = ["tools/which_samples.py", "--config", "configs/gpt_tiny.yaml",
                "--iteration", str(iteration), "--json", *blend]  # fmt: skip
        out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        assert [r["sample"] for r in rows] == list(range(GBS))
        assert all(r["text"] for r in rows)
        sources |= {r["source"] for r in rows}
        named = [_direct(r, cfg.model.seq_length) for r in rows]
        for dp in (1, 2):
            per_rank = GBS // dp
            for rank in range(dp):
                loader = build_loader(train, (iteration - 1) * GBS, MBS, GBS, rank, dp)
                trained = [b["tokens"] for _, b in zip(range(per_rank // MBS), loader)]
                mine = named[rank * per_rank : (rank + 1) * per_rank]
                assert np.array_equal(np.concatenate([t.numpy() for t in trained]), mine)
    assert len(sources) == 2  # both sources appear in the three steps


def test_bad_iteration_is_one_line(blend):
    argv = ["tools/which_samples.py", "--config", "configs/gpt_tiny.yaml", "--iteration", "4",
            *blend]  # fmt: skip
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr == "error: --iteration 4: the run has iterations 1 to 3\n"
