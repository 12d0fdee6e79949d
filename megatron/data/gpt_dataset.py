"""GPT samples: Megatron's document, sample and shuffle indices over an indexed dataset.

For a split (a contiguous range of sequences in file order), the sequences are tiled once per
epoch and shuffled (the *document index*). Their tokens, read in that order, form one long
stream; sample ``j`` is the ``seq_length + 1`` tokens starting at stream position
``j * seq_length``, so each sample's last token is the next sample's first. The *sample index*
records where every sample starts as (position in the document index, token offset). The
*shuffle index* is a permutation of the samples. Everything is drawn from one
``numpy.random.RandomState(seed)`` in the order megatron-core 0.16.1 uses, so the same data, seed,
split, sequence length and sample count give the same samples in the same order as its
GPTDataset.

The indices are built with whole-array numpy operations and cached as ``.npy`` files
(``index_cache``), which every rank then memory-maps.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron.data.index_cache import cached_indices, dataset_fingerprint
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.splits import build_split_datasets, parse_data_paths

# Bump when the meaning of a cached array changes, so stale caches are never reused.
_CACHE_VERSION = 1
# megatron-core reshuffles a final epoch on its own when less than this share of it is used
_FINAL_EPOCH_THRESHOLD = 0.80


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    sequences: tuple[int, int],
    num_samples: int | None,
    seq_length: int,
    seed: int,
) -> dict[str, np.ndarray]:
    """The document, sample and shuffle indices of megatron-core's GPTDataset, vectorised.

    ``sequences`` is the split's [begin, end) range of sequence ids; ``num_samples`` None means
    one epoch. Returns ``document_index`` int32[epochs * n_seq], ``sample_index`` [samples + 1, 2]
    (row j: position in the document index and token offset where sample j starts) and
    ``shuffle_index`` [samples].
    """
    begin, end = sequences
    split_lengths = sequence_lengths[begin:end]
    tokens_per_epoch = int(split_lengths.sum(dtype=np.int64))
    if tokens_per_epoch < 2:
        raise ValueError("a split needs at least 2 tokens to make a sample")
    # every sample needs seq_length tokens plus the one extra that becomes its last label
    tokens_needed = (num_samples or 0) * seq_length + 1
    num_epochs = max(1, -(-tokens_needed // tokens_per_epoch))
    separate_final_epoch = False
    if num_epochs > 1 and num_samples is not None:
        samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        # a barely used final epoch shuffled into the others would skew the sample mix
        separate_final_epoch = num_samples - samples_before_final < int(
            _FINAL_EPOCH_THRESHOLD * samples_per_epoch
        )
    rng = np.random.RandomState(seed)

    ids = np.arange(begin, end, dtype=np.int32)
    full_epochs = num_epochs - 1 if separate_final_epoch else num_epochs
    document_index = np.tile(ids, full_epochs)
    rng.shuffle(document_index)
    if separate_final_epoch:
        final = ids.copy()
        rng.shuffle(final)
        document_index = np.concatenate([document_index, final])

    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = _sample_index(sequence_lengths[document_index], total, seq_length)

    # uint32 like megatron-core while the range fits, which halves the cache
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = samples_before_final if separate_final_epoch else total
    shuffle_index = np.arange(first, dtype=dtype)
    rng.shuffle(shuffle_index)
    if separate_final_epoch:
        rest = np.arange(first, total, dtype=dtype)
        rng.shuffle(rest)
        shuffle_index = np.concatenate([shuffle_index, rest])
    return {
        "document_index": document_index,
        "sample_index": sample_index,
        "shuffle_index": shuffle_index,
    }


def _sample_index(lengths: np.ndarray, num_samples: int, seq_length: int) -> np.ndarray:
    """[num_samples + 1, 2]: for each boundary j*seq_length, the document holding it and the offset.

    Counting, per document, the boundaries that fall inside it and repeating the document's
    position that many times is linear in the data (no search, no loop over samples).
    """
    # in-place steps below: at 1e10 tokens each array is ~80 MB, and memory traffic is the cost
    ends = np.cumsum(lengths, dtype=np.int64)  # stream position after each document
    # boundaries before the end of document d: j*L < ends[d], i.e. j < ceil(ends[d] / L)
    before_end = ends + (seq_length - 1)
    before_end //= seq_length
    np.minimum(before_end, num_samples + 1, out=before_end)
    dtype = np.int32 if len(lengths) <= np.iinfo(np.int32).max else np.int64
    doc = np.repeat(np.arange(len(lengths), dtype=dtype), np.diff(before_end, prepend=0))
    starts = np.subtract(ends, lengths, out=ends)
    offset = np.arange(num_samples + 1, dtype=np.int64)
    offset *= seq_length
    offset -= starts[doc]
    index = np.stack([doc, offset.astype(dtype, copy=False)], axis=1)
    index[0] = 0  # megatron-core starts at (0, 0) even when the first document is empty
    return index


def ltor_masks(
    tokens: torch.Tensor,
    eod: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> dict[str, torch.Tensor]:
    """Loss mask, position ids and (only with reset_attention_mask) the document ids.

    With resets, a document starts after each EOD in ``tokens`` (the EOD ends its own document):
    positions restart at 0 and a token attends only to earlier tokens of its own document.
    ``document_ids`` int64 [s] numbers the documents from 0; the model builds Megatron's mask
    from them on the device (``megatron.models.document_mask``), so no [s, s] mask is made here.
    """
    s = tokens.numel()
    out = {"loss_mask": torch.ones(s, dtype=torch.float32)}
    if eod_mask_loss:
        out["loss_mask"][tokens == eod] = 0.0
    positions = torch.arange(s, dtype=torch.int64)
    after_eod = torch.zeros(s, dtype=torch.bool)
    after_eod[1:] = tokens[:-1] == eod
    if reset_position_ids:
        # start of each token's document: the latest position following an EOD
        starts = torch.cummax(torch.where(after_eod, positions, 0), dim=0).values
        out["position_ids"] = positions - starts
    else:
        out["position_ids"] = positions
    if reset_attention_mask:
        out["document_ids"] = torch.cumsum(after_eod, dim=0)  # [s]
    return out


class GPTDataset(torch.utils.data.Dataset):
    """One split of one indexed dataset as GPT samples (Megatron's sample order).

    ``dataset[i]`` is a dict of ``tokens`` int64[s], ``labels`` int64[s] (tokens shifted by one),
    ``loss_mask`` float32[s], ``position_ids`` int64[s], and ``document_ids`` int64[s] only
    when reset_attention_mask.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        sequences: tuple[int, int],
        num_samples: int | None,
        seq_length: int,
        seed: int,
        cache_dir: str | None,
        eod: int,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
    ) -> None:
        self.indexed = indexed
        self.seq_length = seq_length
        self.eod = eod
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.eod_mask_loss = eod_mask_loss
        self.key = {
            "version": _CACHE_VERSION,
            "idx_sha1": dataset_fingerprint(indexed.prefix),
            "sequences": list(sequences),
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
        }
        arrays = cached_indices(
            cache_dir,
            "gpt",
            self.key,
            ("document_index", "sample_index", "shuffle_index"),
            lambda: build_gpt_indices(
                indexed.sequence_lengths, sequences, num_samples, seq_length, seed
            ),
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        """Samples available: at least the number requested (whole epochs are indexed)."""
        return len(self.shuffle_index)

    def tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``idx`` (int64)."""
        j = int(self.shuffle_index[idx])
        first, first_offset = (int(v) for v in self.sample_index[j])
        last, last_offset = (int(v) for v in self.sample_index[j + 1])
        get, docs = self.indexed.get, self.document_index
        if first == last:
            parts = [get(int(docs[first]), first_offset, last_offset - first_offset + 1)]
        else:
            parts = [get(int(docs[first]), first_offset)]
            parts += [get(int(docs[k])) for k in range(first + 1, last)]
            parts.append(get(int(docs[last]), 0, last_offset + 1))
        return np.concatenate(parts, dtype=np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        """Sample ``idx`` as the tensors the GPT loss needs."""
        text = torch.from_numpy(self.tokens(idx))
        tokens = text[:-1].contiguous()
        sample = {"tokens": tokens, "labels": text[1:].contiguous()}
        masks = (self.reset_position_ids, self.reset_attention_mask, self.eod_mask_loss)
        sample.update(ltor_masks(tokens, self.eod, *masks))
        return sample


def build_gpt_datasets(
    paths: list,
    split: str,
    num_samples: tuple[int, int, int],
    seq_length: int,
    seed: int,
    cache_dir: str | None,
    eod: int,
    **options: bool,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """Train, valid and test datasets from ``data.paths`` and ``data.split`` (over sequences);
    ``options`` are GPTDataset's (``reset_position_ids`` and so on).

    A split asked for 0 samples is None. One unweighted prefix gives a GPTDataset with exactly
    megatron-core's sample order; several give a BlendedDataset (see ``build_split_datasets``).
    """
    prefixes, weights = parse_data_paths(paths)

    def part(indexed: IndexedDataset, sequences: tuple[int, int], size: int | None) -> GPTDataset:
        return GPTDataset(indexed, sequences, size, seq_length, seed, cache_dir, eod, **options)

    return build_split_datasets(prefixes, weights, split, num_samples, part, cache_dir)
