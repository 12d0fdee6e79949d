"""Token dispatch inside a rank: the router's choices become a permutation of the tokens grouped
by expert, the experts run over their contiguous rows, and the permutation is inverted.

Each step is a function, with its shapes. T tokens each chose k experts: assignment a = t * k + j
is token t's j-th choice. ``plan`` orders the assignments by expert (token order within an expert,
or with a capacity by falling weight, the overflow cut); ``permute`` gathers their rows;
``grouped_linear`` multiplies each expert's rows by its matrix (one grouped GEMM where
``torch._grouped_mm`` runs, else a loop over the experts: the same numbers); ``unpermute`` puts
the rows back in assignment order, zeros where an assignment was dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Plan:
    """Where each kept assignment goes."""

    order: Tensor  # [n] int64: kept assignments (t * k + j), grouped by expert
    counts: Tensor  # [E] int64: kept assignments per expert; n = counts.sum()
    dropped: Tensor  # [] int64: assignments cut by the capacity


def capacity(tokens: int, topk: int, num_experts: int, factor: float | None) -> int | None:
    """Assignments an expert takes: ceil(tokens * k / E * factor); None: dropless."""
    if factor is None:
        return None
    return math.ceil(tokens * topk / num_experts * factor)


def plan(experts: Tensor, weights: Tensor, num_experts: int, cap: int | None) -> Plan:
    """``experts``, ``weights`` [T, k]: the router's choices. With a capacity ``cap`` each expert
    keeps its ``cap`` highest-weighted assignments (ties: the earlier token)."""
    flat = experts.reshape(-1)  # [T * k]
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    if cap is None:
        order = torch.argsort(flat, stable=True)  # [T * k], token order within an expert
        return Plan(order, counts, counts.new_zeros(()))
    by_weight = torch.argsort(weights.reshape(-1), descending=True, stable=True)
    order = by_weight[torch.argsort(flat[by_weight], stable=True)]  # falling weight per expert
    starts = counts.cumsum(0) - counts  # [E]: each expert's first place in ``order``
    place = torch.arange(order.numel(), device=order.device) - starts[flat[order]]
    kept = place < cap
    kept_counts = counts.clamp(max=cap)
    return Plan(order[kept], kept_counts, (counts - kept_counts).sum())


def permute(tokens: Tensor, p: Plan, topk: int) -> Tensor:
    """[T, h] -> [n, h]: each kept assignment's token row, grouped by expert."""
    return tokens.index_select(0, p.order // topk)


def unpermute(rows: Tensor, p: Plan, assignments: int) -> Tensor:
    """[n, h] grouped by expert -> [T * k, h] in assignment order, zeros where dropped."""
    out = rows.new_zeros((assignments, rows.shape[-1]))
    return out.index_copy(0, p.order, rows)


def grouped_mm_runs(rows: Tensor, weight: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: fp32 on CPU, bf16 on CUDA from
    Hopper on (torch 2.13), with rows of a multiple of 16 bytes (its stride rule)."""
    if rows.device.type == "cpu":
        dtype_ok = rows.dtype == torch.float32
    else:
        dtype_ok = rows.dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (9, 0)
    width = rows.element_size()
    aligned = all(n * width % 16 == 0 for n in weight.shape[1:])
    return dtype_ok and aligned and rows.dtype == weight.dtype


def grouped_linear(rows: Tensor, weight: Tensor, counts: Tensor, grouped: bool | None = None):
    """[n, in] rows grouped by expert (``counts`` [E] of them each) times each expert's
    ``weight`` [E, out, in] (nn.Linear's layout): [n, out]. ``grouped`` None: the grouped GEMM
    where it runs (``grouped_mm_runs``), else the loop."""
    if grouped is None:
        grouped = grouped_mm_runs(rows, weight)
    if grouped:
        offsets = counts.cumsum(0).to(torch.int32)  # [E]: where each expert's rows end
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    chunks = rows.split(counts.tolist())  # a host read of E counts: the loop needs them
    return torch.cat([F.linear(chunk, w) for chunk, w in zip(chunks, weight, strict=True)])
