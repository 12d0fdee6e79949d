"""The skip list and the sampler that passes over it: batch numbers from 1, ranges merged,
skipped batches stepped over whole on every DP rank alike, a bad entry one line."""

from __future__ import annotations

import itertools

import pytest

from megatron.config import skip_list
from megatron.data.loader import MicroBatchSampler
from megatron.errors import ConfigError


def test_entries_merge_into_ranges_and_are_stepped_over():
    ranges = skip_list.parse([4, [7, 9], [5, 6], 20])
    assert ranges == [[4, 9], [20, 20]] and skip_list.count(ranges) == 7
    assert list(itertools.islice(skip_list.batches_from(1, ranges), 6)) == [1, 2, 3, 10, 11, 12]
    assert skip_list.next_batch(3 * 8, 8, ranges) == 10  # after batch 3 comes batch 10
    assert skip_list.describe(ranges) == "4-9, 20"


@pytest.mark.parametrize("entry", [0, [5, 4], [1, 2, 3]])
def test_a_bad_entry_is_one_line(entry):
    with pytest.raises(ConfigError, match=r"^data\.skip_batches: .* fix the entry$"):
        skip_list.parse([entry])


def test_each_dp_rank_passes_over_the_same_batches():
    gbs, mbs = 4, 1
    skip = [[2, 3]]
    per_rank = [list(MicroBatchSampler(24, 0, mbs, gbs, r, 2, skip)) for r in range(2)]
    # batches 1, 4, 5, 6: rank 0 the first two samples of each, rank 1 the last two
    assert per_rank[0] == [[0], [1], [12], [13], [16], [17], [20], [21]]
    assert per_rank[1] == [[2], [3], [14], [15], [18], [19], [22], [23]]
    assert len(MicroBatchSampler(24, 0, mbs, gbs, 0, 2, skip)) == 8
    resumed = list(MicroBatchSampler(24, 4, mbs, gbs, 0, 2, skip))  # after batch 1
    assert resumed == per_rank[0][2:]
