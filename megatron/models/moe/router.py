"""The router: scores over the experts, the top-k choice, and the balancing losses' formulas.

Everything here works on one rank's tokens and is plain data in, data out: ``route`` returns the
chosen experts and their weights; ``load_balancing_loss`` and ``z_loss`` are the formulas, fed
with the token counts of the whole micro-batch by ``MoELayer`` (which knows how it is split).

Arithmetic follows the Hugging Face classes we convert: scores in fp32, softmax over all
experts, the top-k, then (unless ``pre_softmax``) the weights divided by their sum (Mixtral,
Qwen3-MoE); sigmoid scores (DeepSeek-V3) renormalised when top-k > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RouterOptions:
    """The ``model.moe_router_*`` options that shape a choice."""

    num_experts: int
    topk: int
    score_function: str = "softmax"  # "softmax" | "sigmoid"
    pre_softmax: bool = False
    scaling_factor: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None

    @classmethod
    def of(cls, cfg) -> RouterOptions:
        return cls(
            cfg.num_experts,
            cfg.moe_router_topk,
            cfg.moe_router_score_function,
            cfg.moe_router_pre_softmax,
            cfg.moe_router_topk_scaling_factor,
            cfg.moe_router_num_groups,
            cfg.moe_router_group_topk,
        )


@dataclass(frozen=True)
class Choice:
    """A router's decision for t tokens."""

    experts: Tensor  # [t, k] int64: the chosen experts, best first
    weights: Tensor  # [t, k] fp32: what each chosen expert's output is multiplied by
    probs: Tensor  # [t, E] fp32: the scores the auxiliary loss balances (rows sum to 1)


def group_limited_mask(scores: Tensor, num_groups: int, group_topk: int, topk: int) -> Tensor:
    """DeepSeek's group-limited routing: [t, E] True where a token may choose the expert.

    The experts fall into ``num_groups`` contiguous groups; a group's score is the sum of its
    ``topk / group_topk`` best scores, and each token keeps the experts of its ``group_topk``
    best groups (DeepSeek-V3: 8 groups, 4 kept, top-2 summed).
    """
    t, experts = scores.shape
    grouped = scores.view(t, num_groups, experts // num_groups)  # [t, groups, E / groups]
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(-1)  # [t, groups]
    best = group_scores.topk(group_topk, dim=-1).indices  # [t, group_topk]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.repeat_interleave(experts // num_groups, dim=1)  # [t, E]


def route(logits: Tensor, opts: RouterOptions, expert_bias: Tensor | None = None) -> Choice:
    """The top-k choice for router ``logits`` [t, E] (fp32).

    ``expert_bias`` [E] (auxiliary-loss-free balancing) is added to the scores a token chooses
    by, never to the weights its chosen experts get.
    """
    if opts.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)  # [t, E]
        probs = scores
    else:
        scores = torch.sigmoid(logits)
        probs = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    by = scores if expert_bias is None else scores + expert_bias
    if opts.num_groups is not None:
        allowed = group_limited_mask(by, opts.num_groups, opts.group_topk, opts.topk)
        by = by.masked_fill(~allowed, float("-inf"))
    experts = by.topk(opts.topk, dim=-1).indices  # [t, k]
    weights = scores.gather(1, experts)  # [t, k]
    renormalise = not opts.pre_softmax if opts.score_function == "softmax" else opts.topk > 1
    if renormalise:
        eps = 0.0 if opts.score_function == "softmax" else 1e-20
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    if opts.scaling_factor is not None:
        weights = weights * opts.scaling_factor
    return Choice(experts, weights, probs)


def token_counts(experts: Tensor, num_experts: int) -> Tensor:
    """[..., E] int64: how many of the last-but-one axis's tokens chose each expert, from
    ``experts`` [..., t, k]."""
    flat = experts.flatten(-2)  # [..., t * k]
    counts = torch.zeros((*flat.shape[:-1], num_experts), dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(-1, flat, torch.ones_like(flat))


def load_balancing_loss(
    prob_sums: Tensor, counts: Tensor, tokens: int, topk: int, coeff: float
) -> Tensor:
    """GShard/Switch's auxiliary loss, ``coeff * E * sum_e f_e P_e``, summed over a leading axis
    when there is one (DeepSeek-V3's per-sequence form, which ``coeff`` then divides by the
    sequences).

    ``prob_sums`` [..., E]: the probabilities summed over the tokens (the share this rank holds);
    ``counts`` [..., E]: the tokens that chose each expert, over all ``tokens`` of the batch (or
    sequence): f_e = counts_e / (tokens * topk), P_e = prob_sums_e / tokens.
    """
    experts = prob_sums.shape[-1]
    scale = coeff * experts / (topk * tokens * tokens)
    return (prob_sums * counts.to(prob_sums.dtype)).sum() * scale


def z_loss_sum(logits: Tensor) -> Tensor:
    """ST-MoE's router z-loss summed over the tokens: sum_t logsumexp(logits_t)^2."""
    return torch.logsumexp(logits, dim=-1).square().sum()
