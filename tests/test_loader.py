"""The micro-batch stream: resumable, independent of DP size and of worker count."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron.data.gpt_dataset import build_gpt_datasets
from megatron.data.loader import build_loader
from megatron.errors import ConfigError
from tests.test_gpt_dataset import EOD, make_corpus


class SampleIds(torch.utils.data.Dataset):
    """Sample i is its own id, so a stream shows exactly which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"id": torch.tensor(i), "pair": torch.tensor([i, -i])}


def _steps(dataset, consumed, mbs, gbs, dp, steps, **kw) -> list[list[int]]:
    """Sample ids of each of ``steps`` steps, concatenating every DP rank's micro-batches."""
    per_step = gbs // (mbs * dp)
    streams = [build_loader(dataset, consumed, mbs, gbs, r, dp, **kw) for r in range(dp)]
    out = []
    for _ in range(steps):
        ids = []
        for stream in streams:
            for mb in itertools.islice(stream, per_step):
                assert mb["id"].shape == (mbs,) and mb["pair"].shape == (mbs, 2)
                ids += mb["id"].tolist()
        out.append(ids)
    return out


def test_step_k_covers_consecutive_global_samples():
    assert _steps(SampleIds(100), 8, 2, 8, 2, 3) == [
        list(range(8, 16)),
        list(range(16, 24)),
        list(range(24, 32)),
    ]


def test_resume_equals_uninterrupted_stream():
    data = SampleIds(200)
    full = _steps(data, 0, 2, 12, 2, 10)
    for k in (0, 1, 4, 9):
        assert _steps(data, 12 * k, 2, 12, 2, 10 - k) == full[k:]


@pytest.mark.parametrize("mbs, gbs", [(1, 8), (2, 8), (4, 8), (2, 12)])
def test_dp1_and_dp2_see_the_same_global_batches(mbs, gbs):
    data = SampleIds(120)
    assert _steps(data, 0, mbs, gbs, 1, 5) == _steps(data, 0, mbs, gbs, 2, 5)


def test_rank_takes_a_contiguous_block_in_micro_batches():
    stream = build_loader(SampleIds(64), 16, 2, 16, 1, 2)
    assert [mb["id"].tolist() for mb in itertools.islice(stream, 4)] == [
        [24, 25],
        [26, 27],
        [28, 29],
        [30, 31],
    ]


def test_stream_stops_before_an_incomplete_global_batch():
    stream = build_loader(SampleIds(21), 0, 2, 8, 0, 1)
    assert [mb["id"].tolist()[0] for mb in stream] == [0, 2, 4, 6, 8, 10, 12, 14]


def test_batch_sizes_must_divide():
    with pytest.raises(ConfigError, match="global_batch_size=10 must be a multiple"):
        build_loader(SampleIds(40), 0, 2, 10, 0, 2)


def test_workers_do_not_change_the_stream(tmp_path):
    prefix = make_corpus(str(tmp_path / "a"), 100, 0)
    train, _, _ = build_gpt_datasets([prefix], "1,0,0", (64, 0, 0), 16, 1, str(tmp_path), EOD)

    def take(workers: int) -> list[dict[str, torch.Tensor]]:
        return list(itertools.islice(build_loader(train, 8, 2, 8, 1, 2, num_workers=workers), 6))

    inline, pooled = take(0), take(2)
    assert len(inline) == 6 and inline[0]["tokens"].shape == (2, 16)
    for a, b in zip(inline, pooled, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(inline[0]["tokens"][0], train[12]["tokens"])
