"""The GPU fast path of the TP linears and the DP sync, on CPU gloo against the plain path.

- The overlapped column-parallel backward (input-gradient all-reduce in flight while the weight
  gradient is computed) runs the same kernels on the same operands as f + F.linear, so outputs
  and every gradient are bit-identical, and a layer still issues two all-reduces each way.
- Gradient-accumulation fusion adds the weight gradient into the fp32 ``main_grad`` computed in
  fp32 from the bf16 operands: it equals that fp32 product summed over micro-batches (1e-6:
  addmm's accumulation order), not the unfused path, whose bf16 ``.grad`` is rounded before the
  upcast (that path is only within bf16 rounding, 1e-2). No bf16 ``.grad`` ever exists for the
  fused weights; every other parameter keeps the unfused path, bit for bit.
- DP averaging: ReduceOp.AVG on NCCL, divide-then-SUM on gloo; with a backend that claims AVG
  (faked on gloo), the averaged buffers are the same bits.
- A few TP=2 training steps of a bf16 GPT with all of it on give the losses of all of it off.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import OptimizerConfig, PrecisionConfig
from megatron.models.gpt import GPTModel
from megatron.models.transformer import TransformerLayer
from megatron.optim.build import build_optimizer
from megatron.parallel.data_parallel import DataParallel, mean_op
from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear, normal_init
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState, initialize
from tests.distributed import run_distributed
from tests.model_config import tiny_model_config
from tests.test_data_parallel import TiedNet, accumulate, batch

LINEARS = (ColumnParallelLinear, RowParallelLinear)


def set_fast_path(model: nn.Module, overlap: bool, fusion: bool | None = None) -> None:
    """Force the overlapped backward (CPU leaves it off) and the fusion (default: as overlap)."""
    for m in model.modules():
        if isinstance(m, ColumnParallelLinear):
            m.async_grad_allreduce = overlap and m.group is not None
        if isinstance(m, LINEARS):
            m.gradient_accumulation_fusion = overlap if fusion is None else fusion


def _overlap_child() -> dict:
    st = initialize(2)
    out = {}
    for on in (False, True):
        torch.manual_seed(1)
        col = ColumnParallelLinear(8, 12, st, normal_init(0.02))
        with torch.no_grad():
            col.bias.uniform_()  # a non-zero bias, so its gradient path is exercised too
        set_fast_path(col, on)
        torch.manual_seed(2 + st.tp_rank)  # different inputs per rank: the reduce is needed
        x = torch.randn(3, 5, 8, requires_grad=True)
        y = col(x)
        y.pow(2).sum().backward()
        out[on] = [y.detach(), x.grad, col.weight.grad, col.bias.grad]
    return out


def test_overlapped_backward_equals_synchronous():
    for r in run_distributed(_overlap_child, 2):
        for sync, overlapped in zip(r[False], r[True], strict=True):
            assert torch.equal(sync, overlapped)


def _count_child() -> tuple[list, list]:
    st = initialize(2)
    tracker = RNGTracker(st.device)
    tracker.seed(0, st.tp_rank)
    layer = TransformerLayer(tiny_model_config(), st, tracker, 0)
    set_fast_path(layer, True)
    x = torch.randn(2, 8, 32, requires_grad=True)
    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(k.get("async_op", False)), real(*a, **k))[1]
    y = layer(x, None)
    forward = list(calls)
    calls.clear()
    y.sum().backward()
    return forward, list(calls)


def test_overlapped_layer_keeps_two_all_reduces_each_way():
    """Forward: g twice (synchronous); backward: the two column layers' reduces, now async."""
    for forward, backward in run_distributed(_count_child, 2):
        assert forward == [False, False] and backward == [True, True]


