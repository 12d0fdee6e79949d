"""GPT sample indices: equal to megatron-core's GPTDataset; masks; cache; errors; ranks."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sysconfig

import numpy as np
import pytest
import torch

from megatron.data import gpt_dataset
from megatron.data.gpt_dataset import build_gpt_datasets, build_gpt_indices, ltor_masks
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megatron.data.splits import parse_data_paths, split_ranges
from megatron.errors import ConfigError
from tests.distributed import run_distributed
from tests.test_indexed_dataset import run_megatron_core

EOD = 0


def make_corpus(prefix: str, n_docs: int, seed: int, max_len: int = 60) -> str:
    """Documents of 0..max_len random tokens, each ended by EOD (so some are just the EOD)."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(n_docs):
            w.add_document([np.append(rng.integers(1, 1000, rng.integers(0, max_len)), EOD)])
    return prefix


def megatron_helpers():
    """megatron-core's compiled index helper, loaded by path (our package is also `megatron`)."""
    found = glob.glob(
        os.path.join(sysconfig.get_paths()["purelib"], "megatron/core/datasets/helpers_cpp*.so")
    )
    if not found:
        pytest.skip("megatron-core's helpers_cpp (the test oracle) is not installed")
    spec = importlib.util.spec_from_file_location("helpers_cpp", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_sample_index_equals_megatron_helper(seq_length):
    helpers = megatron_helpers()
    rng = np.random.default_rng(seq_length)
    lengths = rng.integers(0, 50, 500).astype(np.int32)  # zero-length sequences included
    lengths[0] = 0
    out = build_gpt_indices(lengths, (0, len(lengths)), 3000, seq_length, seed=5)
    doc_index = out["document_index"]
    epochs = len(doc_index) // len(lengths)
    expected = helpers.build_sample_idx_int32(
        lengths, doc_index, seq_length, epochs, int(lengths.sum()), True, 1
    )
    np.testing.assert_array_equal(out["sample_index"], expected)


# Runs in a clean interpreter outside the repo, with a one-process gloo group because
# megatron-core's BlendedDataset asks torch.distributed for the rank when it caches.
_MCORE_GPT = """
import json, socket, sys, tempfile, types
import numpy as np, torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                     rank=0, world_size=1)
tokenizer = types.SimpleNamespace(eod=0, vocab_size=1000, pad=-1, unique_identifiers={})
def text(ds, i):
    sample = ds[i]
    return sample["tokens"].tolist() + [int(sample["labels"][-1])]
out = []
for case in json.loads(sys.argv[1]):
    config = GPTDatasetConfig(
        random_seed=case["seed"], sequence_length=case["seq_length"],
        blend=get_blend_from_list([str(p) for p in case["paths"]]), split=case["split"],
        path_to_cache=tempfile.mkdtemp(), tokenizer=tokenizer, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False)
    splits = BlendedMegatronDatasetBuilder(
        GPTDataset, case["num_samples"], lambda: True, config).build()
    result = []
    for ds, n in zip(splits, case["num_samples"]):
        if not n:
            result.append(None)
        elif hasattr(ds, "dataset_index"):
            result.append({
                "parts": [[text(part, k) for k in range(min(40, len(part)))]
                          for part in ds.datasets],
                "counts": np.bincount(ds.dataset_index[:n], minlength=len(ds.datasets)).tolist()})
        else:
            result.append({"samples": [text(ds, i) for i in range(n)], "len": len(ds)})
    out.append(result)
print(json.dumps(out))
"""


def _cases(a: str, b: str, c: str) -> list[dict]:
    """Single-dataset cases that cover one epoch, a final epoch shuffled with the others and a
    separate final epoch; and two blends."""
    lengths = IndexedDataset(a).sequence_lengths
    cases = []
    for seed, split, seq_length, epochs in [
        (1234, "900,80,20", 32, 1.0),
        (7, "80,15,5", 17, 2.1),  # final epoch 10% used: shuffled on its own
        (3, "1,1,1", 64, 2.9),  # final epoch 90% used: shuffled with the others
    ]:
        sizes = []
        for r in split_ranges(split, len(lengths)):
            per_epoch = (int(lengths[r[0] : r[1]].sum()) - 1) // seq_length
            sizes.append(max(1, int(epochs * per_epoch)))
        cases.append(dict(paths=[a], split=split, seed=seed, seq_length=seq_length))
        cases[-1]["num_samples"] = sizes
    cases.append(
        dict(
            paths=[0.7, a, 0.3, b],
            split="90,10,0",
            seed=11,
            seq_length=24,
            num_samples=[400, 30, 0],
        )
    )
    cases.append(
        dict(
            paths=[2, a, 1, b, 1, c],
            split="90,10,0",
            seed=12,
            seq_length=20,
            num_samples=[900, 50, 0],
        )
    )
    return cases


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str, str]:
    root = tmp_path_factory.mktemp("corpus")
    return (
        make_corpus(str(root / "a"), 300, 0),
        make_corpus(str(root / "b"), 120, 1),
        make_corpus(str(root / "c"), 400, 2, max_len=10),
    )


