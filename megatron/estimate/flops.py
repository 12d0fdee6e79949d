"""Model FLOPs per iteration, Megatron's transformer count (matmuls only).

Per token and layer the forward does 2 * h * ((a + 2g)d + a*d + m*ffn) FLOPs in the QKV, output
and MLP matrices (a heads of width d, g query groups, m = 2 MLP matrices, 3 with SwiGLU's gate)
and 4*s*a*d in the attention scores and their weighted sum; the LM head adds 2*h*V, tied or not.
Backward costs twice the forward; full recomputation adds one more forward of every layer. For
GPT-2's shape (g = a, a*d = h, ffn = 4h) this is Megatron's
72*B*s*l*h^2 * (1 + s/(6h) + V/(12*l*h)) (96 and V/(16*l*h) with recomputation).

A mixture-of-experts layer (``model.moe_layers``) counts its active parameters in place of the
dense MLP's m*ffn: per token the router's 2*h*E (every expert scored), k routed experts of width
f_e (2*h*m*f_e each), the shared expert of width fs (2*h*m*fs) and its gate's 2*h, as
Megatron-LM's ``num_floating_point_operations`` does (dropless: every token's k choices run; a
capacity factor's dropped rows are counted as if they ran).

The layout does not enter: TP, PP, context parallelism and DP split the same FLOPs, each token
counted once on the rank that holds it (ring attention's hops compute the same scores a
rank's queries would against the whole sequence; causal masking's skipped half is counted, as
Megatron counts it).
"""

from __future__ import annotations

from megatron.config.model import ModelConfig


def mlp_forward_flops(model: ModelConfig, moe: bool) -> int:
    """Forward matmul FLOPs per token of one layer's MLP: dense, or the mixture of experts."""
    h, matrices = model.hidden_size, 3 if model.activation == "swiglu" else 2
    if not moe:
        return 2 * h * matrices * model.ffn_hidden_size
    flops = 2 * h * model.num_experts  # the router
    flops += model.moe_router_topk * 2 * h * matrices * model.expert_ffn_hidden_size
    shared = model.moe_shared_expert_intermediate_size
    if shared is not None:
        flops += 2 * h * matrices * shared + (2 * h if model.moe_shared_expert_gate else 0)
    return flops


def flops_per_iteration(
    model: ModelConfig, padded_vocab_size: int, global_batch_size: int
) -> float:
    """Total FLOPs of one optimizer step over the whole global batch (all ranks together), for
    the resolved ``model`` (its ffn_hidden_size set)."""
    h, s, d = model.hidden_size, model.seq_length, model.head_dim
    a, g = model.num_attention_heads, model.query_groups
    attention = 2 * h * ((a + 2 * g) * d + a * d) + 4 * s * a * d  # per token
    layers_forward = sum(attention + mlp_forward_flops(model, moe) for moe in model.moe_layers)
    layer_passes = 4 if model.recompute == "full" else 3
    per_token = layer_passes * layers_forward + 3 * 2 * h * padded_vocab_size
    return float(per_token) * s * global_batch_size
