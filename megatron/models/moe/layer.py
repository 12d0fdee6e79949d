"""The MoE MLP: route, dispatch to the experts, combine, add the shared expert; one reduction.

Data flow for x [b, s, h] (this rank's [b, s / tp, h] under sequence parallelism)::

    logits = x W_r^T                         [b, s, E]   router, replicated over TP
    experts, weights = route(logits)         [b, s, k]   (router.route)
    f: enter the TP region                   x, weights: copy (all-reduce backward); under SP
                                             all-gathered along the sequence with the experts
    rows = permute(x)                        [n, h]      grouped by expert (dispatch.plan)
    rows = experts(rows)                     [n, h]      partial over TP (fc1 by column, fc2 by row)
    y = sum_k weights * unpermute(rows)      [b, s, h]   + the shared expert's, partial too
    g: leave the TP region                   one all-reduce (SP: one reduce-scatter)

Routing happens where the tokens are: every TP rank routes the same tokens identically, or under
sequence parallelism its own s / tp of them (the router's weight is then flagged for the TP
gradient all-reduce, as LayerNorms are). Gathering the choices, not the logits, keeps it exact.
The balancing losses see the whole micro-batch: the token counts are summed over the ranks that
split it (TP under SP, and CP); each rank's probabilities give its share of the loss, summed
over TP under SP with an identity backward (``reduce_from_tp``), so the value is the micro-batch's
(CP: this rank's share, as its LM loss is) while each rank backpropagates its own tokens' part.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron.models.moe import dispatch
from megatron.models.moe.experts import (
    GroupedExperts,
    LocalLinear,
    SharedExpert,
    replicated_param,
)
from megatron.models.moe.router import (
    RouterOptions,
    load_balancing_loss,
    route,
    token_counts,
    z_loss_sum,
)
from megatron.models.moe.stats import RoutingStats
from megatron.parallel import experts as expert_parallel
from megatron.parallel import sequence_parallel as sp
from megatron.parallel.layers import InitMethod
from megatron.parallel.mappings import (
    all_gather_seq,
    copy_to_tp,
    gather_seq_to_tp,
    reduce_from_tp,
    reduce_scatter_seq_from_tp,
)
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState


class Router(nn.Module):
    """The router's weight [E, h] (replicated) and, with auxiliary-loss-free balancing, the fp32
    ``expert_bias`` buffer [E] (saved in checkpoints; never cast to the model's dtype)."""

    def __init__(self, cfg, state: ParallelState, init: InitMethod, sequence_parallel: bool):
        super().__init__()
        self.weight = replicated_param((cfg.num_experts, cfg.hidden_size), init, state.device)
        if sp.sequence_group(state, sequence_parallel) is not None:
            sp.mark_sequence_parallel(self.weight)
        bias = None
        if cfg.moe_router_enable_expert_bias:
            bias = torch.zeros(cfg.num_experts, dtype=torch.float32, device=state.device)
        self.register_buffer("expert_bias", bias)

    def _apply(self, fn, recurse=True):
        # model.to(bf16) would round the bias to steps far coarser than its update rate.
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None:
            self.expert_bias = bias.to(self.expert_bias.device)
        return self

    def forward(self, x: Tensor) -> Tensor:
        """[..., h] -> fp32 logits [..., E]."""
        return torch.nn.functional.linear(x, self.weight).float()


class MoELayer(nn.Module):
    """A mixture-of-experts MLP in place of ``ParallelMLP`` in transformer layer ``index``."""

    def __init__(
        self,
        cfg,
        state: ParallelState,
        tracker: RNGTracker,
        init: InitMethod,
        out_init: InitMethod,
        index: int,
        stats: RoutingStats,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.index, self.stats, self.tracker = index, stats, tracker
        self.opts = RouterOptions.of(cfg)
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.capacity_factor = cfg.moe_expert_capacity_factor
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.per_sequence = cfg.moe_router_load_balancing_type == "seq_aux_loss"
        self.tp_group, self.cp_group, self.ep_group = state.tp_group, state.cp_group, state.ep_group
        self.seq_group = sp.sequence_group(state, sequence_parallel)
        # The ranks a micro-batch's tokens are split over: TP under SP, times CP.
        self.token_split = (state.tp_size if self.seq_group is not None else 1) * state.cp_size
        self.router = Router(cfg, state, init, sequence_parallel)
        self.experts = GroupedExperts(cfg, state, init, out_init)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.moe_shared_expert_intermediate_size is not None:
            self.shared_expert = SharedExpert(cfg, state, init, out_init)
        if cfg.moe_shared_expert_gate:
            gate = replicated_param((1, cfg.hidden_size), init, state.device)
            self.shared_expert_gate = LocalLinear(gate)
            if self.seq_group is not None:
                sp.mark_sequence_parallel(self.shared_expert_gate.weight)
        if self.router.expert_bias is not None:
            stats.routers[index] = self.router

    def _enter(self, x: Tensor) -> Tensor:
        """f for a tensor computed from this rank's tokens and used inside the TP region."""
        if self.seq_group is not None:
            return gather_seq_to_tp(x, self.seq_group)
        return copy_to_tp(x, self.tp_group)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        logits = self.router(x)  # [b, s, E] fp32
        choice = route(logits.view(-1, self.num_experts), self.opts, self.router.expert_bias)
        experts = choice.experts.view(b, s, self.topk)
        counts = token_counts(experts, self.num_experts)  # [b, E]
        losses = self._balancing_losses(logits, choice.probs.view(b, s, -1), counts)
        if self.seq_group is not None:
            experts = all_gather_seq(experts, self.seq_group)  # [b, s * tp, k]
        tokens = self._enter(x).reshape(-1, h)  # [T, h]: the whole sequence
        weights = self._enter(choice.weights.view(b, s, self.topk)).reshape(-1, self.topk)
        experts = experts.reshape(-1, self.topk)  # [T, k]
        total = tokens.shape[0]
        cap = dispatch.capacity(total, self.topk, self.num_experts, self.capacity_factor)
        plan = dispatch.plan(experts, weights, self.num_experts, cap)
        rows = dispatch.permute(tokens, plan, self.topk)  # [n, h], grouped by expert
        if self.ep_group is None:
            rows = self.experts(rows, plan.counts)  # [n, h]
        else:  # to the EP ranks holding the experts and back
            held, held_counts, exchange = expert_parallel.dispatch(rows, plan.counts, self.ep_group)
            rows = expert_parallel.combine(self.experts(held, held_counts), exchange)
        y = dispatch.unpermute(rows, plan, total * self.topk).view(total, self.topk, h)
        y = (y * weights.to(y.dtype).unsqueeze(-1)).sum(1)  # [T, h], partial over TP
        if self.shared_expert is not None:
            shared = self.shared_expert(tokens)  # [T, h], partial over TP
            if self.shared_expert_gate is not None:
                gate = torch.sigmoid(self.shared_expert_gate(x))  # [b, s, 1]
                shared = shared * self._enter(gate).reshape(-1, 1)  # [T, 1]
            y = y + shared
        y = y.view(b, -1, h)
        if self.seq_group is not None:
            out = reduce_scatter_seq_from_tp(y, self.seq_group)  # [b, s / tp, h]
        else:
            out = reduce_from_tp(y, self.tp_group)  # [b, s, h]
        if self.training and not self.tracker.recomputing:
            aux, z = (None if t is None else t.detach() for t in losses)
            self.stats.record(self.index, counts.sum(0), plan.dropped, aux, z)
        live = [t for t in losses if t is not None]
        if live and self.training and torch.is_grad_enabled():
            out = self.stats.attach_losses(out, sum(live))
        return out

    def _balancing_losses(
        self, logits: Tensor, probs: Tensor, counts: Tensor
    ) -> tuple[Tensor | None, Tensor | None]:
        """The auxiliary and z losses of this micro-batch (None where off): their value the whole
        micro-batch's (this CP rank's share), their gradient this rank's tokens' part.

        ``logits`` [b, s, E], ``probs`` [b, s, E] and ``counts`` [b, E] of this rank's tokens.
        """
        if not (self.training and (self.aux_coeff > 0 or self.z_coeff > 0)):
            return None, None
        b, s, experts = probs.shape
        seq_tokens = s * self.token_split  # the whole sequence's
        prob_sums = probs.sum(1)  # [b, E]: this rank's share
        z_sum = z_loss_sum(logits.view(b * s, experts)) if self.z_coeff > 0 else probs.new_zeros(())
        if self.seq_group is not None:
            # One all-reduce over the TP ranks' tokens, counts riding along (exact in fp32 below
            # 2^24 tokens); identity backward: each rank backpropagates its own tokens' part.
            parts = [prob_sums.reshape(-1), z_sum.reshape(1), counts.reshape(-1).float()]
            summed = reduce_from_tp(torch.cat(parts), self.seq_group)
            prob_sums, z_sum, counts = summed.split([b * experts, 1, b * experts])
            # counts carry no gradient: detached, the loss's product keeps only them
            prob_sums, counts = prob_sums.view(b, experts), counts.view(b, experts).detach()
        if self.cp_group is not None and self.aux_coeff > 0:
            counts = counts.clone()
            dist.all_reduce(counts, group=self.cp_group)  # the whole sequences' counts
        aux = z = None
        if self.aux_coeff > 0:
            if self.per_sequence:
                coeff = self.aux_coeff / b
                aux = load_balancing_loss(prob_sums, counts, seq_tokens, self.topk, coeff)
            else:
                tokens = b * seq_tokens
                aux = load_balancing_loss(
                    prob_sums.sum(0), counts.sum(0), tokens, self.topk, self.aux_coeff
                )
        if self.z_coeff > 0:
            z = z_sum.sum() * (self.z_coeff / (b * seq_tokens))
        return aux, z
