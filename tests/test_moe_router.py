"""The router, the dispatch and the experts against short references written here: each token's
choice computed on its own, the balancing losses from their papers' formulas, the grouped GEMM
against the per-expert loop, and the whole MoE layer against a per-token sum over its experts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.models.activations import activate
from megatron.models.moe import dispatch
from megatron.models.moe.experts import GroupedExperts
from megatron.models.moe.router import (
    RouterOptions,
    group_limited_mask,
    load_balancing_loss,
    route,
    token_counts,
    z_loss_sum,
)
from megatron.parallel.layers import normal_init
from megatron.parallel.state import ParallelState
from tests.model_config import tiny_model_config

T, E = 64, 8


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 2


def _reference_token(row, opts: RouterOptions, bias=None):
    """One token's choice, step by step as the model cards describe it."""
    scores = row.softmax(-1) if opts.score_function == "softmax" else row.sigmoid()
    by = scores if bias is None else scores + bias
    if opts.num_groups is not None:
        per_group = E // opts.num_groups
        group_score = [
            sorted(by[g * per_group : (g + 1) * per_group].tolist(), reverse=True)
            for g in range(opts.num_groups)
        ]
        group_score = [sum(s[: opts.topk // opts.group_topk]) for s in group_score]
        kept = sorted(range(opts.num_groups), key=lambda g: -group_score[g])[: opts.group_topk]
        by = torch.tensor([
            v if e // per_group in kept else -math.inf for e, v in enumerate(by.tolist())
        ])  # fmt: skip
    chosen = sorted(range(E), key=lambda e: -by[e].item())[: opts.topk]
    weights = torch.stack([scores[e] for e in chosen])
    if (opts.score_function == "softmax" and not opts.pre_softmax) or (
        opts.score_function == "sigmoid" and opts.topk > 1
    ):
        weights = weights / weights.sum()
    return chosen, weights * (opts.scaling_factor or 1.0)


@pytest.mark.parametrize(
    "opts, with_bias",
    [
        (RouterOptions(E, 2), False),  # Mixtral, Qwen3-MoE: renormalised
        (RouterOptions(E, 4, pre_softmax=True), False),  # Qwen2-MoE: as softmax gives them
        (RouterOptions(E, 2, "sigmoid", scaling_factor=2.5), True),  # DeepSeek-V3's scoring
        (RouterOptions(E, 4, "sigmoid", num_groups=4, group_topk=2), True),  # group-limited
        (RouterOptions(E, 2, num_groups=2, group_topk=1), False),
    ],
)
def test_route_matches_the_per_token_reference(opts, with_bias):
    logits = _logits()
    bias = torch.linspace(-0.3, 0.3, E) if with_bias else None
    choice = route(logits, opts, bias)
    for t in range(T):
        chosen, weights = _reference_token(logits[t], opts, bias)
        assert choice.experts[t].tolist() == chosen
        torch.testing.assert_close(choice.weights[t], weights, rtol=1e-6, atol=1e-7)
    probs = logits.softmax(-1) if opts.score_function == "softmax" else logits.sigmoid()
    torch.testing.assert_close(choice.probs, probs / probs.sum(-1, keepdim=True))


def test_expert_bias_steers_the_choice_not_the_weights():
    logits = _logits(1)
    opts = RouterOptions(E, 2, "sigmoid")
    bias = torch.zeros(E)
    bias[3] = 10.0  # every token now takes expert 3
    choice = route(logits, opts, bias)
    assert (choice.experts == 3).any(-1).all()
    scores = logits.sigmoid().gather(1, choice.experts)
    torch.testing.assert_close(choice.weights, scores / scores.sum(-1, keepdim=True))


def test_group_mask_keeps_the_best_groups():
    scores = torch.tensor([[0.9, 0.0, 0.1, 0.1, 0.5, 0.5, 0.0, 0.0]])
    # group sums of the top-1: [0.9, 0.1, 0.5, 0.0] -> groups 0 and 2
    mask = group_limited_mask(scores, 4, 2, 2)
    assert mask.tolist() == [[True, True, False, False, True, True, False, False]]


def test_balancing_losses_follow_their_formulas():
    logits = _logits(2)
    choice = route(logits, RouterOptions(E, 2))
    counts = token_counts(choice.experts, E)
    assert counts.sum() == 2 * T
    # Switch Transformer eq. 4 with top-k: coeff * E * sum_i f_i P_i, f_i the fraction of the
    # T * k assignments expert i received, P_i its mean probability.
    f = counts.double() / (T * 2)
    p = choice.probs.double().mean(0)
    want = 0.01 * E * (f * p).sum()
    got = load_balancing_loss(choice.probs.sum(0), counts, T, 2, 0.01)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    # balanced routing and uniform probabilities give coeff exactly
    even = load_balancing_loss(torch.full((E,), T / E), torch.full((E,), 2 * T // E), T, 2, 1.0)
    assert even.item() == pytest.approx(1.0)
    # ST-MoE's z-loss: mean over tokens of logsumexp(logits)^2
    want_z = torch.stack([torch.log(row.exp().sum()) ** 2 for row in logits.double()]).mean()
    assert (z_loss_sum(logits) / T).item() == pytest.approx(want_z.item(), rel=1e-6)


def test_capacity_drops_the_lowest_weights():
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.7, 0.3], [0.8, 0.2]])
    assert dispatch.capacity(4, 2, 3, 1.0) == 3  # ceil(4 * 2 / 3)
    plan = dispatch.plan(experts, weights, 3, 2)
    # Assignment a = 2t + j. Expert 0 got t0 .6, t1 .9, t2 .7, t3 .2: keeps t1 (a2), t2 (a4);
    # expert 1 got t0 .4, t1 .1, t3 .8: keeps t3 (a6), t0 (a1); expert 2 keeps t2 (a5).
    assert plan.counts.tolist() == [2, 2, 1] and plan.dropped.item() == 3
    assert plan.order.tolist() == [2, 4, 6, 1, 5]
    rows = dispatch.unpermute(torch.arange(1.0, 6.0)[:, None], plan, 8)[:, 0]
    assert rows.tolist() == [0, 4, 1, 0, 2, 5, 3, 0]  # zeros where dropped


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_gemm_equals_the_per_expert_loop(activation):
    """Forward and every gradient within 1e-6 in fp32 (here: the same bits); expert 5 gets no
    rows at all."""
    state = ParallelState.serial(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    cfg = tiny_model_config(num_experts=E, moe_ffn_hidden_size=16, activation=activation)
    experts = GroupedExperts(cfg, state, normal_init(0.1, g), normal_init(0.1, g))
    counts = torch.tensor([5, 9, 0, 3, 7, 0, 12, 4])
    rows = torch.randn(int(counts.sum()), 32, generator=g)
    grad = torch.randn(int(counts.sum()), 32, generator=g)
    assert dispatch.grouped_mm_runs(rows, experts.fc1)
    results = []
    for grouped in (True, False):
        experts.grouped = grouped
        x = rows.clone().requires_grad_()
        out = experts(x, counts)
        out.backward(grad)
        results.append((out, x.grad, experts.fc1.grad.clone(), experts.fc2.grad.clone()))
        experts.zero_grad()
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_moe_layer_equals_a_per_token_sum_over_its_experts():
    """Serial: y_t = sum_j w_tj E_{e_tj}(x_t) + sigmoid(g . x_t) S(x_t), each expert's MLP and
    the shared one computed on the token alone."""
    from megatron.models.moe.layer import MoELayer
    from megatron.models.moe.stats import RoutingStats
    from megatron.parallel.random import RNGTracker

    cfg = tiny_model_config(
        num_experts=E, moe_router_topk=2, moe_ffn_hidden_size=16, activation="swiglu",
        moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True, add_bias_linear=False,
    )  # fmt: skip
    state = ParallelState.serial(torch.device("cpu"))
    tracker = RNGTracker(state.device)
    tracker.seed(3, 0)
    init = normal_init(0.2, tracker.init_generator(0))
    layer = MoELayer(cfg, state, tracker, init, init, 0, RoutingStats(cfg, state, False))
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))
    y = layer(x)
    fc1, fc2 = layer.experts.fc1, layer.experts.fc2
    shared1, shared2 = layer.shared_expert.fc1.weight, layer.shared_expert.fc2.weight
    for b in range(2):
        for s in range(5):
            tok = x[b, s]
            probs = F.linear(tok, layer.router.weight).softmax(-1)
            w, chosen = probs.topk(2)
            w = w / w.sum()
            want = sum(
                w[j] * (fc2[e] @ activate(fc1[e] @ tok, "swiglu")) for j, e in enumerate(chosen)
            )
            gate = torch.sigmoid(layer.shared_expert_gate.weight @ tok)
            want = want + gate * (shared2 @ activate(shared1 @ tok, "swiglu"))
            torch.testing.assert_close(y[b, s], want, rtol=1e-5, atol=1e-6)
