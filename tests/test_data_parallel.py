"""DataParallel: DP=2 averaged gradients equal the serial gradients of the whole batch, micro-batch
accumulation equals one big batch, and collectives run only on the last micro-batch, one per
bucket, launched during backward (counted by wrapping dist.all_reduce in the child); with
``shard_optimizer`` a reduce-scatter per padded bucket and the parameters' all-gather."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.parallel.data_parallel import DataParallel
from megatron.parallel.state import ParallelState
from tests.distributed import run_distributed

VOCAB = 13
BUCKET_MB = 150 * 4 / 2**20  # 150 fp32 values: three buckets, one of several parameters


class TiedNet(nn.Module):
    """Embedding reused as the output layer (one leaf, two uses), plus a never-used parameter."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.ones(3))  # registered first: alone in the last bucket
        self.emb = nn.Embedding(VOCAB, 8)
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.fc2(torch.relu(self.fc1(self.norm(h))))
        return F.linear(h, self.emb.weight)


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, VOCAB, (2, n, 5), generator=g)
    return ids, targets


def loss_fn(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).float().flatten(0, 1), targets.flatten())


def serial_grads(model: nn.Module, ids, targets) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    loss_fn(ref, ids, targets).backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def accumulate(ddp: DataParallel, ids, targets, micro: int, probe=None) -> list:
    """One step's backward passes, all but the last inside no_sync(); ``probe()`` after each."""
    seen = []
    for i, (x, y) in enumerate(zip(ids.chunk(micro), targets.chunk(micro))):
        with contextlib.nullcontext() if i == micro - 1 else ddp.no_sync():
            (loss_fn(ddp.module, x, y) / micro).backward()
        seen.append(probe() if probe else None)
    return seen


def test_accumulation_equals_one_big_batch(monkeypatch):
    """dp=1: four micro-batches of 2 give the gradients of one batch of 8 (fp32 sums in another
    order, hence 1e-6), with no collective at all."""
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("collective at dp=1"))
    torch.manual_seed(0)
    model = TiedNet()
    ids, targets = batch(8)
    expected = serial_grads(model, ids, targets)
    ddp = DataParallel(model, ParallelState.serial(torch.device("cpu")), BUCKET_MB)
    accumulate(ddp, ids, targets, micro=4)
    ddp.finish_grad_sync()
    for name, p in model.named_parameters():
        assert p.grad is None
        if name == "unused":
            assert not p.main_grad.any()
        else:
            torch.testing.assert_close(p.main_grad, expected[name], rtol=1e-6, atol=1e-7)


def test_bf16_gradients_accumulate_in_fp32():
    torch.manual_seed(0)
    model = TiedNet().to(torch.bfloat16)
    ids, targets = batch(4)
    expected = {}
    for x, y in zip(ids.chunk(2), targets.chunk(2)):
        ref = copy.deepcopy(model)
        (loss_fn(ref, x, y) / 2).backward()
        for n, p in ref.named_parameters():
            if p.grad is not None:
                expected[n] = expected.get(n, 0) + p.grad.float()
    ddp = DataParallel(model, ParallelState.serial(torch.device("cpu")), BUCKET_MB)
    accumulate(ddp, ids, targets, micro=2)
    ddp.finish_grad_sync()
    for name, p in model.named_parameters():
        if name != "unused":
            assert p.main_grad.dtype == torch.float32 and torch.equal(p.main_grad, expected[name])


def test_backward_after_reduction_is_refused():
    model = TiedNet()
    ids, targets = batch(2)
    ddp = DataParallel(model, ParallelState.serial(torch.device("cpu")), BUCKET_MB)
    loss_fn(model, ids, targets).backward()
    assert all(b.launched for b in ddp.buckets[:-1])  # the unused parameter's waits for finish
    with pytest.raises(RuntimeError, match="no_sync"):
        loss_fn(model, ids, targets).backward()


