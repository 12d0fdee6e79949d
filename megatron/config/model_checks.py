"""The model section's checks: the decoder's options (query groups, RoPE) and the mixture of
experts (top-k, the layer pattern, capacity, groups, expert parallelism against the experts)."""

from __future__ import annotations

from megatron.config.fixes import divisors, multiples
from megatron.config.model import ModelConfig
from megatron.config.schema import Config
from megatron.errors import ConfigError

_ROPE_SCALING = "factor low_freq_factor high_freq_factor original_max_position_embeddings".split()


def check_decoder(cfg: Config) -> None:
    """Query groups against heads and TP; RoPE's options; what BERT's tied head cannot take."""
    m, tp = cfg.model, cfg.parallel.tensor_parallel_size
    heads, groups = m.num_attention_heads, m.query_groups
    if heads % groups:
        raise ConfigError(
            f"model.num_query_groups={groups} does not divide model.num_attention_heads={heads}; "
            f"use {divisors(heads)}"
        )
    if groups % tp:
        raise ConfigError(
            f"model.num_query_groups={groups} is not divisible by parallel.tensor_parallel_size="
            f"{tp}: each TP rank holds whole key/value groups; use a TP size of {divisors(groups)}"
        )
    rope = m.position_embedding_type == "rope"
    if not 0 < m.rotary_percent <= 1:
        raise ConfigError(f"model.rotary_percent={m.rotary_percent} must be in (0, 1]; fix it")
    rotated = int(m.head_dim * m.rotary_percent)
    if rope and (rotated == 0 or rotated % 2):
        raise ConfigError(
            f"model.rotary_percent={m.rotary_percent} of head_dim {m.head_dim} rotates {rotated} "
            "channels; RoPE rotates channel pairs: choose a percent that gives an even count"
        )
    scaling = m.rope_scaling
    if scaling is not None and not rope:
        raise ConfigError(
            "model.rope_scaling scales RoPE's frequencies and needs "
            "model.position_embedding_type=rope; set rope_scaling to null or use rope"
        )
    if scaling is not None and (
        sorted(scaling) != sorted(_ROPE_SCALING)
        or min(scaling.values()) <= 0
        or scaling["high_freq_factor"] <= scaling["low_freq_factor"]
    ):
        raise ConfigError(
            f"model.rope_scaling={scaling} must be Llama 3.1's {{{', '.join(_ROPE_SCALING)}}}, "
            "all positive, high_freq_factor above low_freq_factor (Llama 3.1: 8, 1, 4, 8192)"
        )
    if m.type == "bert" and m.untie_embeddings_and_output_weights:
        raise ConfigError(
            "model.untie_embeddings_and_output_weights=true is for GPT: BERT's MLM head is tied "
            "to the word embedding; set it to false"
        )


def check_moe(cfg: Config) -> None:
    """Mixture-of-experts options: top-k within the experts, the layer pattern, capacity, groups,
    widths TP divides; ``moe_*`` keys only with experts to apply them to."""
    m, tp = cfg.model, cfg.parallel.tensor_parallel_size
    experts, ep = m.num_experts, cfg.parallel.expert_parallel_size
    if experts is None and ep > 1:
        raise ConfigError(
            f"parallel.expert_parallel_size={ep} splits experts, and model.num_experts is null "
            "(a dense model); set it to 1"
        )
    if experts is not None and experts % ep:
        raise ConfigError(
            f"parallel.expert_parallel_size={ep} does not divide model.num_experts={experts}; "
            f"use {divisors(experts)}"
        )
    if experts is None:
        changed = [
            f"model.{name}"
            for name, value in vars(ModelConfig(1, 1, 1, 1)).items()
            if name.startswith("moe_") and getattr(m, name) != value
        ]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)} set but model.num_experts is null (dense MLPs); set "
                "num_experts or remove them"
            )
        return
    if not 1 <= m.moe_router_topk <= experts:
        raise ConfigError(
            f"model.moe_router_topk={m.moe_router_topk} must be between 1 and model.num_experts"
            f"={experts}; fix it"
        )
    freq = m.moe_layer_freq
    if isinstance(freq, list) and (len(freq) != m.num_layers or set(freq) - {0, 1}):
        raise ConfigError(
            f"model.moe_layer_freq={freq} must hold one 0 or 1 per layer (model.num_layers="
            f"{m.num_layers}); give {m.num_layers} entries, or an integer k (every k-th layer)"
        )
    if isinstance(freq, int) and freq < 1:
        raise ConfigError(f"model.moe_layer_freq={freq} must be at least 1 (every k-th layer)")
    factor = m.moe_expert_capacity_factor
    if factor is not None and not factor > 0:
        raise ConfigError(
            f"model.moe_expert_capacity_factor={factor} must be positive; null is dropless"
        )
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ConfigError(
            "group-limited routing needs both model.moe_router_num_groups and "
            "model.moe_router_group_topk (or neither); set the other"
        )
    if groups is not None:
        if groups < 1 or experts % groups:
            raise ConfigError(
                f"model.moe_router_num_groups={groups} does not divide model.num_experts="
                f"{experts} into equal groups; use {divisors(experts)}"
            )
        if not 1 <= group_topk <= groups or m.moe_router_topk % group_topk:
            raise ConfigError(
                f"model.moe_router_group_topk={group_topk} must be between 1 and "
                f"moe_router_num_groups={groups} and divide moe_router_topk={m.moe_router_topk}"
            )
        if m.moe_router_topk // group_topk > experts // groups:
            raise ConfigError(
                f"model.moe_router_topk={m.moe_router_topk} over moe_router_group_topk="
                f"{group_topk} groups takes more experts per group than its {experts // groups}"
            )
    for key, width in (
        ("moe_ffn_hidden_size", m.expert_ffn_hidden_size),
        ("moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size),
    ):
        if width is not None and (width < 1 or width % tp):
            raise ConfigError(
                f"model.{key}={width} must be positive and divisible by "
                f"parallel.tensor_parallel_size={tp}; use {multiples(width, tp)}"
            )
    if m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size is None:
        raise ConfigError(
            "model.moe_shared_expert_gate=true gates the shared expert; set "
            "model.moe_shared_expert_intermediate_size too"
        )
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be zero or positive")
    if m.add_bias_linear:
        raise ConfigError(
            "model.add_bias_linear=true: experts carry no biases (as in Mixtral, Qwen-MoE and "
            "DeepSeek); set add_bias_linear=false with model.num_experts (add_qkv_bias stays)"
        )
    if m.type == "bert":
        raise ConfigError(
            "model.num_experts is for GPT-family decoders (pretrain_gpt.py); BERT trains dense"
        )
