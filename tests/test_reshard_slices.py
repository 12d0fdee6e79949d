"""A load at another TP size reads, of each saved slice, only the elements its rank holds: every
(saved TP, new TP, rank) of a column-split, a row-split and a padded vocabulary table gives what
merging all slices and cutting gives, from reads no larger than the rank's share."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from megatron.checkpoint.format import open_safetensors
from megatron.checkpoint.reshard import ShardedTensors, merge_shards, take_shard

VOCAB = 13  # real rows of the vocabulary table; padded to a multiple of 4 x TP


def _padded(tp: int) -> int:
    return -(-VOCAB // (4 * tp)) * 4 * tp


def _files(tmp_path, saved_tp: int) -> tuple[list[str], dict, dict[str, list[torch.Tensor]]]:
    torch.manual_seed(saved_tp)
    rows = _padded(saved_tp)
    vocab = torch.randn(rows, 6)
    vocab[VOCAB:] = 0
    full = {"model/col": (torch.randn(24, 5), 0), "model/row": (torch.randn(5, 24), 1),
            "model/vocab": (vocab, 0)}  # fmt: skip
    layout = {key: {"split_dim": dim, "vocab": key == "model/vocab", "shape": list(t.shape)}
              for key, (t, dim) in full.items()}  # fmt: skip
    shards = {key: list(t.chunk(saved_tp, dim)) for key, (t, dim) in full.items()}
    paths = []
    for r in range(saved_tp):
        paths.append(str(tmp_path / f"shard_{r}.safetensors"))
        save_file({key: s[r].contiguous() for key, s in shards.items()}, paths[-1])
    return paths, layout, shards


class _Counting:
    """A safetensors file whose slice reads are counted in elements."""

    def __init__(self, inner, counts: list[int]):
        self.inner, self.counts = inner, counts

    def get_tensor(self, key):
        out = self.inner.get_tensor(key)
        self.counts.append(out.numel())
        return out

    def get_slice(self, key):
        inner, counts = self.inner.get_slice(key), self.counts

        class Slice:
            def __getitem__(self, index):
                out = inner[index]
                counts.append(out.numel())
                return out

        return Slice()


@pytest.mark.parametrize("saved_tp", [1, 2, 4])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_reshard_reads_only_the_rank_share(tmp_path, saved_tp, tp):
    paths, layout, shards = _files(tmp_path, saved_tp)
    for rank in range(tp):
        source = ShardedTensors(paths, layout, VOCAB)
        counts: list[int] = []
        source._files = {r: _Counting(open_safetensors(p), counts) for r, p in enumerate(paths)}
        for key, info in layout.items():
            vocab = info["vocab"]
            padded = _padded(tp) if vocab else None
            got = source.read(key, tp, rank, padded)
            dim = info["split_dim"]
            want = take_shard(merge_shards(shards[key], dim, VOCAB if vocab else None), dim, tp,
                              rank, padded)  # fmt: skip
            assert torch.equal(got, want), key
        # At most the rank's share: its part of each split tensor (of the real vocabulary rows).
        share = (24 * 5 // tp) * 2 + _padded(tp) // tp * 6
        assert sum(counts) <= share