class MLP(nn.Module):
    """LayerNorm (unfused) -> column (fused weight, unfused bias) -> GeLU -> row (fused)."""

    def __init__(self, state: ParallelState):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc1 = ColumnParallelLinear(16, 24, state, normal_init(0.2))
        self.fc2 = RowParallelLinear(24, 16, state, normal_init(0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


def _mlp_run(fused: bool) -> tuple[nn.Module, dict, dict]:
    """Two bf16 micro-batches; returns the model, the fp32 reference weight gradients (each
    linear's captured bf16 operands dY and X, multiplied in fp32, summed over micro-batches), and
    what ``.grad`` held each time a parameter's gradient arrived."""
    st = ParallelState.serial(torch.device("cpu"))
    torch.manual_seed(0)
    model = MLP(st).to(torch.bfloat16)
    set_fast_path(model, fused)
    seen: dict[str, list] = {}
    for name, p in model.named_parameters():  # registered before DataParallel's: sees .grad
        p.register_post_accumulate_grad_hook(
            lambda p, n=name: seen.setdefault(n, []).append(p.grad)
        )
    ddp = DataParallel(model, st)
    operands: dict[str, list] = {}  # weight name -> [X, dY] of the current micro-batch

    def tap(name: str):
        def hook(module, args, y):
            operands[name] = [args[0].detach()]
            y.register_hook(lambda grad: operands[name].append(grad))

        return hook

    for name in ("fc1", "fc2"):
        getattr(model, name).register_forward_hook(tap(f"{name}.weight"))
    reference = {}
    for i in range(2):
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        with ddp.no_sync() if i == 0 else contextlib.nullcontext():
            (model(x).float().pow(2).mean() / 2).backward()
        for name, (inp, grad) in operands.items():
            x_2d, grad_2d = (
                inp.flatten(0, 1).float(),
                grad.flatten(0, 1).float(),
            )  # [t, in], [t, out]
            reference[name] = reference.get(name, 0) + grad_2d.t() @ x_2d
    ddp.finish_grad_sync()
    return model, reference, seen


def test_fused_main_grad_equals_the_fp32_product():
    fused, reference, seen = _mlp_run(True)
    plain, _, seen_plain = _mlp_run(False)
    for name, p in fused.named_parameters():
        q = dict(plain.named_parameters())[name]
        if name in reference:
            assert seen[name] == [None, None]  # no bf16 .grad, in either micro-batch
            assert all(g is not None and g.dtype == torch.bfloat16 for g in seen_plain[name])
            torch.testing.assert_close(p.main_grad, reference[name], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(q.main_grad, reference[name], rtol=1e-2, atol=1e-4)
        else:  # LayerNorm and biases: the unfused path, fed by identical input gradients
            assert all(g is not None for g in seen[name])
            assert torch.equal(p.main_grad, q.main_grad), name


def test_mean_op_by_backend():
    assert mean_op("nccl") == dist.ReduceOp.AVG
    assert mean_op("gloo") is None


def _avg_child() -> list[torch.Tensor]:
    """DP=2: the gloo path (divide, SUM), then a backend that claims AVG, faked with SUM and a
    division after the reduction; the flat buffers must agree bit for bit."""
    st = initialize(tp_size=1)
    real = dist.all_reduce

    def fake_avg(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        assert op == dist.ReduceOp.AVG  # nothing divided beforehand, so AVG is what it must do
        real(tensor, group=group)
        tensor.div_(dist.get_world_size(group))
        return None

    buffers = []
    for backend in ("gloo", "nccl"):
        torch.manual_seed(0)
        model = TiedNet()
        if backend == "nccl":
            dist.get_backend = lambda group=None: "nccl"
            dist.all_reduce = fake_avg
        ddp = DataParallel(model, st)
        ids, targets = batch(4)
        mine = slice(2 * st.dp_rank, 2 * st.dp_rank + 2)
        accumulate(ddp, ids[mine], targets[mine], micro=1)
        ddp.finish_grad_sync()
        buffers.append(ddp.buffer.clone())
    return buffers


def test_avg_equals_divide_then_sum():
    for gloo, avg in run_distributed(_avg_child, 2):
        assert torch.equal(gloo, avg)


def _train_child(steps: int) -> dict:
    """Losses of ``steps`` steps (two micro-batches each) per (dtype, overlap, fusion,
    recompute)."""
    st = initialize(2)
    runs = {}
    for dtype, overlap, fusion, recompute in [
        ("bf16", False, False, "none"),
        ("bf16", True, False, "none"),
        ("bf16", True, True, "none"),
        ("bf16", True, True, "full"),
        ("fp32", False, False, "none"),
        ("fp32", True, True, "none"),
    ]:
        tracker = RNGTracker(st.device)
        tracker.seed(1234, st.tp_rank)
        model = GPTModel(tiny_model_config(recompute=recompute), 250, 256, st, tracker)
        model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
        set_fast_path(model, overlap, fusion)
        ddp = DataParallel(model, st)
        optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3), PrecisionConfig(dtype), st)
        g = torch.Generator().manual_seed(7)
        losses = []
        for _ in range(steps):
            ddp.zero_grad_buffer()
            total = 0.0
            for i in range(2):
                data = torch.randint(0, 250, (2, 17), generator=g)
                with contextlib.nullcontext() if i == 1 else ddp.no_sync():
                    loss = model(data[:, :-1], labels=data[:, 1:]).mean() / 2
                    loss.backward()
                total += loss.item()
            ddp.finish_grad_sync()
            assert optimizer.step().updated
            losses.append(total)
        runs[dtype, overlap, fusion, recompute] = losses
    return runs


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_gpt_losses_with_fast_path_on_and_off():
    """TP=2, 4 steps. The overlap alone changes no bit. Fusion changes the weight gradients by
    the bf16 rounding the unfused path applies to each micro-batch's ``.grad`` (measured: 1.6e-5
    relative in the losses by step 3), so bf16 gets 1e-4; in fp32 only the summation order moves
    (1e-5, the project's bound for reordered float sums). Recomputation replays the same
    forward, so with fusion it changes no bit either (it once lost the weight's main_grad)."""
    runs = run_distributed(_train_child, 2, 4)[0]
    plain = runs["bf16", False, False, "none"]
    assert runs["bf16", True, False, "none"] == plain
    assert rel(runs["bf16", True, True, "none"], plain) <= 1e-4
    assert runs["bf16", True, True, "full"] == runs["bf16", True, True, "none"]
    assert rel(runs["fp32", True, True, "none"], runs["fp32", False, False, "none"]) <= 1e-5