def _dp_child() -> dict:
    from megatron.parallel.state import initialize

    state = initialize(tp_size=1)  # DP=2
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return real(*args, **kwargs)

    dist.all_reduce = counting  # this child only: count the DP collectives
    torch.manual_seed(0)
    model = TiedNet()
    ids, targets = batch(8)
    expected = serial_grads(model, ids, targets)
    ddp = DataParallel(model, state, BUCKET_MB)
    mine = slice(4 * state.dp_rank, 4 * state.dp_rank + 4)
    steps = []
    for _ in range(2):  # a second step checks that finish/zero reset every bucket
        counts = accumulate(ddp, ids[mine], targets[mine], micro=2, probe=lambda: len(calls))
        ddp.finish_grad_sync()
        counts.append(len(calls))
        steps.append(({n: p.main_grad.clone() for n, p in model.named_parameters()}, counts))
        assert all(p.grad is None for p in model.parameters())
        ddp.zero_grad_buffer()
        calls.clear()
    assert all(group is state.dp_group for group in calls)
    return {
        "steps": steps,
        "expected": expected,
        "buckets": [len(b.params) for b in ddp.buckets],
        "sharded": _sharded(state, ids, targets, expected),
    }


def _sharded(state: ParallelState, ids, targets, expected) -> dict:
    """The same step with ``shard_optimizer``: one reduce-scatter per bucket, no all-reduce, the
    DP mean in this rank's slices; then the parameters' all-gather from their owners."""
    calls = []
    real = dist.reduce_scatter_single

    def counting(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counting
    torch.manual_seed(0)
    model = TiedNet()
    ddp = DataParallel(model, state, BUCKET_MB, shard_optimizer=True)
    mine = slice(4 * state.dp_rank, 4 * state.dp_rank + 4)
    accumulate(ddp, ids[mine], targets[mine], micro=2)
    ddp.finish_grad_sync()
    counts = len(calls)
    assert all(group is state.dp_group for group in calls)
    # The serial gradient laid out in buffer order; compare this rank's slice of every bucket.
    serial = torch.zeros_like(ddp.buffer)
    for name, p in model.named_parameters():
        offset = ddp.offsets[id(p)]
        if name in expected:
            serial[offset : offset + p.numel()] = expected[name].flatten()
    owned = [(b.start + b.shard.start, b.start + b.shard.stop) for b in ddp.buckets]
    for lo, hi in owned:
        torch.testing.assert_close(ddp.buffer[lo:hi], serial[lo:hi], rtol=1e-6, atol=1e-7)
    views = all(
        p.data_ptr() == ddp.param_buffer[ddp.offsets[id(p)] :].data_ptr()
        for p in model.parameters()
    )
    with torch.no_grad():  # as the optimizer does: write only the owned slices, then gather
        for lo, hi in owned:
            ddp.param_buffer[lo:hi] = state.dp_rank + 1.0
        ddp.gather_params()
    return {
        "counts": counts,
        "sizes": [b.flat.numel() for b in ddp.buckets],
        "numels": [b.numel for b in ddp.buckets],
        "views": views,
        "params": ddp.param_buffer.clone(),
        "owned": owned,
    }


@pytest.mark.slow
def test_dp2_equals_serial_and_communicates_once_per_bucket():
    """Each of 2 ranks runs 2 micro-batches of 2 samples; the DP mean of the accumulated
    gradients equals the serial gradient of all 8 samples (1e-6: summation order)."""
    results = run_distributed(_dp_child, 2)
    for r in results:
        buckets = r["buckets"]
        assert len(buckets) == 3 and max(buckets) > 1 and buckets[-1] == 1
        (first, counts), (second, counts2) = r["steps"]
        # Nothing during the no_sync micro-batch; every bucket but the one holding the unused
        # parameter launched during the last backward; that one in finish_grad_sync().
        assert counts == counts2 == [0, len(buckets) - 1, len(buckets)]
        for name, grad in first.items():
            assert torch.equal(grad, second[name])
            if name == "unused":
                assert not grad.any()
            else:
                torch.testing.assert_close(grad, r["expected"][name], rtol=1e-6, atol=1e-7)
    # With shard_optimizer: buckets padded to a multiple of DP (the unused 3-vector to 4), one
    # reduce-scatter each, and after the gather every rank holds every owner's values.
    ranks = [r["sharded"] for r in results]
    for r in ranks:
        assert r["counts"] == len(r["sizes"]) and r["views"]
        assert [-(-n // 2) * 2 for n in r["numels"]] == r["sizes"] and r["numels"][-1] == 3
        assert torch.equal(r["params"], ranks[0]["params"])
    for dp_rank, r in enumerate(ranks):
        for lo, hi in r["owned"]:
            assert (ranks[0]["params"][lo:hi] == dp_rank + 1.0).all()
