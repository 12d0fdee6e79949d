"""BERT samples from sentence-split data: Megatron's sample mapping, sentence order and masking.

The data is an ``IndexedDataset`` with one sequence per sentence (``preprocess_data.py
--split-sentences``). A *sample mapping* row ``(first, end, target)`` names the sentences
``[first, end)`` of one document and a target length; every epoch regroups each eligible document
greedily into such rows and the rows are shuffled within their epoch (``bert_mapping``). The
mapping is cached on disk. A sample is then made from its row and a random generator seeded by
``(seed, index)`` alone, so it never depends on DP size, workers or restarts::

    sentences [first, end) -> A = sentences before a random pivot, B = the rest
    swap A and B with probability 0.5                         -> is_random (sentence order)
    trim the longer of A, B at a random end until |A|+|B| <= target
    [CLS] A [SEP] B [SEP]      types 0 ... 0 1 ... 1           -> mask 15% by whole words
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron.data.bert_mapping import LONG_SENTENCE_TOKENS, MAPPING_VERSION, build_sample_mapping
from megatron.data.index_cache import cached_indices, dataset_fingerprint
from megatron.data.indexed_dataset import IndexedDataset, index_path
from megatron.data.splits import build_split_datasets, parse_data_paths
from megatron.errors import ConfigError


@dataclass(frozen=True)
class BertVocab:
    """The ids BERT samples need, and which vocabulary entries continue a word (``##`` pieces)."""

    cls: int
    sep: int
    mask: int
    pad: int
    is_continuation: np.ndarray  # bool[vocab_size]

    @property
    def vocab_size(self) -> int:
        """Number of entries in the vocabulary (before any model padding)."""
        return len(self.is_continuation)

    @classmethod
    def from_tokenizer(cls, tokenizer: object) -> BertVocab:
        """Take the ids and ``continuation_mask`` of a WordPiece tokenizer (``build_tokenizer``)."""
        ids = {name: getattr(tokenizer, name, None) for name in ("cls", "sep", "mask", "pad")}
        continuation = getattr(tokenizer, "continuation_mask", None)
        missing = [f"[{name.upper()}]" for name, i in ids.items() if i is None]
        if continuation is None or missing:
            raise ConfigError(
                f"tokenizer.type: BERT needs a WordPiece vocabulary with [CLS], [SEP], [MASK] and "
                f"[PAD] (missing {', '.join(missing) or '## continuation pieces'}); "
                "use tokenizer.type=wordpiece with a BERT vocab.txt"
            )
        return cls(is_continuation=np.asarray(continuation, dtype=bool), **ids)


def truncate_pair(
    a: np.ndarray, b: np.ndarray, target: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Trim the longer segment (B on ties) one token at a time until ``|a|+|b| <= target``.

    Each removed token comes from the front or the back with probability 1/2; only the counts per
    segment are fixed, so they are computed directly and the front share drawn as a binomial.
    """
    excess = len(a) + len(b) - target
    if excess <= 0:
        return a, b
    first = min(excess, abs(len(a) - len(b)))  # trims the longer one until they are level
    rest = excess - first  # then alternating, B first
    cut_a = rest // 2 + (first if len(a) > len(b) else 0)
    cut_b = rest - rest // 2 + (first if len(b) > len(a) else 0)
    front_a, front_b = rng.binomial(cut_a, 0.5), rng.binomial(cut_b, 0.5)
    return a[front_a : len(a) - cut_a + front_a], b[front_b : len(b) - cut_b + front_b]


def _check_options(
    seq_length: int, masked_lm_prob: float, short_seq_prob: float, max_ngram: int
) -> None:
    if seq_length < 5:
        raise ConfigError(
            f"model.seq_length={seq_length} is too short for BERT: [CLS] A [SEP] B [SEP] needs "
            "at least 5 positions"
        )
    if not 0.0 < masked_lm_prob < 1.0:
        raise ConfigError(f"bert.masked_lm_prob={masked_lm_prob} must be in (0, 1); BERT uses 0.15")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ConfigError(f"bert.short_seq_prob={short_seq_prob} must be in [0, 1]; BERT uses 0.1")
    if max_ngram < 1:
        raise ConfigError(f"bert.max_ngram={max_ngram} must be at least 1; Megatron uses 3")


def masked_count(num_maskable: int, masked_lm_prob: float) -> int:
    """How many tokens a sample with ``num_maskable`` non-special tokens masks (at least one)."""
    return max(1, round(num_maskable * masked_lm_prob)) if num_maskable else 0


def max_predictions(seq_length: int, masked_lm_prob: float) -> int:
    """The most tokens a sample of ``seq_length`` masks: its ``masked_positions`` width.

    Megatron's ``max_predictions_per_seq`` is ``masked_lm_prob * (seq_length - 3)`` (room for
    [CLS] and two [SEP]), which caps its rounded count; here the count is the rounded one and
    never capped, so the width is that count for the most maskable tokens a sample holds (at
    most one more than Megatron's, when the product's fraction is at least 0.5).
    """
    return masked_count(seq_length - 3, masked_lm_prob)


def pad_positions(positions: np.ndarray, width: int) -> np.ndarray:
    """``positions`` (int64) then zeros up to ``width``: 0 is the [CLS], never masked."""
    padded = np.zeros(width, dtype=np.int64)
    padded[: len(positions)] = positions
    return padded


class BertDataset(torch.utils.data.Dataset):
    """Masked-LM + sentence-order samples over a sentence-split IndexedDataset.

    Each item is a dict of numpy arrays of length ``seq_length``: ``text`` (the masked input),
    ``types`` (0 for [CLS] A [SEP], 1 for B [SEP]), ``labels`` (the original id where masked, -1
    elsewhere), ``loss_mask`` (float32, 1 where masked), ``padding_mask`` (1 on real tokens), the
    scalar ``is_random`` (1 when A and B were swapped), and ``masked_positions``: the masked
    positions in order, padded with 0 to ``max_predictions(seq_length, masked_lm_prob)``, so the
    model's LM head has a fixed size. Without ``binary_head`` a sample is
    ``[CLS] A [SEP]`` with all its sentences in A (Megatron's option for BERT without the
    sentence-order head), and ``is_random`` is always 0.

    Masking follows BERT with whole words and n-grams: a word is a piece plus the ``##`` pieces
    after it; words are visited in random order, each proposing an n-gram of 1..max_ngram whole
    words (probability proportional to 1/n, shortened while it would overshoot the budget) that
    is taken unless it overlaps one already taken, until ``masked_count`` tokens are chosen. Each
    chosen token becomes [MASK] (80%), a random non-special id (10%) or stays (10%). [CLS], [SEP],
    [MASK] and [PAD] are never chosen, and n-grams never span a [SEP].
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: tuple[int, int],
        num_samples: int | None,
        seq_length: int,
        seed: int,
        cache_dir: str | None,
        vocab: BertVocab,
        masked_lm_prob: float = 0.15,
        short_seq_prob: float = 0.1,
        max_ngram: int = 3,
        binary_head: bool = True,
    ) -> None:
        _check_options(seq_length, masked_lm_prob, short_seq_prob, max_ngram)
        begin, end = documents
        min_sentences = 2 if binary_head else 1
        self.key = {
            "kind": "bert",
            "version": MAPPING_VERSION,
            "idx_sha1": dataset_fingerprint(indexed.prefix),
            "documents": [begin, end],
            "num_samples": num_samples,
            "max_length": seq_length - 3,
            "short_seq_prob": short_seq_prob,
            "seed": seed,
            "min_sentences": min_sentences,
        }
        doc_bounds = indexed.document_indices[begin : end + 1]
        self.mapping = cached_indices(
            cache_dir,
            "bert",
            self.key,
            ("mapping",),
            lambda: {
                "mapping": build_sample_mapping(
                    doc_bounds,
                    indexed.sequence_lengths,
                    num_samples,
                    seq_length - 3,  # room for [CLS] and two [SEP]
                    short_seq_prob,
                    seed,
                    min_sentences,
                )
            },
        )["mapping"]
        if len(self.mapping) == 0:
            raise ConfigError(
                f"{index_path(indexed.prefix)}: no document in [{begin}, {end}) has "
                f"{min_sentences}+ sentences of at most {LONG_SENTENCE_TOKENS} tokens; BERT "
                "needs sentence-split data (tools/preprocess_data.py --split-sentences)"
            )
        self.indexed = indexed
        self.seq_length = seq_length
        self.seed = seed
        self.vocab = vocab
        self.masked_lm_prob = masked_lm_prob
        self.max_predictions = max_predictions(seq_length, masked_lm_prob)
        self.max_ngram = max_ngram
        self.binary_head = binary_head
        self._special = np.zeros(vocab.vocab_size, dtype=bool)
        self._special[[vocab.cls, vocab.sep, vocab.mask, vocab.pad]] = True
        self._replacements = np.flatnonzero(~self._special)
        # cumulative 1/n weights: an n-gram length is drawn by inverting this CDF
        self._ngram_cdf = np.cumsum(1.0 / np.arange(1, max_ngram + 1))

    def __len__(self) -> int:
        return len(self.mapping)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """Sample ``idx``, a function of (seed, idx) and the data only."""
        first, end, target = (int(v) for v in self.mapping[idx])
        rng = np.random.default_rng([self.seed, idx])
        sentences = [self.indexed[i] for i in range(first, end)]
        is_random = False
        if self.binary_head:
            pivot = int(rng.integers(1, len(sentences)))
            a, b = np.concatenate(sentences[:pivot]), np.concatenate(sentences[pivot:])
            is_random = bool(rng.random() < 0.5)
            if is_random:
                a, b = b, a
        else:
            a, b = np.concatenate(sentences), sentences[0][:0]
        a, b = truncate_pair(a, b, target, rng)

        v, s = self.vocab, self.seq_length
        pieces = [[v.cls], a, [v.sep], *([b, [v.sep]] if self.binary_head else [])]
        n = sum(len(piece) for piece in pieces)
        tokens = np.full(s, v.pad, dtype=np.int64)
        tokens[:n] = np.concatenate(pieces)
        types = np.zeros(s, dtype=np.int64)
        types[len(a) + 2 : n] = 1
        positions = self._choose_masked(tokens[:n], rng)
        text = tokens.copy()
        draw = rng.random(len(positions))
        text[positions[draw < 0.8]] = v.mask
        swapped = positions[draw >= 0.9]
        text[swapped] = self._replacements[rng.integers(0, len(self._replacements), len(swapped))]
        labels = np.full(s, -1, dtype=np.int64)
        labels[positions] = tokens[positions]
        loss_mask = np.zeros(s, dtype=np.float32)
        loss_mask[positions] = 1.0
        padding_mask = np.zeros(s, dtype=np.int64)
        padding_mask[:n] = 1
        return {
            "text": text,
            "types": types,
            "labels": labels,
            "loss_mask": loss_mask,
            "padding_mask": padding_mask,
            "is_random": np.int64(is_random),
            "masked_positions": pad_positions(positions, self.max_predictions),
        }

    def _choose_masked(self, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Sorted positions to mask: whole-word n-grams, ``masked_count`` tokens in total."""
        maskable = ~self._special[tokens]
        joins_previous = self.vocab.is_continuation[tokens] & np.concatenate(
            [[False], maskable[:-1]]
        )
        is_start = maskable & ~joins_previous
        starts = np.flatnonzero(is_start)
        num_words = len(starts)
        if num_words == 0:
            return starts
        ends = starts + np.bincount(np.cumsum(is_start)[maskable] - 1, minlength=num_words)
        # span[w]: how many words an n-gram at word w may cover; it grows over the next word only
        # when no special token ([SEP]) sits between them
        adjacent = ends[:-1] == starts[1:]
        span = np.ones(num_words, dtype=np.int64)
        joined = np.ones(num_words, dtype=bool)
        for k in range(1, self.max_ngram):
            m = max(num_words - k, 0)  # words that have a k-th word after them
            joined[m:] = False
            joined[:m] &= adjacent[k - 1 :]
            span += joined
        draw = rng.random(num_words) * self._ngram_cdf[span - 1]
        ngram = np.searchsorted(self._ngram_cdf, draw, side="right") + 1

        budget = masked_count(int(maskable.sum()), self.masked_lm_prob)
        starts_l, ends_l, ngram_l = starts.tolist(), ends.tolist(), ngram.tolist()
        taken = [False] * num_words
        chosen: list[np.ndarray] = []
        count = 0
        for w in rng.permutation(num_words).tolist():
            if count >= budget:
                break
            n = ngram_l[w]
            while n and count + ends_l[w + n - 1] - starts_l[w] > budget:
                n -= 1
            if n == 0 or any(taken[w : w + n]):
                continue
            taken[w : w + n] = [True] * n
            chosen.append(np.arange(starts_l[w], ends_l[w + n - 1]))
            count += ends_l[w + n - 1] - starts_l[w]
        return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


def build_bert_datasets(
    paths: Sequence,
    split: str,
    num_samples: tuple[int, int, int],
    seq_length: int,
    seed: int,
    cache_dir: str | None,
    vocab: BertVocab,
    **options: float | bool,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """Train, valid and test datasets from ``data.paths`` and ``data.split`` (over documents);
    ``options`` are BertDataset's (``masked_lm_prob`` and so on).

    A split asked for 0 samples is None. One unweighted prefix gives a BertDataset; several are
    blended exactly as GPT data is (see ``build_split_datasets``).
    """
    prefixes, weights = parse_data_paths(list(paths))

    def part(ds: IndexedDataset, documents: tuple[int, int], size: int | None) -> BertDataset:
        return BertDataset(ds, documents, size, seq_length, seed, cache_dir, vocab, **options)

    return build_split_datasets(
        prefixes, weights, split, num_samples, part, cache_dir, by_documents=True
    )
