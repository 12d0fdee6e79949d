"""Cross entropy over vocab-parallel logits, without ever gathering them.

Each rank holds logits for ids [vocab_start, vocab_end). Three all-reduces over the TP group give
the global max, the target's logit and the sum of exponentials; the backward needs none. Logits
for padded ids (>= vocab_size) are excluded, so they receive no probability mass and TP sizes whose
padding differs compute the same loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss [b, s] in fp32 from local logits [b, s, v_local]."""

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        target: Tensor,
        vocab_size: int,
        group: dist.ProcessGroup | None,
        inplace: bool,
    ) -> Tensor:
        tp_size = 1 if group is None else dist.get_world_size(group)
        v_local = logits.shape[-1]
        vocab_start = (0 if group is None else dist.get_rank(group)) * v_local
        valid = max(0, min(v_local, vocab_size - vocab_start))  # this rank's unpadded columns

        logits_max = logits[..., :valid].amax(dim=-1).float() if valid else None
        if logits_max is None:
            logits_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        if tp_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        # One fp32 buffer, reused for exp, softmax and the gradient: the logits themselves when
        # the caller gives them up and they are fp32 (a fresh [b, s, v_local] buffer costs more
        # than the arithmetic on CPU), else the fresh copy that .float() makes.
        if inplace or logits.dtype != torch.float32:
            shifted = logits.float().sub_(logits_max.unsqueeze(-1))  # [b, s, v_local]
        else:
            shifted = logits - logits_max.unsqueeze(-1)

        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= valid)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)

        exp = shifted.exp_()
        exp[..., valid:] = 0.0
        sum_exp = exp.sum(dim=-1)
        if tp_size > 1:
            # Two reductions of [b, s]; stacking them into one call would save a latency, but
            # keeps both buffers alive; they are tiny next to the logits either way.
            dist.all_reduce(target_logit, group=group)
            dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit

        # The softmax is left unnormalised: backward folds 1 / sum_exp into the one pass it makes
        # over the logits anyway, saving a read and a write of [b, s, v_local] here.
        ctx.save_for_backward(exp, sum_exp, local_target, outside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, None, None, None, None]:
        exp, sum_exp, local_target, outside = ctx.saved_tensors
        # d loss / d logit_j = g * exp_j / sum_exp - g * [j == target], computed in place on the
        # saved exponentials (so backward twice through the same graph is not supported, as for
        # any fused loss). Subtracting g after scaling rounds like F.cross_entropy's backward.
        grad = exp.mul_((grad_loss / sum_exp).unsqueeze(-1))
        hit = (~outside).to(grad.dtype) * grad_loss
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    inplace: bool = False,
) -> Tensor:
    """Per-token cross entropy (fp32, shape of ``target``) from this rank's slice of the logits.

    ``vocab_size`` is the real (unpadded) vocabulary; columns beyond it get no probability.
    ``inplace=True`` lets fp32 logits serve as the working buffer: their values are overwritten
    (forward and backward), so pass it only for logits nothing else reads.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, group, inplace)
