"""The experts' weights, split over TP as the dense MLP's are, and their MLP over grouped rows.

Routed experts hold every expert's matrices in one parameter each, nn.Linear's [out, in] layout
behind an expert axis: ``fc1`` [E, f', h] (f' = 2f with SwiGLU, rows interleaved [f, (gate,
up)] as ``ParallelMLP``'s fc1) split by columns over TP (``tp_split_dim`` 1), ``fc2`` [E, h, f]
split by rows (``tp_split_dim`` 2). Each TP rank runs every expert's slice over the same token
rows; the outputs are partial sums, reduced once per MoE layer after the shared expert's are
added. The shared expert is a dense MLP of its own width with the same split.

With expert parallelism a rank holds only its EP rank's E / ep experts
(``megatron.parallel.experts.expert_param``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.models.activations import activate
from megatron.models.moe.dispatch import grouped_linear
from megatron.parallel.experts import expert_param
from megatron.parallel.layers import InitMethod, sharded_param
from megatron.parallel.state import ParallelState


class GroupedExperts(nn.Module):
    """E experts' MLPs; ``forward`` takes their rows grouped by expert and returns this TP
    rank's partial outputs."""

    def __init__(self, cfg, state: ParallelState, init: InitMethod, out_init: InitMethod):
        super().__init__()
        self.activation, h, f = cfg.activation, cfg.hidden_size, cfg.expert_ffn_hidden_size
        wide, experts = 2 * f if self.activation == "swiglu" else f, cfg.num_experts
        self.fc1 = expert_param((experts, wide, h), 1, state, init)
        self.fc2 = expert_param((experts, h, f), 2, state, out_init)
        self.grouped: bool | None = None  # None: the grouped GEMM where it runs, else the loop

    def forward(self, rows: Tensor, counts: Tensor) -> Tensor:
        """``rows`` [n, h], ``counts`` [E] rows per expert -> [n, h], partial over TP."""
        y = grouped_linear(rows, self.fc1, counts, self.grouped)  # [n, f' / tp]
        y = activate(y, self.activation)  # [n, f / tp]
        return grouped_linear(y, self.fc2, counts, self.grouped)  # [n, h]


class SharedExpert(nn.Module):
    """The expert every token goes through: a dense MLP whose output stays partial over TP."""

    def __init__(self, cfg, state: ParallelState, init: InitMethod, out_init: InitMethod):
        super().__init__()
        self.activation, h = cfg.activation, cfg.hidden_size
        f = cfg.moe_shared_expert_intermediate_size
        wide = 2 * f if self.activation == "swiglu" else f
        self.fc1 = LocalLinear(sharded_param((wide, h), 0, state, init, state.device))
        self.fc2 = LocalLinear(sharded_param((h, f), 1, state, out_init, state.device))

    def forward(self, tokens: Tensor) -> Tensor:
        """[T, h] whole on every TP rank -> [T, h], partial over TP."""
        return self.fc2(activate(self.fc1(tokens), self.activation))  # fc1: [T, f' / tp]


class LocalLinear(nn.Module):
    """x W^T with this rank's ``weight`` (a TP slice, or replicated), no bias, no collective: the
    caller enters and leaves the TP region. A module of its own so that forward hooks see the
    weight's use (the overlapped parameter all-gather waits in one)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


def replicated_param(shape: tuple[int, ...], init: InitMethod, device: torch.device):
    """A parameter every TP rank holds whole (no ``tp_split_dim``), drawn in fp32."""
    return nn.Parameter(init(torch.empty(shape, dtype=torch.float32, device=device)))
