"""A tiny model configuration for model-level tests."""

from megatron.config.model import ModelConfig


def tiny_model_config(**overrides) -> ModelConfig:
    """4 heads, hidden 32, 2 layers, seq 16, dropout off unless overridden."""
    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=128,
        seq_length=16,
        max_position_embeddings=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return ModelConfig(**fields)