def test_same_samples_as_megatron_core(corpus, tmp_path):
    cases = _cases(*corpus)
    expected = json.loads(run_megatron_core(_MCORE_GPT, json.dumps(cases)).strip().splitlines()[-1])
    for case, want in zip(cases, expected, strict=True):
        ours = build_gpt_datasets(
            case["paths"],
            case["split"],
            tuple(case["num_samples"]),
            case["seq_length"],
            case["seed"],
            str(tmp_path),
            EOD,
        )
        for ds, n, ref in zip(ours, case["num_samples"], want, strict=True):
            if ref is None:
                assert ds is None
            elif "samples" in ref:
                assert len(ds) == ref["len"]
                assert [ds.tokens(i).tolist() for i in range(n)] == ref["samples"], case
            else:
                # each blended dataset's own sample stream is megatron-core's; the interleaving
                # differs (see blended_dataset.py) but the counts stay within one sample
                for part, part_ref in zip(ds.datasets, ref["parts"], strict=True):
                    assert [part.tokens(k).tolist() for k in range(len(part_ref))] == part_ref
                counts = np.bincount(ds.dataset_index[:n], minlength=len(ds.datasets))
                assert np.abs(counts - np.array(ref["counts"])).max() <= 1


def test_sample_fields(corpus, tmp_path):
    (train, _, _) = build_gpt_datasets([corpus[0]], "1,0,0", (20, 0, 0), 16, 1, None, EOD)
    sample = train[3]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    text = torch.from_numpy(train.tokens(3))
    assert torch.equal(sample["tokens"], text[:-1]) and torch.equal(sample["labels"], text[1:])
    assert sample["tokens"].dtype == torch.int64 and sample["loss_mask"].dtype == torch.float32
    assert torch.equal(sample["loss_mask"], torch.ones(16))
    assert torch.equal(sample["position_ids"], torch.arange(16))
    # consecutive samples of the stream overlap by one token: the next starts on the last label
    j = int(train.shuffle_index[3])
    nxt = int(np.flatnonzero(np.asarray(train.shuffle_index) == j + 1)[0])
    assert train.tokens(nxt)[0] == train.tokens(3)[-1]


def _megatron_masks(tokens: torch.Tensor, eod: int) -> tuple[torch.Tensor, ...]:
    """Megatron's loop semantics, written plainly: after each EOD at i, positions restart and
    tokens past i no longer see tokens up to i."""
    s = len(tokens)
    allowed = torch.tril(torch.ones(s, s))
    positions = torch.arange(s)
    loss = torch.ones(s)
    loss[tokens == eod] = 0.0
    prev = 0
    for i in torch.nonzero(tokens == eod).flatten().tolist():
        allowed[i + 1 :, : i + 1] = 0
        positions[i + 1 :] -= i + 1 - prev
        prev = i + 1
    return loss, positions, (allowed < 0.5)[None]


