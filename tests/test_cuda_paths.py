"""The CUDA subset: layers, loss, the optimizer in bf16 and fp16, and resume, on one device.

The rest of the suite pins CPU and gloo. These tests run on ``MEGATRON_TEST_DEVICE`` (``cuda``
or ``cpu``; default ``cuda`` when one is visible) and are skipped on a machine without CUDA
unless that variable asks for ``cpu`` (``scripts/gpu_check.sh --dry`` does, to rehearse them).
References are computed on the CPU in fp32, so a wrong CUDA kernel path shows as a mismatch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import OptimizerConfig
from megatron.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.optim.optimizer import MixedPrecisionOptimizer
from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear, normal_init
from megatron.parallel.state import ParallelState
from tests.gpt_run import read_metrics, run_pretrain, tiny_overrides
from tools.gpu_check.data import write_null_dataset

_ASKED = os.environ.get("MEGATRON_TEST_DEVICE")
DEVICE = torch.device(_ASKED or ("cuda" if torch.cuda.is_available() else "cpu"))
pytestmark = pytest.mark.skipif(
    _ASKED is None and DEVICE.type != "cuda",
    reason="no CUDA device (set MEGATRON_TEST_DEVICE=cpu to run on the CPU)",
)
# bf16 keeps 8 mantissa bits and fp16 11: tolerances relative to the largest magnitude.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    err = (a - b).abs().max() / b.abs().max().clamp_min(1e-12)
    assert err <= TOL[dtype], f"max relative error {err:.2e} > {TOL[dtype]:.0e} ({dtype})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_then_row_linear_match_nn_linear(dtype):
    """The MLP pattern at TP=1 on the device against nn.Linear in fp32 on the CPU."""
    state = ParallelState.serial(DEVICE)
    torch.manual_seed(0)
    col = ColumnParallelLinear(32, 64, state, normal_init(0.1)).to(dtype)
    row = RowParallelLinear(64, 32, state, normal_init(0.1)).to(dtype)
    ref_col, ref_row = nn.Linear(32, 64), nn.Linear(64, 32)
    for ref, ours in ((ref_col, col), (ref_row, row)):
        ref.load_state_dict({k: v.float().cpu() for k, v in ours.state_dict().items()})
    x = torch.randn(4, 8, 32)
    xd = x.to(DEVICE, dtype, copy=True).requires_grad_()
    xr = x.clone().requires_grad_()
    y, y_ref = row(col(xd)), ref_row(ref_col(xr))
    close(y, y_ref, dtype)
    y.float().pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    close(xd.grad, xr.grad, dtype)
    close(col.weight.grad, ref_col.weight.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_parallel_cross_entropy_matches_torch(dtype):
    """Padded logits in the model dtype; loss and gradient against F.cross_entropy in fp32."""
    vocab, padded = 250, 256
    torch.manual_seed(0)
    full = torch.randn(3, 5, padded) * 4
    target = torch.randint(0, vocab, (3, 5))
    logits = full.to(DEVICE, dtype, copy=True).requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target.to(DEVICE), vocab, None)
    assert loss.dtype == torch.float32
    ref_logits = full[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction="none")
    close(loss.view(-1), ref, torch.float32 if dtype == torch.float32 else torch.float16)
    loss.sum().backward()
    ref.sum().backward()
    close(logits.grad[..., :vocab], ref_logits.grad, dtype)
    assert not logits.grad[..., vocab:].any(), "padded logits must get no probability mass"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))


def _steps(
    device: torch.device,
    dtype: torch.dtype,
    scale: float,
    grads: list[list[torch.Tensor]],
    exact_in: torch.dtype,
) -> list[torch.Tensor]:
    """AdamW steps of ``_net`` in ``dtype`` on ``device``, fed ``grads`` times ``scale`` (what a
    scaled loss's backward gives); the fp32 main parameters after them. The initial weights are
    rounded to ``exact_in`` so the fp32 reference starts where the low-precision model does."""
    model = _net()
    for p in model.parameters():
        p.data = p.data.to(exact_in).float()
    model = model.to(device, dtype)
    scaler = DynamicGradScaler(initial_scale=scale) if scale != 1.0 else ConstantGradScaler()
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5)
    opt = MixedPrecisionOptimizer(
        list(model.named_parameters()), cfg, scaler, ParallelState.serial(device)
    )
    for step in grads:
        for p, g in zip(model.parameters(), step, strict=True):
            p.grad = (g * scale).to(device, dtype)
        assert opt.step().updated
        opt.zero_grad()
    return [p.detach().cpu() for p in opt.main_params]


@pytest.mark.parametrize("dtype, scale", [(torch.bfloat16, 1.0), (torch.float16, 2.0**10)])
def test_mixed_precision_optimizer_matches_cpu_fp32(dtype, scale):
    """bf16, and fp16 with a scaled loss: given the same gradients (values ``dtype`` holds
    exactly, scaled by a power of two), the device's unscale, clipping and AdamW on fp32 main
    parameters land where the CPU's fp32 steps do, up to fp32 rounding."""
    g = torch.Generator().manual_seed(1)
    shapes = [p.shape for p in _net().parameters()]
    grads = [[torch.randn(s, generator=g).to(dtype).float() for s in shapes] for _ in range(3)]
    ours = _steps(DEVICE, dtype, scale, grads, dtype)
    ref = _steps(torch.device("cpu"), torch.float32, 1.0, grads, dtype)
    for a, b in zip(ours, ref, strict=True):
        close(a, b, torch.float32)


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    torch.manual_seed(0)
    model = nn.Linear(4, 4).to(DEVICE, torch.float16)
    scaler = DynamicGradScaler(initial_scale=2.0**8, hysteresis=1)
    opt = MixedPrecisionOptimizer(
        list(model.named_parameters()),
        OptimizerConfig(lr=1e-2),
        scaler,
        ParallelState.serial(DEVICE),
    )
    before = model.weight.detach().clone()
    opt.scale_loss(model(torch.randn(2, 4, device=DEVICE, dtype=torch.float16)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")
    result = opt.step()
    assert not result.updated and result.found_inf and scaler.scale == 2.0**7
    assert torch.equal(model.weight.detach(), before)


def _overrides(data: str, run: Path, **extra: object) -> list[str]:
    """``tiny_overrides`` on synthetic NullTokenizer data, bf16 at TP 1, saving to ``run``."""
    keys = {
        "parallel.tensor_parallel_size": 1,
        "tokenizer.type": "NullTokenizer",
        "tokenizer.vocab_size": 255,
        "data.split": "1,0,0",
        "training.train_iters": 6,
        "training.eval_iters": 0,
        "precision.dtype": "bf16",
        "optimizer.lr_warmup_iters": 1,
        "model.hidden_dropout": 0.1,
        "model.attention_dropout": 0.1,
        "checkpoint.save": run / "ckpt",
        **extra,
    }
    return tiny_overrides({"tokenizer": "null", "data": data}, run, **keys)


@pytest.mark.slow
def test_resume_on_the_device_is_bit_exact(tmp_path):
    """6 iterations straight, and 3 + exit + 3 in a new process: the same losses (dropout on, so
    the saved RNG states are exercised too), bit for bit on the CPU."""
    data = write_null_dataset(str(tmp_path / "ids"), vocab_size=255, tokens=20_000, seed=0)
    env = {"CUDA_VISIBLE_DEVICES": ""} if DEVICE.type == "cpu" else None
    losses = {}
    for name, stops in (("straight", [None]), ("resumed", [3, None])):
        run = tmp_path / name
        for stop in stops:
            extra = {} if stop is None else {"training.exit_interval": stop}
            run_pretrain(
                "pretrain_gpt.py", "configs/gpt_tiny.yaml", _overrides(data, run, **extra), env=env
            )
        losses[name] = [e["lm_loss"] for e in read_metrics(run / "metrics.jsonl")]
    assert len(losses["straight"]) == 6 and len(losses["resumed"]) == 6
    if DEVICE.type == "cpu":
        assert losses["resumed"] == losses["straight"]
    else:
        # CUDA's attention and embedding backward kernels accumulate with atomics, so two runs
        # of the same steps may differ in the last bits even without a restart.
        for a, b in zip(losses["resumed"], losses["straight"], strict=True):
            assert abs(a - b) <= 1e-3 * abs(b), (losses["resumed"], losses["straight"])
