"""The DP-sharded, resumable micro-batch stream.

Training step k covers the global samples ``[consumed + k * gbs, consumed + (k + 1) * gbs)`` in
dataset index order (the dataset is already shuffled). Data-parallel rank r takes a contiguous
block of ``gbs / dp`` of them and cuts it into micro-batches. For 2 ranks, gbs 8, mbs 2::

    step k:  | s0 s1 s2 s3 | s4 s5 s6 s7 |
             |   rank 0    |   rank 1    |
             | mb0  | mb1  | mb0  | mb1  |

So the samples a step sees depend only on (consumed_samples, global_batch_size, skip list):
never on the DP size, the worker count or restarts, and resuming at ``consumed_samples`` continues
the stream exactly where it stopped. A skipped global batch (``megatron.config.skip_list``) is
passed over whole, by every rank alike.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron.config import skip_list
from megatron.errors import ConfigError


class MicroBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Index lists of this rank's micro-batches, step after step, until the data runs out.

    A step whose global batch would run past the end of the dataset is not started.
    """

    def __init__(
        self,
        num_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        skip: skip_list.Ranges = (),
    ) -> None:
        if micro_batch_size < 1 or global_batch_size % (micro_batch_size * dp_size):
            raise ConfigError(
                f"training.global_batch_size={global_batch_size} must be a multiple of "
                f"training.micro_batch_size={micro_batch_size} x data-parallel size {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        if consumed_samples < 0:
            raise ConfigError(f"consumed_samples={consumed_samples} must be >= 0")
        self.num_samples = num_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.per_rank = global_batch_size // dp_size
        self.rank_offset = dp_rank * self.per_rank
        self.skip = list(skip)
        # Batch N starts at sample base + (N-1) * gbs: 0 unless the batch size changed mid-run.
        self.base = consumed_samples % global_batch_size

    def _batches(self) -> Iterator[int]:
        """The numbers (from 1) of the global batches still to train, in order."""
        last = (self.num_samples - self.base) // self.global_batch_size
        start = skip_list.next_batch(self.consumed_samples, self.global_batch_size, self.skip)
        return (b for b in range(start, last + 1) if not skip_list.is_skipped(b, self.skip))

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        return sum(1 for _ in self._batches()) * (self.per_rank // self.micro_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self._batches():
            first = self.base + (batch - 1) * self.global_batch_size + self.rank_offset
            for mb in range(first, first + self.per_rank, self.micro_batch_size):
                yield list(range(mb, mb + self.micro_batch_size))


def build_loader(
    dataset: torch.utils.data.Dataset,
    consumed_samples: int,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    skip: skip_list.Ranges = (),
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches from ``consumed_samples`` on, the ``skip`` batches passed over:
    dicts of [micro_batch, ...] tensors.

    Each training step takes ``global_batch_size / (micro_batch_size * dp_size)`` of them.
    ``pin_memory`` applies only where CUDA is available.
    """
    sampler = MicroBatchSampler(
        len(dataset), consumed_samples, micro_batch_size, global_batch_size, dp_rank, dp_size, skip
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        # Its own generator: starting an iterator draws a worker seed, and drawing it from the
        # global generator would shift every later dropout mask (and break bit-exact resume).
        generator=torch.Generator(),
    )
    return iter(loader)
