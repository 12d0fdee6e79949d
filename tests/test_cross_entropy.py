"""Vocab-parallel cross entropy against F.cross_entropy on the gathered, unpadded logits."""

import pytest
import torch
import torch.nn.functional as F

from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.state import initialize
from tests.distributed import run_distributed
from tests.test_layers import close, gather_param


def _check(tp: int, vocab: int, padded: int, dtype: torch.dtype) -> None:
    st = initialize(tp)
    torch.manual_seed(0)
    full = (torch.randn(3, 5, padded) * 4).to(dtype)
    # Targets cover every rank's range, including both ends of each.
    per = padded // tp
    edges = [i * per for i in range(tp)] + [min((i + 1) * per, vocab) - 1 for i in range(tp)]
    target = torch.randint(0, vocab, (3, 5))
    target.view(-1)[: len(edges)] = torch.tensor(edges)
    local = full[..., st.tp_rank * per : (st.tp_rank + 1) * per].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, vocab, st.tp_group)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    ref_logits = full[..., :vocab].float().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction="none").view(3, 5)
    close(loss, ref, tol=1e-6)
    weights = torch.rand(3, 5)
    (loss * weights).sum().backward()
    (ref * weights).sum().backward()
    grad = gather_param(local.grad.float(), -1, st.tp_group)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the bf16 gradient is rounded to bf16
    close(grad[..., :vocab], ref_logits.grad, tol=tol)
    assert not grad[..., vocab:].any(), "padded logits must get no probability mass"


def test_cross_entropy_single_rank_with_padding():
    run_distributed(_check, 1, 1, 100, 128, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_cross_entropy_matches_serial(tp):
    run_distributed(_check, tp, tp, 64 * tp - 5, 64 * tp, torch.float32)


@pytest.mark.slow
def test_cross_entropy_bf16_logits_computed_in_fp32():
    run_distributed(_check, 2, 2, 120, 128, torch.bfloat16)
