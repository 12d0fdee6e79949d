"""Model FLOPs per iteration, Megatron's dense-transformer count (matmuls only).

Per token and layer the forward does 2 * (4h^2 + 2*h*ffn) FLOPs in the QKV, output and MLP
matrices and 4*s*h in the attention scores and their weighted sum; the LM head adds 2*h*V.
Backward costs twice the forward; full recomputation adds one more forward of every layer. With
ffn = 4h this is Megatron's 72*B*s*l*h^2 * (1 + s/(6h) + V/(12*l*h)) (96 and V/(16*l*h) with
recomputation).
"""

from __future__ import annotations


def flops_per_iteration(
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    seq_length: int,
    padded_vocab_size: int,
    global_batch_size: int,
    recompute: bool,
) -> float:
    """Total FLOPs of one optimizer step over the whole global batch (all ranks together)."""
    h, s = hidden_size, seq_length
    layer_forward = 2 * (4 * h * h + 2 * h * ffn_hidden_size) + 4 * s * h  # per token
    layer_passes = 4 if recompute else 3
    per_token = layer_passes * num_layers * layer_forward + 3 * 2 * h * padded_vocab_size
    return float(per_token) * s * global_batch_size
