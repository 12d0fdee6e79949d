"""The model section of the config: the one decoder's (and BERT's) shape and options, dense or
mixture-of-experts MLPs. Option names follow Megatron-LM's flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.config.fields import documented as _doc


@dataclass
class ModelConfig:
    """Transformer shape and regularisation (shared by GPT and BERT)."""

    num_layers: int = _doc("Transformer layers.")
    hidden_size: int = _doc("Width of the residual stream.")
    num_attention_heads: int = _doc("Attention heads; divisible by the TP size.")
    seq_length: int = _doc("Tokens per training sample.")
    type: Literal["gpt", "bert"] | None = _doc(
        "The model this config is for; the other entrypoint refuses it. null: the entrypoint's.",
        None,
    )
    max_position_embeddings: int | None = _doc(
        "Longest sequence (the learned position table's rows, generation's limit); null: "
        "seq_length.",
        None,
    )
    ffn_hidden_size: int | None = _doc("MLP inner width; null: 4 * hidden_size.", None)
    hidden_dropout: float = _doc("Dropout on embeddings and sublayer outputs.", 0.1)
    attention_dropout: float = _doc("Dropout on attention probabilities.", 0.1)
    layernorm_position: Literal["pre", "post"] = _doc("LayerNorm before or after sublayers.", "pre")
    layernorm_epsilon: float = _doc("Epsilon of every norm (LayerNorm or RMSNorm).", 1e-5)
    init_method_std: float = _doc("Std of the normal weight initialisation.", 0.02)
    make_vocab_size_divisible_by: int = _doc("Vocab padded to a multiple of this times TP.", 128)
    recompute: Literal["none", "full"] = _doc("Activation recomputation per layer.", "none")
    activation: Literal["gelu", "gelu_tanh", "swiglu"] = _doc(
        "MLP activation: GeLU exact (erf), GeLU's tanh approximation (released GPT-2 weights), "
        "or swiglu, SiLU(gate) * up with fc1 the gate and up projections (Llama).",
        "gelu",
    )
    position_embedding_type: Literal["learned", "rope", "none"] = _doc(
        "Positions: a learned table added to the embeddings, rotary (RoPE, on q and k), or none.",
        "learned",
    )
    rotary_base: float = _doc("RoPE theta: the base of its wavelengths (Llama 3: 500000).", 10000.0)
    rotary_percent: float = _doc("Fraction of each head's channels RoPE rotates, in (0, 1].", 1.0)
    rope_scaling: dict[str, float] | None = _doc(
        "Llama 3.1's RoPE frequency scaling, {factor, low_freq_factor, high_freq_factor, "
        "original_max_position_embeddings}; null: none.",
        None,
    )
    normalization: Literal["layernorm", "rmsnorm"] = _doc(
        "Norm kind of the layers, the final norm and the QK norms (epsilon: layernorm_epsilon).",
        "layernorm",
    )
    num_query_groups: int | None = _doc(
        "Grouped-query attention: key/value heads, each shared by heads / groups query heads "
        "(1: multi-query); divisible by the TP size. null: one per head.",
        None,
    )
    kv_channels: int | None = _doc("Head dimension; null: hidden_size / num_attention_heads.", None)
    add_bias_linear: bool = _doc("Biases on the attention and MLP matrices (Llama: false).", True)
    add_qkv_bias: bool = _doc("A QKV bias even when add_bias_linear is false (Qwen2).", False)
    qk_layernorm: bool = _doc(
        "Normalise q and k over head_dim, per head, before RoPE (Qwen3, OLMo 2).", False
    )
    untie_embeddings_and_output_weights: bool = _doc(
        "GPT: an output layer of its own instead of the word embedding's transpose.", False
    )
    num_experts: int | None = _doc(
        "Mixture of experts: routed experts per MoE layer (each a SwiGLU or GeLU MLP of "
        "moe_ffn_hidden_size); null: dense MLPs everywhere.",
        None,
    )
    moe_router_topk: int = _doc("Experts each token is routed to.", 2)
    moe_ffn_hidden_size: int | None = _doc(
        "Each routed expert's inner width; null: ffn_hidden_size.", None
    )
    moe_layer_freq: int | list[int] = _doc(
        "Which layers are MoE: every k-th (layer i when i % k == 0), or one 0/1 per layer "
        "(1: MoE); dense MLPs of ffn_hidden_size elsewhere.",
        1,
    )
    moe_shared_expert_intermediate_size: int | None = _doc(
        "Inner width of the shared expert every token also goes through (Qwen2-MoE, "
        "DeepSeek); null: none.",
        None,
    )
    moe_shared_expert_gate: bool = _doc(
        "Scale the shared expert's output by sigmoid(x . w) of a learned w (Qwen2-MoE).", False
    )
    moe_router_score_function: Literal["softmax", "sigmoid"] = _doc(
        "Router scores over the experts: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3).",
        "softmax",
    )
    moe_router_pre_softmax: bool = _doc(
        "softmax: the top-k weights are the softmax over all experts as they are (Qwen2-MoE); "
        "false renormalises them to sum to 1 (Mixtral, Qwen3-MoE). sigmoid: always "
        "renormalised when top-k > 1.",
        False,
    )
    moe_router_topk_scaling_factor: float | None = _doc(
        "Multiplies the top-k weights (DeepSeek-V3: 2.5); null: 1.", None
    )
    moe_router_num_groups: int | None = _doc(
        "Group-limited routing (DeepSeek): the experts fall into this many groups and a token "
        "picks among the experts of its moe_router_group_topk best groups; null: off.",
        None,
    )
    moe_router_group_topk: int | None = _doc(
        "Groups a token may pick experts from, with moe_router_num_groups.", None
    )
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss"] = _doc(
        "The auxiliary loss over the whole micro-batch (GShard/Switch), or per sequence, "
        "averaged over the sequences (DeepSeek-V3).",
        "aux_loss",
    )
    moe_aux_loss_coeff: float = _doc("Weight of the load-balancing auxiliary loss; 0: off.", 0.0)
    moe_z_loss_coeff: float = _doc(
        "Weight of the router z-loss, mean squared logsumexp of the logits (ST-MoE); 0: off.", 0.0
    )
    moe_router_enable_expert_bias: bool = _doc(
        "Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores "
        "for choosing experts (not to their weights), moved after each step towards balance by "
        "moe_router_bias_update_rate from that step's token counts over all ranks.",
        False,
    )
    moe_router_bias_update_rate: float = _doc(
        "Step of the expert bias: sign(mean count - count) times this, per step.", 1e-3
    )
    moe_expert_capacity_factor: float | None = _doc(
        "Each expert takes at most this times its even share of a rank's routed tokens "
        "(ceil(tokens * topk / experts * factor)); the lowest-weighted overflow is dropped and "
        "counted. null: dropless.",
        None,
    )
    compile: bool = _doc(
        "torch.compile each transformer layer (regional). GPU-first: on CPU it may be slower; "
        "attention dropout > 0 splits each layer's graph at its RNG fork.",
        False,
    )

    @property
    def head_dim(self) -> int:
        """Channels per attention head: ``kv_channels``, or hidden_size / num_attention_heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, or one per attention head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def moe_layers(self) -> list[bool]:
        """Per layer, whether its MLP is a mixture of experts (``moe_layer_freq``)."""
        if self.num_experts is None:
            return [False] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            return [bool(f) for f in freq]
        return [i % freq == 0 for i in range(self.num_layers)]

    @property
    def expert_ffn_hidden_size(self) -> int:
        """A routed expert's inner width: ``moe_ffn_hidden_size``, or ``ffn_hidden_size``."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size
