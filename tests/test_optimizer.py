"""MixedPrecisionOptimizer: AdamW + clipping against torch's, loss scaling, overflow skips,
bf16 main params, name-keyed state dicts; and, on real processes, the TP-aware clipped norm
against the serial model's and the world-wide agreement to skip."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import OptimizerConfig, PrecisionConfig
from megatron.errors import ConfigError
from megatron.optim.build import build_optimizer
from megatron.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.optim.optimizer import MixedPrecisionOptimizer
from megatron.parallel.state import ParallelState
from tests.distributed import run_distributed

CFG = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, adam_beta2=0.95)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 6)
        self.out = nn.Linear(6, 11, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(self.norm(self.emb(ids)))))


def loss_of(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids, targets = torch.randint(0, 11, (2, 2, 5), generator=g)
    logits = model(ids).float()
    return F.cross_entropy(logits.view(-1, 11), targets.view(-1)) * 20  # big grads: clipping bites


def make(dtype=torch.float32, scaler=None, cfg=CFG):
    torch.manual_seed(0)
    model = Tiny().to(dtype)
    opt = MixedPrecisionOptimizer(
        list(model.named_parameters()),
        cfg,
        scaler or ConstantGradScaler(),
        ParallelState.serial(torch.device("cpu")),
    )
    return model, opt


def test_decay_groups():
    _, opt = make()
    decay, no_decay = opt.inner.param_groups
    names = {id(m): n for n, m in zip(opt.names, opt.main_params)}
    assert sorted(names[id(p)] for p in decay["params"]) == [
        "emb.weight",
        "fc.weight",
        "out.weight",
    ]
    assert sorted(names[id(p)] for p in no_decay["params"]) == [
        "fc.bias",
        "norm.bias",
        "norm.weight",
    ]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


def test_fp32_matches_torch_adamw_with_clipping():
    """Same updates as torch's clip_grad_norm_ + AdamW; the clip coefficient is computed in fp64
    here and fp32 there, hence a last-bit tolerance."""
    model, opt = make()
    ref = copy.deepcopy(model)
    decay = [p for n, p in ref.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in ref.named_parameters() if p.ndim < 2]
    ref_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=True,
    )
    for step, lr in enumerate([1e-2, 5e-3, 2e-3]):
        opt.set_lr(lr)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        loss_of(model, step).backward()
        result = opt.step()
        loss_of(ref, step).backward()
        norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        assert result.updated and not result.found_inf and result.loss_scale == 1.0
        assert result.grad_norm == pytest.approx(norm.item(), rel=1e-6)
        assert result.grad_norm > 0.5  # clipping was active
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            assert p.grad is None


def test_loss_scaling_is_exact():
    """A power-of-two loss scale, unscaled before the norm: bit-identical to no scaling."""
    scaled, opt = make(scaler=DynamicGradScaler(initial_scale=2.0**12))
    plain, ref = make()
    for step in range(3):
        opt.scale_loss(loss_of(scaled, step)).backward()
        loss_of(plain, step).backward()
        a, b = opt.step(), ref.step()
        assert a.grad_norm == b.grad_norm and a.loss_scale == 2.0**12
    for p, q in zip(scaled.parameters(), plain.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "dtype, bad", [(torch.float32, float("inf")), (torch.bfloat16, float("nan"))]
)
def test_non_finite_gradient_skips_everything(dtype, bad):
    scaler = DynamicGradScaler(initial_scale=4.0, hysteresis=1)
    model, opt = make(dtype, scaler)
    before = copy.deepcopy(model.state_dict())
    opt.scale_loss(loss_of(model, 0)).backward()
    model.fc.weight.grad[0, 0] = bad
    result = opt.step()
    assert not result.updated and result.found_inf and result.loss_scale == 4.0
    assert scaler.scale == 2.0  # hysteresis 1: the first overflow halves
    for adam in opt.inner.state.values():  # the fused kernel read the flag: no moment, no step
        assert adam["step"] == 0 and not adam["exp_avg"].any() and not adam["exp_avg_sq"].any()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert all(p.grad is None for p in model.parameters())


def test_bf16_keeps_fp32_main_params():
    cfg = OptimizerConfig(lr=1e-5, weight_decay=0.0, clip_grad=0.0)
    model, opt = make(torch.bfloat16, cfg=cfg)
    start = [m.clone() for m in opt.main_params]
    assert all(
        m.dtype == torch.float32 and p.dtype == torch.bfloat16
        for p, m in zip(model.parameters(), opt.main_params)
    )
    loss_of(model, 0).backward()
    assert opt.step().updated
    for p, m, s in zip(model.parameters(), opt.main_params, start):
        assert not torch.equal(m, s)  # updates too small for bf16 still land in the main copy
        assert torch.equal(p, m.to(torch.bfloat16))


def test_main_grad_is_preferred():
    model, opt = make()
    loss_of(model, 0).backward()
    for p in model.parameters():
        p.main_grad, p.grad = p.grad.clone(), None
    weight = model.fc.weight.clone()
    assert opt.step().updated and not torch.equal(weight, model.fc.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(dtype):
    """Save after two steps, load into a fresh copy, take a third step: identical to the bit."""
    model, opt = make(dtype, DynamicGradScaler(initial_scale=2.0**8))
    for step in range(2):
        opt.scale_loss(loss_of(model, step)).backward()
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    assert set(state["params"]) == {n for n, _ in model.named_parameters()}
    entry = state["params"]["fc.weight"]
    assert entry["step"] == 2 and entry["exp_avg"].shape == model.fc.weight.shape
    assert ("main" in entry) == (dtype != torch.float32)
    twin = copy.deepcopy(model)
    twin_opt = MixedPrecisionOptimizer(
        list(twin.named_parameters()),
        CFG,
        DynamicGradScaler(),
        ParallelState.serial(torch.device("cpu")),
    )
    twin_opt.load_state_dict(state)
    assert twin_opt.scaler.scale == 2.0**8
    for m, o in ((model, opt), (twin, twin_opt)):
        o.scale_loss(loss_of(m, 2)).backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_state_dict_step_is_a_host_count(monkeypatch):
    """The step count comes from the host (no device read per parameter); a skipped step does
    not count; the count survives load_state_dict."""
    model, opt = make(scaler=DynamicGradScaler(initial_scale=4.0, hysteresis=1))
    for step in range(3):
        opt.scale_loss(loss_of(model, step)).backward()
        if step == 1:
            model.fc.weight.grad[0, 0] = float("inf")
        opt.step()

    def device_read(*args):
        raise AssertionError("state_dict read a device value")

    with monkeypatch.context() as patch:
        for name in ("__int__", "__float__", "item", "tolist"):
            patch.setattr(torch.Tensor, name, device_read)
        state = copy.deepcopy(opt.state_dict())
    assert {entry["step"] for entry in state["params"].values()} == {2}
    twin_model, twin = make()
    twin_model.load_state_dict(model.state_dict())
    twin.load_state_dict(state)
    loss_of(twin_model, 3).backward()
    twin.step()
    assert {entry["step"] for entry in twin.state_dict()["params"].values()} == {3}


def test_state_dict_mismatch_is_a_config_error():
    model, opt = make()
    loss_of(model, 0).backward()
    opt.step()
    state = opt.state_dict()
    other = MixedPrecisionOptimizer(
        [("fc.weight", nn.Parameter(torch.zeros(6, 8)))],
        CFG,
        ConstantGradScaler(),
        ParallelState.serial(torch.device("cpu")),
    )
    with pytest.raises(ConfigError, match="does not match the model"):
        other.load_state_dict(state)
    wrong = copy.deepcopy(state)
    wrong["params"]["fc.weight"]["exp_avg"] = torch.zeros(3, 8)
    with pytest.raises(ConfigError, match="reshard"):
        make()[1].load_state_dict(wrong)


def test_build_optimizer_picks_the_scaler():
    model = Tiny().half()
    opt = build_optimizer(
        model, CFG, PrecisionConfig(dtype="fp16"), ParallelState.serial(torch.device("cpu"))
    )
    assert opt.scaler.dynamic and opt.scaler.scale == 2.0**32


def _tp_child() -> dict:
    """TP=2 x DP=2. A hand-sharded net: replicated LayerNorm -> f -> column-split Linear (weight
    and bias carry tp_split_dim=0). The serial net, run on every rank, is the reference."""
    from megatron.parallel.mappings import copy_to_tp
    from megatron.parallel.state import initialize

    state = initialize(tp_size=2)
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)

    serial = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 6))
    with torch.no_grad():
        serial[1].weight.copy_(w), serial[1].bias.copy_(b)
    serial_opt = MixedPrecisionOptimizer(
        list(serial.named_parameters()),
        cfg,
        ConstantGradScaler(),
        ParallelState.serial(torch.device("cpu")),
    )
    serial(x).square().sum().backward()
    serial_result = serial_opt.step()

    rows = slice(3 * state.tp_rank, 3 * state.tp_rank + 3)
    norm = nn.LayerNorm(8)
    weight, bias = nn.Parameter(w[rows].clone()), nn.Parameter(b[rows].clone())
    weight.tp_split_dim = bias.tp_split_dim = 0
    named = [("norm.weight", norm.weight), ("norm.bias", norm.bias), ("w", weight), ("b", bias)]
    opt = MixedPrecisionOptimizer(named, cfg, ConstantGradScaler(), state)

    def backward(poison: bool) -> None:
        local = F.linear(copy_to_tp(norm(x), state.tp_group), weight, bias)
        local.square().sum().backward()  # the serial loss is the sum over TP ranks of these
        if poison:
            weight.grad[0, 0] = float("inf")

    backward(False)
    result = opt.step()
    gathered = [torch.empty_like(weight) for _ in range(2)]
    dist.all_gather(gathered, weight.detach(), group=state.tp_group)
    backward(poison=state.rank == 3)
    skipped = opt.step()
    return {
        "norm": result.grad_norm,
        "serial_norm": serial_result.grad_norm,
        "weight": torch.cat(gathered),
        "serial_weight": serial[1].weight.detach(),
        "ln": norm.weight.detach(),
        "serial_ln": serial[0].weight.detach(),
        "skipped": (skipped.updated, skipped.found_inf),
    }


@pytest.mark.slow
def test_tp_clipped_norm_equals_serial_and_skip_is_world_wide():
    """The TP=2 pre-clip norm and the clipped update equal the serial model's; tolerance 1e-6
    relative for the different float summation order of the split squared norm."""
    for r in run_distributed(_tp_child, 4):
        assert r["norm"] == pytest.approx(r["serial_norm"], rel=1e-6)
        assert r["serial_norm"] > 1.0  # clipping was active
        torch.testing.assert_close(r["weight"], r["serial_weight"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(r["ln"], r["serial_ln"], rtol=1e-6, atol=1e-7)
        # Only rank 3 saw an inf; ranks 0 and 1 (another TP group, no DP sync here) learn of it
        # only through the world-wide flag, and skip too.
        assert r["skipped"] == (False, True)
