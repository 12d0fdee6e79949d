"""DistributedOptimizer (ZeRO-1) against MixedPrecisionOptimizer: in-process at DP=1 (bit-exact,
the state API and its round trips), and on real processes at TP1xDP2, TP2xDP2 and TP1xDP4 on a
tiny GPT: losses, grad norms and parameters after 20 iterations, fp32 and fp16 with dynamic loss
scaling and an injected overflow, and the assembled shards against the plain optimizer's state."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import OptimizerConfig, PrecisionConfig
from megatron.optim.build import build_optimizer
from megatron.optim.distributed_optimizer import DistributedOptimizer, assemble
from megatron.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.optim.optimizer import MixedPrecisionOptimizer
from megatron.parallel.data_parallel import DataParallel
from megatron.parallel.state import ParallelState
from tests.distributed import run_distributed
from tests.test_optimizer import CFG, Tiny  # the same toy model and settings

SERIAL = ParallelState.serial(torch.device("cpu"))
BUCKET_MB = 100 * 4 / 2**20  # 100 fp32 values: several buckets
TINY_YAML = str(Path(__file__).resolve().parent.parent / "configs" / "gpt_tiny.yaml")


def loss_of(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids, targets = torch.randint(0, 11, (2, 4, 5), generator=g)
    return F.cross_entropy(model(ids).float().view(-1, 11), targets.view(-1)) * 20


def make(dtype: torch.dtype, distributed: bool, scaler=None):
    torch.manual_seed(0)
    model = Tiny().to(dtype)
    ddp = DataParallel(model, SERIAL, BUCKET_MB, shard_optimizer=distributed)
    scaler = scaler or ConstantGradScaler()
    if distributed:
        return model, ddp, DistributedOptimizer(ddp, CFG, scaler, SERIAL)
    return model, ddp, MixedPrecisionOptimizer(list(model.named_parameters()), CFG, scaler, SERIAL)


def train(model, ddp, opt, steps: range) -> list[float]:
    norms = []
    for step in steps:
        opt.scale_loss(loss_of(model, step)).backward()
        ddp.finish_grad_sync()
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
        ddp.zero_grad_buffer()
    return norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dp1_is_bit_identical_to_the_plain_optimizer(dtype):
    """One DP rank owns every bucket: the same elementwise AdamW over the same values."""
    plain, distributed = make(dtype, False), make(dtype, True)
    assert train(*plain, range(3)) == train(*distributed, range(3))
    for p, q in zip(plain[0].parameters(), distributed[0].parameters()):
        assert torch.equal(p, q)
    # The parameters now live in the flat buffer, and the loop still reaches them.
    ddp = distributed[1]
    for p in distributed[0].parameters():
        offset = ddp.offsets[id(p)]
        assert p.data_ptr() == ddp.param_buffer[offset:].data_ptr()


def test_state_bytes():
    """fp32: both optimizers hold two moments per element (the parameters are the main copy, for
    the distributed one its parameter buffer); bf16: both hold main + moments. DP=1: the shard is
    the whole, unpadded buffer."""
    numel = sum(p.numel() for p in Tiny().parameters())
    for dtype, per_element in ((torch.float32, 8), (torch.bfloat16, 12)):
        for sharded in (False, True):
            assert make(dtype, sharded)[2].state_bytes() == per_element * numel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_round_trips_through_both_formats(dtype):
    """After two steps: assemble(layout, [shard_state]) is the plain optimizer's state_dict;
    that state loaded into a fresh distributed optimizer (and the plain state into a fresh plain
    one) continues bit-identically; the host step count survives."""
    plain = make(dtype, False, DynamicGradScaler(initial_scale=2.0**8))
    distributed = make(dtype, True, DynamicGradScaler(initial_scale=2.0**8))
    train(*plain, range(2))
    train(*distributed, range(2))
    opt = distributed[2]
    shard = opt.shard_state()
    assert shard["step"] == 2 and isinstance(shard["step"], int)
    assert set(shard) == {"main", "exp_avg", "exp_avg_sq", "step"}
    expected = plain[2].state_dict()["params"]
    assembled = assemble(opt.layout(), [shard])
    assert assembled.keys() == expected.keys()
    for name, entry in expected.items():
        assert assembled[name].keys() == entry.keys() and assembled[name]["step"] == 2
        for key, value in entry.items():
            if key != "step":
                assert torch.equal(assembled[name][key], value), (name, key)
    assert opt.state_dict()["params"].keys() == expected.keys()
    state, weights = copy.deepcopy(plain[2].state_dict()), copy.deepcopy(plain[0].state_dict())
    twins = [make(dtype, d, DynamicGradScaler()) for d in (True, False)]
    for model, _, twin_opt in twins:
        model.load_state_dict(weights)
        twin_opt.load_state_dict(copy.deepcopy(state))
        assert twin_opt.scaler.scale == 2.0**8
    expected_norms = train(*plain, range(2, 4))
    for twin in twins:
        assert train(*twin, range(2, 4)) == expected_norms
        for p, q in zip(twin[0].parameters(), plain[0].parameters()):
            assert torch.equal(p, q)


def test_assemble_interleaves_ranks_bucket_by_bucket():
    """A hand-made DP=2 layout: bucket 0 holds a [2, 3] matrix (6 values, no padding), bucket 1
    a 3-vector padded to 4; rank r's shard is its half of bucket 0, then its half of bucket 1."""
    layout = {
        "dp_size": 2,
        "main_is_param": False,
        "buckets": [{"start": 0, "numel": 6, "size": 6}, {"start": 6, "numel": 3, "size": 4}],
        "params": [
            {"name": "w", "shape": [2, 3], "offset": 0},
            {"name": "b", "shape": [3], "offset": 6},
        ],
    }
    flat = torch.arange(10.0)
    shards = [
        {"main": torch.cat([flat[0:3], flat[6:8]]), "step": 5},
        {"main": torch.cat([flat[3:6], flat[8:10]]), "step": 5},
    ]
    for shard, sign in zip(shards, (1, -1)):
        shard["exp_avg"], shard["exp_avg_sq"] = sign * shard["main"], shard["main"] ** 2
    out = assemble(layout, shards)
    assert torch.equal(out["w"]["main"], flat[:6].view(2, 3))
    assert torch.equal(out["b"]["main"], flat[6:9])
    assert torch.equal(out["w"]["exp_avg"], torch.tensor([[0.0, 1, 2], [-3, -4, -5]]))
    assert out["b"]["step"] == 5
    layout["main_is_param"] = True
    assert "main" not in assemble(layout, shards)["w"]
    with pytest.raises(ValueError, match="2 DP ranks"):
        assemble(layout, shards[:1])