@pytest.mark.parametrize("tokens", [[5, 0, 3, 4, 0, 0, 7, 8], [0, 1, 2, 3], [1, 2, 3, 0], [1, 2]])
def test_reset_masks_match_megatron_semantics(tokens):
    tokens = torch.tensor(tokens)
    loss, positions, attention = _megatron_masks(tokens, 0)
    out = ltor_masks(tokens, 0, True, True, True)
    assert torch.equal(out["loss_mask"], loss)
    assert torch.equal(out["position_ids"], positions)
    # Megatron's dense mask, rebuilt from the document ids as the model does on the device.
    doc = out["document_ids"]  # [s]
    causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()  # [s_query, s_key]
    allowed = causal & (doc[:, None] == doc[None, :])
    assert doc.dtype == torch.int64 and torch.equal(~allowed[None], attention)
    plain = ltor_masks(tokens, 0, False, False, False)
    assert "document_ids" not in plain and torch.equal(
        plain["position_ids"], torch.arange(len(tokens))
    )


def test_cache_is_reused_and_memory_mapped(corpus, tmp_path, monkeypatch):
    calls = []
    real = gpt_dataset.build_gpt_indices
    monkeypatch.setattr(
        gpt_dataset, "build_gpt_indices", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    args = ([corpus[0]], "90,10,0", (50, 5, 0), 16, 3, str(tmp_path), EOD)
    first = build_gpt_datasets(*args)
    assert len(calls) == 2
    names = sorted(os.listdir(tmp_path))
    assert not any(".tmp" in n for n in names) and len(names) == 8  # 3 arrays + json, 2 splits
    second = build_gpt_datasets(*args)
    assert len(calls) == 2 and sorted(os.listdir(tmp_path)) == names
    assert isinstance(second[0].shuffle_index, np.memmap)
    assert [second[0].tokens(i).tolist() for i in range(50)] == [
        first[0].tokens(i).tolist() for i in range(50)
    ]
    build_gpt_datasets([corpus[0]], "90,10,0", (50, 5, 0), 16, 4, str(tmp_path), EOD)
    assert len(calls) == 4  # another seed is another key


def test_split_ranges_follow_megatron_rounding():
    assert split_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges("98,2", 10) == [(0, 10), (10, 10), None]
    assert split_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]
    with pytest.raises(ConfigError, match="data.split"):
        split_ranges("0,0,0", 10)


def test_empty_split_is_an_error(corpus):
    with pytest.raises(ConfigError, match=r'data.split="949,50,1" leaves the test split of .*a'):
        build_gpt_datasets([corpus[0]], "949,50,1", (10, 5, 5), 16, 1, None, EOD)
    with pytest.raises(ConfigError, match="valid split"):
        build_gpt_datasets([corpus[0]], "100,0,0", (10, 5, 0), 16, 1, None, EOD)


def test_unweighted_blend_needs_enough_data(corpus):
    with pytest.raises(ConfigError, match="give weights"):
        build_gpt_datasets([corpus[0], corpus[1]], "1,0,0", (10**6, 0, 0), 16, 1, None, EOD)


def test_parse_data_paths():
    assert parse_data_paths(["a", "b"]) == (["a", "b"], None)
    assert parse_data_paths([0.7, "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
    assert parse_data_paths(["a"]) == (["a"], None)
    with pytest.raises(ConfigError, match="positive"):
        parse_data_paths([0, "a", 1, "b"])


def _build_on_ranks(prefix: str, cache_dir: str) -> list[list[int]]:
    train, _, _ = build_gpt_datasets([prefix], "1,0,0", (40, 0, 0), 16, 9, cache_dir, EOD)
    return [train.tokens(i).tolist() for i in range(40)]


@pytest.mark.slow
def test_one_builder_and_all_ranks_agree(corpus, tmp_path):
    results = run_distributed(_build_on_ranks, 2, corpus[0], str(tmp_path))
    assert results[0] == results[1]
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".json")]) == 1
