"""Where a training sample came from: its source dataset, the documents it spans and the offset
into the first, read off the same indices the sample order is built from (no token is read
to find them). Megatron's sampler walks the train split in order, so step N's global batch is
samples ``(N-1)*gbs .. N*gbs - 1``, whatever the DP size (each DP rank takes a contiguous share),
the N-th batch the skip list does not pass over when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron.config import skip_list
from megatron.data.blended_dataset import BlendedDataset
from megatron.data.gpt_dataset import GPTDataset


@dataclass(frozen=True)
class Provenance:
    source: str  # the dataset's prefix
    documents: list[int]  # sequence ids in that dataset, in the order the sample reads them
    offset: int  # the sample's first token within the first of them
    tokens: np.ndarray  # the sample's seq_length + 1 ids (tokens, then the last label)


def step_samples(iteration: int, global_batch_size: int, skip: skip_list.Ranges = ()) -> range:
    """The train split's sample positions of iteration ``iteration`` (1-based): its batch is the
    ``iteration``-th one the skip list does not pass over."""
    batches = skip_list.batches_from(1, list(skip))
    batch = next(b for i, b in enumerate(batches, 1) if i == iteration)
    return range((batch - 1) * global_batch_size, batch * global_batch_size)


def provenance(dataset: torch.utils.data.Dataset, idx: int) -> Provenance:
    """Where sample ``idx`` of a GPT train split (a ``GPTDataset``, or a blend) comes from."""
    if isinstance(dataset, BlendedDataset):
        part = int(dataset.dataset_index[idx])
        return provenance(dataset.datasets[part], int(dataset.dataset_sample_index[idx]))
    if not isinstance(dataset, GPTDataset):
        raise TypeError(f"no provenance for {type(dataset).__name__}: GPT samples only")
    j = int(dataset.shuffle_index[idx])
    first, offset = (int(v) for v in dataset.sample_index[j])
    last = int(dataset.sample_index[j + 1][0])
    documents = [int(d) for d in dataset.document_index[first : last + 1]]
    return Provenance(dataset.indexed.prefix, documents, offset, dataset.tokens(idx))