def test_build_optimizer_follows_data_parallel():
    model = Tiny()
    ddp = DataParallel(model, SERIAL, shard_optimizer=True)
    opt = build_optimizer(model, CFG, PrecisionConfig(), SERIAL, ddp)
    assert isinstance(opt, DistributedOptimizer)
    plain = build_optimizer(model, CFG, PrecisionConfig(), SERIAL, DataParallel(Tiny(), SERIAL))
    assert isinstance(plain, MixedPrecisionOptimizer)


# The multi-process comparison: a tiny GPT, 2 micro-batches of 2 sequences per DP rank.
VOCAB, ITERS, OVERFLOW_AT = 100, 20, 3
GPT_CFG = OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.3, lr_warmup_iters=0)
GPT_BUCKET_MB = 2000 * 4 / 2**20  # about 2000 values: a dozen buckets, some of one parameter


def train_tiny_gpt(
    state: ParallelState,
    dtype: str,
    distributed: bool,
    overlap: bool = False,
    bucket_mb: float = GPT_BUCKET_MB,
    iters: int = ITERS,
) -> dict:
    """``iters`` iterations of the real model, DataParallel and optimizer; fp16 with a dynamic
    loss scale and, at OVERFLOW_AT, an inf in the last rank's loss (so in its gradients). Per
    step also the parameter all-gathers pending after the first forward and after the step
    (``overlap``: DataParallel's overlap_param_gather)."""
    from megatron.config.dtypes import DTYPES
    from megatron.models.gpt import GPTModel
    from megatron.parallel.random import RNGTracker
    from tests.model_config import tiny_model_config

    tracker = RNGTracker(state.device)
    tracker.seed(1234, state.tp_rank)
    padded = -(-VOCAB // (128 * state.tp_size)) * 128 * state.tp_size
    model = GPTModel(tiny_model_config(), VOCAB, padded, state, tracker).to(DTYPES[dtype])
    ddp = DataParallel(
        model, state, bucket_mb, shard_optimizer=distributed, overlap_param_gather=overlap
    )
    precision = PrecisionConfig(dtype=dtype, initial_loss_scale=2.0**10, hysteresis=1)
    opt = build_optimizer(model, GPT_CFG, precision, state, ddp)
    assert isinstance(opt, DistributedOptimizer) == distributed
    results: dict = {k: [] for k in ("loss", "norm", "skipped", "scale", "pending", "left")}
    for it in range(iters):
        g = torch.Generator().manual_seed(1000 * it + state.dp_rank)
        tokens = torch.randint(0, VOCAB, (2, 2, 17), generator=g)  # [micro, b, s + 1]
        total = 0.0
        for micro in range(2):
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                loss = model(tokens[micro, :, :-1], labels=tokens[micro, :, 1:]).mean() / 2
                if micro == 0:
                    results["left"].append(sum(b.gather is not None for b in ddp.buckets))
                if dtype == "fp16" and it == OVERFLOW_AT and state.rank == state.world_size - 1:
                    loss = loss * float("inf")
                opt.scale_loss(loss).backward()
            total += loss.item()
        ddp.finish_grad_sync()
        result = opt.step()
        opt.zero_grad()
        ddp.zero_grad_buffer()
        results["pending"].append(sum(b.gather is not None for b in ddp.buckets))
        results["loss"].append(total)
        results["norm"].append(result.grad_norm)
        results["skipped"].append(result.found_inf)
        results["scale"].append(result.loss_scale)
    ddp.wait_param_gather()  # as the training loop's end does
    results["params"] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    # The per-parameter state: the plain optimizer's own, the distributed one's gathered over DP.
    results["state"] = copy.deepcopy(opt.state_dict()["params"])
    return results


def _layouts_child(tps: list[int]) -> dict:
    """Both settings at each TP size in ``tps`` (groups rebuilt over the same world)."""
    from megatron.parallel.state import initialize

    results = {}
    for tp in tps:
        state = initialize(tp_size=tp)
        for dtype in ("fp32", "fp16"):
            for distributed in (False, True):
                results[(tp, dtype, distributed)] = train_tiny_gpt(state, dtype, distributed)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world, tps", [(2, [1]), (4, [1, 2])])
def test_distributed_optimizer_matches_the_plain_one(world, tps):
    """TP1xDP2; TP1xDP4 and TP2xDP2: losses, grad norms, parameters and the gathered optimizer
    state within 1e-5 (relative) after 20 iterations, fp32 and fp16 with the same skipped step
    and loss scales. Only summation order could differ (the reduce-scatter against the
    all-reduce, the sharded against the whole norm); with the norm summed in fp64 it was found
    bit-identical here, but is not promised. Why not a looser bound: the key bias's gradient is
    zero in exact arithmetic (softmax ignores a constant per query), so Adam turns its rounding
    noise into lr-sized steps; a real difference in the gradients shows there first."""
    for rank in run_distributed(_layouts_child, world, tps, timeout=600):
        for tp in tps:
            for dtype in ("fp32", "fp16"):
                _compare(rank[(tp, dtype, False)], rank[(tp, dtype, True)])
            fp16 = rank[(tp, "fp16", True)]
            assert fp16["skipped"][OVERFLOW_AT] and sum(fp16["skipped"]) == 1
            assert fp16["scale"][OVERFLOW_AT + 1] == fp16["scale"][OVERFLOW_AT] / 2


def _compare(plain: dict, ours: dict) -> None:
    assert ours["skipped"] == plain["skipped"] and ours["scale"] == plain["scale"]
    assert ours["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    norms = [n for n, s in zip(plain["norm"], plain["skipped"]) if not s]
    assert [n for n, s in zip(ours["norm"], ours["skipped"]) if not s] == pytest.approx(
        norms, rel=1e-5
    )
    assert max(norms) > GPT_CFG.clip_grad  # clipping was active
    for name, value in plain["params"].items():
        torch.testing.assert_close(ours["params"][name], value, rtol=1e-5, atol=1e-6)
    for name, entry in plain["state"].items():
        assert ours["state"][name].keys() == entry.keys()
        for key, value in entry.items():
            if key == "step":
                assert ours["state"][name]["step"] == value
            else:
                torch.testing.assert_close(ours["state"][name][key], value, rtol=1e-5, atol=1e-6)
