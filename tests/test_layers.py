"""Column/Row/VocabParallel layers against nn.Linear / nn.Embedding on the full matrices.

Float sums are split across ranks in a different order than the serial matmul, so comparisons
allow 1e-6 relative error; fp32 matmuls of this size agree far closer than that.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    normal_init,
)
from megatron.parallel.state import initialize
from tests.distributed import run_distributed


def gather_param(t: torch.Tensor, dim: int | None, group) -> torch.Tensor:
    """The full tensor from every rank's slice along ``dim`` (replicated: as is)."""
    if dim is None:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def close(a, b, tol=1e-6):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max() / b.abs().max().clamp_min(1e-12)
    assert err <= tol, f"relative error {err:.3g} > {tol}"


def _check_layers(tp: int) -> None:
    st = initialize(tp)
    g = st.tp_group
    init = normal_init(0.02)

    # Column: the full weight is drawn from the shared seed on every rank.
    torch.manual_seed(1)
    col = ColumnParallelLinear(8, 4 * tp, st, init, gather_output=True)
    ref = torch.nn.Linear(8, 4 * tp)
    torch.manual_seed(1)
    init(ref.weight.data)
    torch.nn.init.zeros_(ref.bias)
    assert col.weight.tp_split_dim == 0 and col.bias.tp_split_dim == 0
    torch.manual_seed(2)
    x = torch.randn(3, 5, 8)
    xc, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    yc, yr = col(xc), ref(xr)
    close(yc, yr)
    yc.pow(2).sum().backward()
    yr.pow(2).sum().backward()
    close(xc.grad, xr.grad)
    close(gather_param(col.weight.grad, 0, g), ref.weight.grad)
    close(gather_param(col.bias.grad, 0, g), ref.bias.grad)

    # Row: input already split along its last dimension; bias replicated and added once.
    torch.manual_seed(3)
    row = RowParallelLinear(4 * tp, 6, st, init)
    ref = torch.nn.Linear(4 * tp, 6)
    torch.manual_seed(3)
    init(ref.weight.data)
    torch.nn.init.zeros_(ref.bias)
    with torch.no_grad():
        ref.bias.uniform_()
        row.bias.copy_(ref.bias)
    assert row.weight.tp_split_dim == 1 and not hasattr(row.bias, "tp_split_dim")
    x = torch.randn(3, 5, 4 * tp)
    xr = x.clone().requires_grad_()
    xl = x[..., 4 * st.tp_rank : 4 * (st.tp_rank + 1)].clone().requires_grad_()
    yl, yr = row(xl), ref(xr)
    close(yl, yr)
    yl.pow(2).sum().backward()
    yr.pow(2).sum().backward()
    close(xl.grad, xr.grad[..., 4 * st.tp_rank : 4 * (st.tp_rank + 1)])
    close(gather_param(row.weight.grad, 1, g), ref.weight.grad)
    close(row.bias.grad, ref.bias.grad)

    # Vocab-parallel embedding: ids from every rank's range, padded rows start at zero.
    vocab, padded = 13 * tp - 1, 16 * tp
    torch.manual_seed(4)
    emb = VocabParallelEmbedding(vocab, padded, 6, st, init)
    ref = torch.nn.Embedding(vocab, 6)
    torch.manual_seed(4)
    init(ref.weight.data)
    full = gather_param(emb.weight.data, 0, g)
    assert torch.equal(full[:vocab], ref.weight.data) and not full[vocab:].any()
    ids = torch.randint(0, vocab, (4, 7))
    ye, yr = emb(ids), ref(ids)
    close(ye, yr)
    ye.pow(2).sum().backward()
    yr.pow(2).sum().backward()
    close(gather_param(emb.weight.grad, 0, g)[:vocab], ref.weight.grad)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_match_serial(tp):
    run_distributed(_check_layers, tp, tp)
