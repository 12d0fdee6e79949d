"""Model FLOPs per iteration, Megatron's dense-transformer count (matmuls only).

Per token and layer the forward does 2 * h * ((a + 2g)d + a*d + m*ffn) FLOPs in the QKV, output
and MLP matrices (a heads of width d, g query groups, m = 2 MLP matrices, 3 with SwiGLU's gate)
and 4*s*a*d in the attention scores and their weighted sum; the LM head adds 2*h*V, tied or not.
Backward costs twice the forward; full recomputation adds one more forward of every layer. For
GPT-2's shape (g = a, a*d = h, ffn = 4h) this is Megatron's
72*B*s*l*h^2 * (1 + s/(6h) + V/(12*l*h)) (96 and V/(16*l*h) with recomputation).

The layout does not enter: TP, PP, context parallelism and DP split the same FLOPs, each token
counted once on the rank that holds it (ring attention's hops compute the same scores a
rank's queries would against the whole sequence; causal masking's skipped half is counted, as
Megatron counts it).
"""

from __future__ import annotations

from megatron.config.model import ModelConfig


def flops_per_iteration(
    model: ModelConfig, padded_vocab_size: int, global_batch_size: int
) -> float:
    """Total FLOPs of one optimizer step over the whole global batch (all ranks together), for
    the resolved ``model`` (its ffn_hidden_size set)."""
    h, s, d = model.hidden_size, model.seq_length, model.head_dim
    a, g = model.num_attention_heads, model.query_groups
    mlp = (3 if model.activation == "swiglu" else 2) * model.ffn_hidden_size
    layer_forward = 2 * h * ((a + 2 * g) * d + a * d + mlp) + 4 * s * a * d  # per token
    layer_passes = 4 if model.recompute == "full" else 3
    per_token = layer_passes * model.num_layers * layer_forward + 3 * 2 * h * padded_vocab_size
    return float(per_token) * s * global_batch_size
