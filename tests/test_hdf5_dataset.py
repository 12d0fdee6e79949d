"""HDF5 shards: tools/bert_to_hdf5.py then Hdf5BertDataset gives the source's samples and batches;
NVIDIA's layout reads; bad shards and failed writes leave clear errors and no final-named file."""

from __future__ import annotations

import glob
import importlib.util
import os

import h5py
import numpy as np
import pytest
import torch

from megatron.data.bert_dataset import BertDataset
from megatron.data.hdf5_dataset import FIELDS, Hdf5BertDataset, shard_files, write_shard
from megatron.data.indexed_dataset import IndexedDataset
from megatron.errors import ConfigError
from tests.test_bert_dataset import (  # noqa: F401  (corpus is a fixture)
    SEQ_LENGTH,
    assert_same_sample,
    corpus,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location(
        "bert_to_hdf5", os.path.join(ROOT, "tools", "bert_to_hdf5.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shards_give_the_same_batches(corpus, tmp_path):  # noqa: F811
    prefix, vocab_file, _, vocab = corpus
    out = str(tmp_path / "shards" / "train")
    argv = [
        "--data-path", prefix, "--vocab-file", vocab_file, "--output-prefix", out,
        "--seq-length", str(SEQ_LENGTH), "--num-samples", "700", "--split", "90,10,0",
        "--samples-per-shard", "256", "--seed", "7",
    ]  # fmt: skip
    assert _tool().main(argv) == 0
    files = shard_files(str(tmp_path / "shards"))
    assert [os.path.basename(f) for f in files] == [f"train_0000{k}.hdf5" for k in range(3)]
    assert not glob.glob(str(tmp_path / "shards" / "*.tmp*"))
    assert _tool().main(argv) == 2, "a second run must not mix its shards with the first's"

    indexed = IndexedDataset(prefix)
    source = BertDataset(
        indexed, (0, round(0.9 * indexed.num_documents)), 700, SEQ_LENGTH, 7, None, vocab
    )
    shards = Hdf5BertDataset(files, seq_length=SEQ_LENGTH)
    assert len(shards) == len(source) == 700
    for i in range(len(source)):
        assert_same_sample(shards[i], source[i])
    # through a DataLoader (two workers open their own HDF5 handles) the batches are equal
    ours = torch.utils.data.DataLoader(source, batch_size=32)
    theirs = torch.utils.data.DataLoader(shards, batch_size=32, num_workers=2)
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_reads_nvidia_layout(tmp_path):
    """A shard as NVIDIA's create_pretraining_data writes it: int32/int8, 0-padded positions."""
    path = str(tmp_path / "nvidia.hdf5")
    ids = np.array([[101, 7, 103, 9, 102, 11, 103, 102, 0, 0]], dtype=np.int32)
    with h5py.File(path, "w") as f:
        f.create_dataset("input_ids", data=ids, dtype="i4", compression="gzip")
        f.create_dataset("input_mask", data=(ids > 0).astype(np.int8), dtype="i1")
        f.create_dataset("segment_ids", data=[[0, 0, 0, 0, 0, 1, 1, 1, 0, 0]], dtype="i1")
        f.create_dataset("masked_lm_positions", data=[[2, 6, 0, 0]], dtype="i4")
        f.create_dataset("masked_lm_ids", data=[[8, 12, 0, 0]], dtype="i4")
        f.create_dataset("next_sentence_labels", data=[1], dtype="i1")
    x = Hdf5BertDataset([path])[0]
    np.testing.assert_array_equal(x["text"], ids[0])
    np.testing.assert_array_equal(x["labels"], [-1, -1, 8, -1, -1, -1, 12, -1, -1, -1])
    np.testing.assert_array_equal(x["loss_mask"], [0, 0, 1, 0, 0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(x["padding_mask"], [1] * 8 + [0, 0])
    np.testing.assert_array_equal(x["types"], [0] * 5 + [1] * 3 + [0, 0])
    assert x["is_random"] == 1 and x["is_random"].dtype == np.int64
    with pytest.raises(ConfigError, match="model.seq_length=16"):
        Hdf5BertDataset([path], seq_length=16)


def test_bad_shards_and_failed_writes(corpus, tmp_path):  # noqa: F811
    path = str(tmp_path / "partial.hdf5")
    with h5py.File(path, "w") as f:
        for name in list(FIELDS)[:4]:
            f.create_dataset(name, data=np.zeros((2, 8), np.int32))
    with pytest.raises(ConfigError, match="no dataset masked_lm_ids, next_sentence_labels"):
        Hdf5BertDataset([path])
    with pytest.raises(ConfigError, match="no HDF5 shard"):
        shard_files(str(tmp_path / "nothing_*.hdf5"))

    prefix, _, _, vocab = corpus
    indexed = IndexedDataset(prefix)
    source = BertDataset(indexed, (0, indexed.num_documents), 20, SEQ_LENGTH, 1, None, vocab)
    target = str(tmp_path / "too_narrow.hdf5")
    with pytest.raises(ConfigError, match="max-predictions-per-seq=1"):
        write_shard(target, [source[i] for i in range(20)], max_predictions=1)
    assert os.listdir(tmp_path) == ["partial.hdf5"]
