"""Our pre-LN GPT as HF's GPT2LMHeadModel, and back.

::

    ours                                    GPT2LMHeadModel
    embedding.word / .position              transformer.wte / .wpe     (lm_head: tied to wte)
    transformer.layers.{i}.ln1, ln2         transformer.h.{i}.ln_1, ln_2
      attention.qkv     [3h, h]             attn.c_attn   Conv1D [h, 3h], columns [q | k | v]
      attention.dense   [h, h]              attn.c_proj   Conv1D [h, h]
      mlp.fc1 / fc2                         mlp.c_fc / c_proj (Conv1D)
    transformer.final_ln                    transformer.ln_f

GPT-2 is pre-LN only: a post-LN GPT has no GPT-2 form and is refused.
"""

from __future__ import annotations

from typing import Any

from megatron.config.schema import Config
from megatron.data.tokenizers.base import Tokenizer
from megatron.errors import ConfigError
from megatron.interop.mapping import (
    ACTIVATION_TO_HF,
    Architecture,
    ConfigKeys,
    Rule,
    activation_from_hf,
    from_hf_config,
    layer_rules,
    module_rules,
    require,
    to_hf_config,
    weight_and_bias,
)

_LAYER = [
    *weight_and_bias("ln1", "ln_1"),
    ("attention.qkv.weight", "attn.c_attn.weight", "qkv_t"),
    ("attention.qkv.bias", "attn.c_attn.bias", "qkv"),
    ("attention.dense.weight", "attn.c_proj.weight", "t"),
    ("attention.dense.bias", "attn.c_proj.bias", "same"),
    *weight_and_bias("ln2", "ln_2"),
    ("mlp.fc1.weight", "mlp.c_fc.weight", "t"),
    ("mlp.fc1.bias", "mlp.c_fc.bias", "same"),
    ("mlp.fc2.weight", "mlp.c_proj.weight", "t"),
    ("mlp.fc2.bias", "mlp.c_proj.bias", "same"),
]


_CONFIG_KEYS: ConfigKeys = {
    "num_layers": ("n_layer", 12),
    "hidden_size": ("n_embd", 768),
    "num_attention_heads": ("n_head", 12),
    "max_position_embeddings": ("n_positions", 1024),
    "hidden_dropout": ("resid_pdrop", 0.1),
    "attention_dropout": ("attn_pdrop", 0.1),
    "layernorm_epsilon": ("layer_norm_epsilon", 1e-5),
    "init_method_std": ("initializer_range", 0.02),
}


class GPT2(Architecture):
    """GPT2LMHeadModel."""

    name = "GPT2LMHeadModel"
    model_type = "gpt2"
    kind = "gpt"
    base_prefix = "transformer"
    head_prefixes = ("lm_head",)
    tied = {"lm_head.weight": "transformer.wte.weight"}
    # The causal-mask buffers older transformers saved with every layer.
    ignored = (".attn.bias", ".attn.masked_bias")

    def rules(self, cfg: Config) -> list[Rule]:
        """Embeddings, every layer, the final LayerNorm."""
        return [
            Rule("embedding.word.weight", ("transformer.wte.weight",)),
            Rule("embedding.position.weight", ("transformer.wpe.weight",)),
            *layer_rules(cfg.model.num_layers, "transformer.h.{i}.", _LAYER),
            *module_rules("transformer.final_ln", "transformer.ln_f"),
        ]

    def hf_config(self, cfg: Config, vocab_size: int, tokenizer: Tokenizer) -> dict[str, Any]:
        """GPT2Config's keys; refuses a post-LN model."""
        m = cfg.model
        if m.layernorm_position != "pre":
            raise ConfigError(
                "model.layernorm_position=post: GPT-2 is pre-LN only, so a post-LN GPT has no "
                "GPT2LMHeadModel form; only pre-LN GPTs export"
            )
        return {
            "architectures": [self.name],
            "model_type": self.model_type,
            "vocab_size": vocab_size,
            **to_hf_config(_CONFIG_KEYS, m),
            "n_inner": m.ffn_hidden_size,
            "activation_function": ACTIVATION_TO_HF[m.activation],
            "embd_pdrop": m.hidden_dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "bos_token_id": tokenizer.eod,
            "eos_token_id": tokenizer.eod,
            "tie_word_embeddings": True,
        }

    def sections(self, hf: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
        """model.* from GPT2Config's keys (its defaults where config.json omits one)."""
        require(hf, "scale_attn_weights", True, where)
        require(hf, "scale_attn_by_inverse_layer_idx", False, where)
        require(hf, "reorder_and_upcast_attn", False, where)
        require(hf, "add_cross_attention", False, where)
        model = from_hf_config(_CONFIG_KEYS, hf)
        activation = hf.get("activation_function", "gelu_new")
        model.update(
            ffn_hidden_size=hf.get("n_inner") or 4 * model["hidden_size"],
            seq_length=model["max_position_embeddings"],
            layernorm_position="pre",
            activation=activation_from_hf(activation, "activation_function", where),
        )
        return {"model": model}
