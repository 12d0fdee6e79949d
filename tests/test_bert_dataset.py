"""BERT samples: the sample mapping against megatron-core, sentence order, masking statistics,
determinism across builds and DP sizes, and the mapping cache.

The corpus is generated here: made-up words from a few syllables, so a small WordPiece vocabulary
(trained with HF ``tokenizers``) splits many of them into ``##`` continuation pieces.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import sysconfig

import numpy as np
import pytest

from megatron.data import bert_mapping
from megatron.data.bert_dataset import BertDataset, BertVocab, build_bert_datasets, truncate_pair
from megatron.data.bert_mapping import LONG_SENTENCE_TOKENS, build_sample_mapping
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megatron.data.tokenizers.factory import build_tokenizer
from megatron.errors import ConfigError
from tests.distributed import run_distributed

SYLLABLES = "ka to ri mu sel van dor pi lu ne qua zim fo ber tas gri mon el sa ut".split()
SEQ_LENGTH = 64


def make_corpus(seed: int = 0, num_docs: int = 300) -> list[list[str]]:
    """Documents of sentences of made-up words (Zipf-like word frequencies); some one-sentence."""
    rng = np.random.RandomState(seed)
    words = ["".join(rng.choice(SYLLABLES, rng.randint(1, 5))) for _ in range(800)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    docs = []
    for _ in range(num_docs):
        doc = []
        for _ in range(rng.randint(1, 10)):
            sentence = " ".join(rng.choice(words, rng.randint(3, 15), p=weights))
            doc.append(sentence.capitalize() + rng.choice([".", "!", "?"]))
        docs.append(doc)
    return docs


def write_vocab(docs: list[list[str]], path: str, vocab_size: int = 300) -> None:
    """Train a lower-cased BERT WordPiece vocabulary on ``docs`` and write it as vocab.txt."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    )
    tok.train_from_iterator((s for doc in docs for s in doc), trainer)
    vocab = tok.get_vocab()
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{token}\n" for token in sorted(vocab, key=vocab.get))


