"""The four TP mappings and the four sequence-parallel ones against their closed forms, on real
gloo process groups."""

import pytest
import torch

from megatron.parallel import mappings
from megatron.parallel.state import initialize
from tests.distributed import run_distributed


def _check_mappings(tp: int) -> None:
    st = initialize(tp)
    r, g = st.tp_rank, st.tp_group
    total = sum(range(1, tp + 1))  # sum over ranks of (rank + 1)

    x = torch.full((2, 3), float(r + 1), requires_grad=True)
    y = mappings.copy_to_tp(x, g)
    assert torch.equal(y, x)
    y.backward(torch.full((2, 3), float(r + 1)))
    assert torch.equal(x.grad, torch.full((2, 3), float(total))), "f backward must all-reduce"

    x = torch.full((2, 3), float(r + 1), requires_grad=True)
    y = mappings.reduce_from_tp(x.clone(), g)
    assert torch.equal(y, torch.full((2, 3), float(total))), "g forward must all-reduce"
    y.backward(torch.full((2, 3), float(r + 1)))
    assert torch.equal(x.grad, torch.full((2, 3), float(r + 1))), "g backward is identity"

    full = torch.arange(2 * 4 * tp, dtype=torch.float32).view(2, 4 * tp).requires_grad_()
    y = mappings.scatter_to_tp(full, g)
    assert torch.equal(y, full[:, 4 * r : 4 * (r + 1)])
    y.backward(torch.ones_like(y) * (r + 1))
    expect = torch.cat([torch.full((2, 4), float(i + 1)) for i in range(tp)], dim=-1)
    assert torch.equal(full.grad, expect), "scatter backward must gather"

    part = torch.full((2, 4), float(r), requires_grad=True)
    y = mappings.gather_from_tp(part, g)
    assert torch.equal(y, torch.cat([torch.full((2, 4), float(i)) for i in range(tp)], dim=-1))
    y.backward(torch.arange(y.numel(), dtype=torch.float32).view_as(y))
    assert torch.equal(
        part.grad, torch.arange(y.numel(), dtype=torch.float32).view_as(y)[:, 4 * r : 4 * (r + 1)]
    )
    _check_sequence_mappings(r, tp, g)


def _check_sequence_mappings(r: int, tp: int, g) -> None:
    """[b, s, h] split along s (dim 1): rank r holds positions [2r, 2r + 2)."""
    b, s, h = 2, 2 * tp, 3
    full = torch.arange(b * s * h, dtype=torch.float32).view(b, s, h)  # the same on every rank
    mine = slice(2 * r, 2 * (r + 1))
    per_rank = full * (r + 1)  # differs by rank, so a sum over ranks is visible

    x = full[:, mine].clone().requires_grad_()
    y = mappings.gather_seq_to_tp(x, g)
    assert torch.equal(y, full), "SP f forward must all-gather along the sequence"
    y.backward(per_rank)
    assert torch.equal(x.grad, (full * total_of(tp))[:, mine]), "SP f backward: reduce-scatter"

    x = per_rank.clone().requires_grad_()
    y = mappings.reduce_scatter_seq_from_tp(x, g)
    assert torch.equal(y, (full * total_of(tp))[:, mine]), "SP g forward must reduce-scatter"
    y.backward(full[:, mine])
    assert torch.equal(x.grad, full), "SP g backward must all-gather"

    x = full.clone().requires_grad_()
    y = mappings.scatter_seq(x, g)
    assert torch.equal(y, full[:, mine])
    y.backward(full[:, mine])
    assert torch.equal(x.grad, full), "scatter along the sequence: all-gather backward"

    x = full[:, mine].clone().requires_grad_()
    y = mappings.gather_seq(x, g)
    assert torch.equal(y, full)
    y.backward(full)
    assert torch.equal(x.grad, full[:, mine]), "gather along the sequence: slice backward"


def total_of(tp: int) -> int:
    return sum(range(1, tp + 1))  # sum over ranks of (rank + 1)


def test_mappings_are_noops_on_one_rank():
    x = torch.randn(3, 4)
    for fn in (
        mappings.copy_to_tp,
        mappings.reduce_from_tp,
        mappings.scatter_to_tp,
        mappings.gather_from_tp,
        mappings.gather_seq_to_tp,
        mappings.reduce_scatter_seq_from_tp,
        mappings.scatter_seq,
        mappings.gather_seq,
    ):
        assert fn(x, None) is x


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_mappings_closed_form(tp):
    run_distributed(_check_mappings, tp, tp)
