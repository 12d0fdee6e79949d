"""Tensor-parallel layers: each holds one slice of a matrix that the serial model holds whole.

Initialisation draws the full matrix from the (TP-wide identical) default generator and keeps this
rank's slice, so a TP=N model holds exactly the slices of the TP=1 model. Every split parameter
carries ``tp_split_dim``; replicated ones carry nothing. Clipping, weight-decay grouping and
checkpoint resharding all read that one attribute. A parameter whose dim 0 is the padded
vocabulary (the word table, BERT's LM-head bias) also carries ``vocab_padded = True``, so
resharding knows which rows are padding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.parallel.mappings import copy_to_tp, gather_from_tp, reduce_from_tp
from megatron.parallel.state import ParallelState

InitMethod = Callable[[Tensor], Tensor]


def normal_init(std: float) -> InitMethod:
    """N(0, std), drawn from the default generator of the tensor's device."""
    return lambda t: nn.init.normal_(t, mean=0.0, std=std)


def split_dim(param: Tensor) -> int | None:
    """The dimension a TP layer split this parameter along, or None when it is replicated."""
    return getattr(param, "tp_split_dim", None)


def _sharded_param(
    full_shape: tuple[int, ...],
    dim: int,
    state: ParallelState,
    init: InitMethod,
    device: torch.device,
    valid_rows: int | None = None,
) -> nn.Parameter:
    """Draw the full fp32 matrix, keep this rank's contiguous slice along ``dim``.

    ``valid_rows`` (embeddings only) draws just the real vocabulary rows and zero-pads the rest, so
    models whose padding differs (TP=1 vs TP=N) draw the same numbers for the same rows.
    """
    drawn = list(full_shape)
    if valid_rows is not None:
        drawn[0] = valid_rows
    full = init(torch.empty(drawn, dtype=torch.float32, device=device))
    if valid_rows is not None:
        full = F.pad(full, (0, 0, 0, full_shape[0] - valid_rows))
    local = full_shape[dim] // state.tp_size
    param = nn.Parameter(full.narrow(dim, state.tp_rank * local, local).clone())
    param.tp_split_dim = dim
    return param


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {tp}")
    return n // tp


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: A = [A_1, ..., A_p], b = [b_1, ..., b_p].

    Rank i computes Y_i = X A_i + b_i. The input goes through f (its gradient is all-reduced);
    the output stays split unless ``gather_output``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        state: ParallelState,
        init: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.group, self.gather_output = state.tp_group, gather_output
        self.out_per_partition = _divide(out_features, state.tp_size, "out_features")
        device = device or state.device
        # nn.Linear stores A transposed, [out, in], so a column split is a split of dim 0.
        self.weight = _sharded_param((out_features, in_features), 0, state, init, device)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_per_partition, device=device))
            self.bias.tp_split_dim = 0

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows and X by columns: A = [A_1; ...; A_p], X = [X_1, ..., X_p].

    Rank i computes X_i A_i; g all-reduces the partial sums, then the replicated bias is added
    once. The input must already be split along its last dimension.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        state: ParallelState,
        init: InitMethod,
        bias: bool = True,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.group, self.tp_size = state.tp_group, state.tp_size
        self.in_per_partition = _divide(in_features, state.tp_size, "in_features")
        device = device or state.device
        self.weight = _sharded_param((out_features, in_features), 1, state, init, device)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.tp_size == 1:  # nothing to reduce: let the matmul add the bias (no extra pass)
            return F.linear(x, self.weight, self.bias)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table E split by vocabulary rows: E = [E_1; ...; E_p].

    Rank i owns ids [vocab_start, vocab_end); it looks up those, writes zeros for the others, and
    g sums the partial lookups. Rows past ``vocab_size`` (padding) start at zero.
    """

    def __init__(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        dim: int,
        state: ParallelState,
        init: InitMethod,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.group, self.tp_size = state.tp_group, state.tp_size
        per_partition = _divide(padded_vocab_size, state.tp_size, "padded_vocab_size")
        self.vocab_start = state.tp_rank * per_partition
        self.vocab_end = self.vocab_start + per_partition
        self.weight = _sharded_param(
            (padded_vocab_size, dim), 0, state, init, device or state.device, valid_rows=vocab_size
        )
        self.weight.vocab_padded = True

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)