def write_sentence_data(docs: list[list[str]], tokenizer, prefix: str) -> None:
    """One sequence per sentence, one document per doc (what --split-sentences writes)."""
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in docs:
            writer.add_document([tokenizer.encode(s) for s in doc])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(prefix, vocab_file, tokenizer, vocab) of the generated sentence-split corpus."""
    root = tmp_path_factory.mktemp("bert_corpus")
    docs = make_corpus()
    vocab_file = str(root / "vocab.txt")
    write_vocab(docs, vocab_file)
    tokenizer = build_tokenizer("wordpiece", vocab_file=vocab_file, lower_case=True)
    prefix = str(root / "corpus_text_sentence")
    write_sentence_data(docs, tokenizer, prefix)
    return prefix, vocab_file, tokenizer, BertVocab.from_tokenizer(tokenizer)


def make_dataset(corpus, num_samples=3000, cache_dir=None, **kwargs) -> BertDataset:
    prefix, _, _, vocab = corpus
    indexed = IndexedDataset(prefix)
    return BertDataset(
        indexed,
        (0, indexed.num_documents),
        num_samples,
        SEQ_LENGTH,
        1234,
        cache_dir,
        vocab,
        **kwargs,
    )


def assert_same_sample(x: dict, y: dict) -> None:
    assert x.keys() == y.keys()
    for key in x:
        assert x[key].dtype == y[key].dtype, key
        np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def _megatron_core_helpers():
    """megatron-core's compiled helper, loaded by path: our package is also named ``megatron``."""
    pattern = os.path.join(
        sysconfig.get_paths()["purelib"], "megatron", "core", "datasets", "helpers_cpp*.so"
    )
    (path,) = glob.glob(pattern)
    spec = importlib.util.spec_from_file_location("helpers_cpp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _random_documents(seed: int, num_docs: int = 2000):
    rng = np.random.default_rng(seed)
    docs = np.concatenate([[0], np.cumsum(rng.integers(0, 25, num_docs))]).astype(np.int64)
    sizes = rng.integers(0, 70, docs[-1]).astype(np.int32)
    sizes[rng.integers(0, len(sizes), 15)] = LONG_SENTENCE_TOKENS + 1
    return docs, sizes


@pytest.mark.parametrize("max_length, min_sentences", [(30, 2), (125, 2), (509, 2), (125, 1)])
def test_mapping_equals_megatron_core(max_length, min_sentences):
    """Without short samples the targets are fixed, so one epoch must hold exactly megatron-core's
    rows (its order comes from its own C++ generator, ours from our shuffle)."""
    docs, sizes = _random_documents(max_length)
    ours = build_sample_mapping(docs[100:], sizes, None, max_length, 0.0, 7, min_sentences)
    theirs = _megatron_core_helpers().build_mapping(
        docs[100:], sizes, 1, 2**62, max_length, 0.0, 7, False, min_sentences
    )
    assert len(ours) == len(theirs) > 1000
    assert sorted(map(tuple, ours.tolist())) == sorted(map(tuple, theirs.astype(np.int64).tolist()))


def _reference_rows(docs, sizes, epoch, max_length, short_prob, seed):
    """Megatron's sentence loop, one sentence at a time, with our per-sample target lengths."""
    rows = []
    for d in range(len(docs) - 1):
        first, stop = int(docs[d]), int(docs[d + 1])
        if stop - first < 2 or (sizes[first:stop] > LONG_SENTENCE_TOKENS).any():
            continue
        start, tokens = first, 0

        def target(s):
            key = bert_mapping._epoch_keys(seed, np.array([epoch]))
            return int(bert_mapping._targets(key, np.array([s]), max_length, short_prob)[0])

        goal = target(start)
        for s in range(first, stop):
            tokens += int(sizes[s])
            remaining = stop - s - 1
            if (tokens >= goal and remaining > 1 and s - start + 1 >= 2) or remaining == 0:
                rows.append((start, s + 1, goal))
                start, tokens = s + 1, 0
                if remaining:
                    goal = target(start)
    return rows


def test_mapping_with_short_samples_matches_the_sentence_loop(monkeypatch):
    docs, sizes = _random_documents(1, num_docs=300)
    per_epoch = [_reference_rows(docs, sizes, e, 60, 0.3, 5) for e in range(3)]
    num_samples = len(per_epoch[0]) + len(per_epoch[1]) + len(per_epoch[2]) // 2
    mapping = build_sample_mapping(docs, sizes, num_samples, 60, 0.3, 5)
    assert len(mapping) == num_samples
    begin = 0
    for epoch, rows in enumerate(per_epoch):
        block = mapping[begin : begin + len(rows)].tolist()
        begin += len(block)
        if epoch < 2:
            assert sorted(map(tuple, block)) == sorted(rows)  # a whole epoch, shuffled
        else:
            assert set(map(tuple, block)) < set(rows)  # part of the last epoch
    targets = np.array([r[2] for rows in per_epoch for r in rows])
    assert 0.25 < np.mean(targets < 60) < 0.35 and targets.min() >= 2
    # batching the epochs differently (a tiny frontier) gives the same mapping
    monkeypatch.setattr(bert_mapping, "_FRONTIER_CAP", 1)
    np.testing.assert_array_equal(
        build_sample_mapping(docs, sizes, num_samples, 60, 0.3, 5), mapping
    )


def test_truncation_counts_match_one_token_at_a_time():
    rng = np.random.default_rng(0)
    for len_a in range(12):
        for len_b in range(12):
            for target in range(2, 26):
                a, b = np.arange(len_a), np.arange(100, 100 + len_b)
                la, lb = len_a, len_b
                while la + lb > target:  # the longer loses a token, B on ties
                    if la > lb:
                        la -= 1
                    else:
                        lb -= 1
                ta, tb = truncate_pair(a, b, target, rng)
                assert (len(ta), len(tb)) == (la, lb)
                # what is left is one contiguous piece of each segment
                assert np.all(np.diff(ta) == 1) and np.all(np.diff(tb) == 1)


def test_sample_layout_and_segments(corpus):
    ds = make_dataset(corpus, num_samples=600)
    v = ds.vocab
    for i in range(len(ds)):
        x = ds[i]
        assert {k: x[k].dtype for k in x} == {
            "text": np.int64,
            "types": np.int64,
            "labels": np.int64,
            "loss_mask": np.float32,
            "padding_mask": np.int64,
            "is_random": np.int64,
            "masked_positions": np.int64,
        }
        positions = np.flatnonzero(x["loss_mask"])  # the masked ones, then 0 (the [CLS])
        assert len(x["masked_positions"]) == ds.max_predictions >= len(positions)
        np.testing.assert_array_equal(x["masked_positions"][: len(positions)], positions)
        assert not x["masked_positions"][len(positions) :].any()
        n = int(x["padding_mask"].sum())
        assert np.all(x["padding_mask"][:n] == 1) and np.all(x["padding_mask"][n:] == 0)
        original = np.where(x["labels"] >= 0, x["labels"], x["text"])
        seps = np.flatnonzero(original[:n] == v.sep)
        assert original[0] == v.cls and len(seps) == 2 and seps[1] == n - 1
        assert np.all(x["types"][: seps[0] + 1] == 0) and np.all(x["types"][seps[0] + 1 : n] == 1)
        assert np.all(x["types"][n:] == 0) and np.all(x["text"][n:] == v.pad)
        np.testing.assert_array_equal(x["loss_mask"] == 1, x["labels"] >= 0)

        first, end, target = (int(t) for t in ds.mapping[i])
        assert n - 3 <= target <= SEQ_LENGTH - 3
        sentences = [ds.indexed[s].astype(np.int64) for s in range(first, end)]
        full = " " + " ".join(map(str, np.concatenate(sentences))) + " "
        a, b = original[1 : seps[0]], original[seps[0] + 1 : n - 1]
        where_a = full.find(" " + " ".join(map(str, a)) + " ") if len(a) else 0
        where_b = full.find(" " + " ".join(map(str, b)) + " ") if len(b) else len(full)
        assert where_a >= 0 and where_b >= 0, "A and B are contiguous pieces of the sentences"
        if len(a) and len(b):  # in order unless swapped
            assert (where_a > where_b) == bool(x["is_random"])


def test_without_binary_head(corpus):
    """[CLS] A [SEP] from all the sentences of the row, nothing swapped, one-sentence documents
    used too."""
    ds = make_dataset(corpus, num_samples=300, binary_head=False)
    assert (ds.mapping[:, 1] - ds.mapping[:, 0] == 1).any()
    for i in range(len(ds)):
        x = ds[i]
        n = int(x["padding_mask"].sum())
        original = np.where(x["labels"] >= 0, x["labels"], x["text"])
        assert original[0] == ds.vocab.cls and original[n - 1] == ds.vocab.sep
        assert (original[:n] == ds.vocab.sep).sum() == 1
        assert x["is_random"] == 0 and not x["types"].any()


def test_masking_statistics(corpus):
    """Over 3000 samples: 15% of the maskable tokens, 80/10/10, ~half swapped."""
    ds = make_dataset(corpus, num_samples=3000)
    v = ds.vocab
    special = [v.cls, v.sep, v.mask, v.pad]
    maskable = masked = as_mask = kept = swapped = 0
    is_random = []
    for i in range(len(ds)):
        x = ds[i]
        original = np.where(x["labels"] >= 0, x["labels"], x["text"])
        real = original[x["padding_mask"] == 1]
        maskable += int((~np.isin(real, special)).sum())
        where = x["labels"] >= 0
        masked += int(where.sum())
        as_mask += int((x["text"][where] == v.mask).sum())
        kept += int((x["text"][where] == x["labels"][where]).sum())
        is_random.append(int(x["is_random"]))
        assert not np.isin(x["labels"][where], special).any(), "a special token was masked"
    swapped = masked - as_mask - kept
    assert abs(masked / maskable - 0.15) < 0.01
    assert abs(as_mask / masked - 0.8) < 0.02
    # a random replacement equals the original with probability 1/vocab: counted as kept
    assert abs(kept / masked - 0.1) < 0.02 and abs(swapped / masked - 0.1) < 0.02
    assert abs(np.mean(is_random) - 0.5) < 0.03


def test_whole_words_and_ngrams_are_masked(corpus):
    ds = make_dataset(corpus, num_samples=1000)
    cont = ds.vocab.is_continuation
    special = [ds.vocab.cls, ds.vocab.sep, ds.vocab.mask, ds.vocab.pad]
    spans = []
    for i in range(len(ds)):
        x = ds[i]
        original = np.where(x["labels"] >= 0, x["labels"], x["text"])
        where = x["labels"] >= 0
        is_cont = cont[original] & (x["padding_mask"] == 1)
        # a ## piece is masked exactly when the piece before it is, unless a truncation cut its
        # word and left it right after [CLS]/[SEP]: then it is a word of its own
        after_special = np.isin(original[:-1], special)
        inner = np.flatnonzero(is_cont[1:] & ~after_special) + 1
        np.testing.assert_array_equal(where[inner], where[inner - 1])
        # word starts inside each masked run: n-grams of several words occur
        edges = np.flatnonzero(np.diff(np.concatenate([[0], where.astype(int), [0]])))
        for lo, hi in zip(edges[::2], edges[1::2], strict=True):
            spans.append(int((~is_cont[lo:hi]).sum()))
    counts = np.bincount(spans)
    assert counts[1] > counts[2] > counts[3] > 0, counts


def test_deterministic_and_cached(corpus, tmp_path, caplog):
    cache = str(tmp_path / "cache")
    caplog.set_level(logging.INFO)
    first = make_dataset(corpus, num_samples=400, cache_dir=cache)
    (path,) = glob.glob(os.path.join(cache, "bert-*-mapping.npy"))
    mtime = os.stat(path).st_mtime_ns
    builds = sum("built bert" in r.getMessage() for r in caplog.records)
    second = make_dataset(corpus, num_samples=400, cache_dir=cache)
    assert os.stat(path).st_mtime_ns == mtime
    assert sum("built bert" in r.getMessage() for r in caplog.records) == builds == 1
    fresh = make_dataset(corpus, num_samples=400, cache_dir=None)
    np.testing.assert_array_equal(first.mapping, fresh.mapping)
    # a sample depends only on its index: any access order gives the same samples
    for i in reversed(range(len(first))):
        assert_same_sample(second[i], fresh[i])
        assert_same_sample(first[i], first[i])
    other_seed = BertDataset(
        first.indexed, (0, first.indexed.num_documents), 400, SEQ_LENGTH, 99, None, first.vocab
    )
    assert not np.array_equal(other_seed.mapping, first.mapping)


def _dp_samples(corpus, cache, indices):
    """One DP rank: build (LOCAL_RANK 0 writes the cache, the other waits), return its samples."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    ds = make_dataset(corpus, num_samples=200, cache_dir=cache)
    rank, world = dist.get_rank(), dist.get_world_size()
    # DP rank r takes a contiguous block of each global batch of 8
    mine = [i for i in indices if (i % 8) // (8 // world) == rank]
    return {i: ds[i] for i in mine}


@pytest.mark.slow
def test_samples_independent_of_dp_size(corpus, tmp_path):
    """Two DP ranks (one builds the shared cache, one waits at the barrier) see exactly the
    samples of one process without torch.distributed."""
    indices = list(range(0, 200, 3))
    reference = make_dataset(corpus, num_samples=200)
    merged = {}
    for part in run_distributed(_dp_samples, 2, corpus, str(tmp_path / "cache"), indices):
        merged.update(part)
    assert sorted(merged) == indices
    for i in indices:
        assert_same_sample(merged[i], reference[i])


def test_build_bert_datasets_splits(corpus, tmp_path):
    prefix, _, _, vocab = corpus
    train, valid, test = build_bert_datasets(
        [prefix], "80,20,0", (500, 50, 0), SEQ_LENGTH, 1234, str(tmp_path), vocab
    )
    assert len(train) == 500 and len(valid) == 50 and test is None
    n = train.indexed.num_documents
    docs = train.indexed.document_indices
    assert train.mapping[:, 1].max() <= docs[round(0.8 * n)] <= valid.mapping[:, 0].min()
    for split, counts in (("80,20,0", (10, 10, 10)), ("1000,1,0", (10, 10, 0))):
        with pytest.raises(ConfigError, match="leaves the (valid|test) split of .* without data"):
            build_bert_datasets([prefix], split, counts, SEQ_LENGTH, 1, None, vocab)


def test_blended_prefixes(corpus, tmp_path):
    prefix, _, tokenizer, vocab = corpus
    other = str(tmp_path / "other_text_sentence")
    write_sentence_data(make_corpus(seed=1, num_docs=100), tokenizer, other)
    train, valid, _ = build_bert_datasets(
        [0.7, prefix, 0.3, other], "90,10,0", (1000, 40, 0), SEQ_LENGTH, 1234, None, vocab
    )
    assert len(train) == 1000 and len(valid) == 40
    counts = np.bincount(train.dataset_index)
    assert abs(counts[0] - 700) <= 1 and abs(counts[1] - 300) <= 1
    for n in (0, 1, 2, 500, 999):
        part = train.datasets[train.dataset_index[n]]
        sample = train[n]
        assert sample.pop("source").item() == train.dataset_index[n]
        assert_same_sample(sample, part[int(train.dataset_sample_index[n])])
    (train,) = build_bert_datasets(
        [prefix, other], "1,0,0", (100, 0, 0), SEQ_LENGTH, 1, None, vocab
    )[:1]
    epoch = [len(p) for p in train.datasets]
    assert np.allclose(
        np.bincount(train.dataset_index) / 100, np.array(epoch) / sum(epoch), atol=0.02
    )


def test_user_errors(corpus, tmp_path):
    prefix, vocab_file, tokenizer, vocab = corpus
    with pytest.raises(ConfigError, match="seq_length=4"):
        BertDataset(IndexedDataset(prefix), (0, 5), 10, 4, 1, None, vocab)
    single = str(tmp_path / "one_sentence_docs")
    write_sentence_data([["Just one sentence here."]] * 20, tokenizer, single)
    with pytest.raises(ConfigError, match="--split-sentences"):
        BertDataset(IndexedDataset(single), (0, 20), 10, SEQ_LENGTH, 1, None, vocab)
    with pytest.raises(ConfigError, match="wordpiece"):
        BertVocab.from_tokenizer(object())
