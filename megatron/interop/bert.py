"""Our BERT as HF's BertForPreTraining (post-LN) or MegatronBertForPreTraining (pre-LN), and back.

::

    ours                                 Bert*ForPreTraining
    embedding.word/.position/.tokentype  bert.embeddings.word_/position_/token_type_embeddings
    embedding_ln (post-LN)               bert.embeddings.LayerNorm
    transformer.layers.{i}               bert.encoder.layer.{i}
      attention.qkv  [3h, h]               attention.self.query, key, value   [h, h] each
      attention.dense                      attention.output.dense
      ln1 / ln2  (post-LN)                 attention.output.LayerNorm / output.LayerNorm
      ln1 / ln2  (pre-LN)                  attention.ln / ln
      mlp.fc1 / fc2                        intermediate.dense / output.dense
    transformer.final_ln (pre-LN)        bert.encoder.ln
    lm_head.dense, .layernorm, .bias     cls.predictions.transform.dense, .LayerNorm, .bias
                                         (decoder: tied to the word table and that bias)
    pooler, binary_head                  bert.pooler.dense, cls.seq_relationship

Our ``is_random`` label 1 means the segments were swapped; HF's class 0 is "in order", so the
binary head maps as it is. A model without a binary head (``bert.binary_head=none``) is the
``...ForMaskedLM`` class. Without token types (``bert.num_tokentypes=0``) the export holds a
zero table of one row, which adds exactly nothing; an import of a one-row table folds that row
into the position table (one float add per element).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megatron.config.schema import Config
from megatron.data.tokenizers.base import Tokenizer
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

_CONFIG_KEYS: ConfigKeys = {
    "num_layers": ("num_hidden_layers", 12),
    "hidden_size": ("hidden_size", 768),
    "num_attention_heads": ("num_attention_heads", 12),
    "ffn_hidden_size": ("intermediate_size", 3072),
    "max_position_embeddings": ("max_position_embeddings", 512),
    "hidden_dropout": ("hidden_dropout_prob", 0.1),
    "attention_dropout": ("attention_probs_dropout_prob", 0.1),
    "layernorm_epsilon": ("layer_norm_eps", 1e-12),
    "init_method_std": ("initializer_range", 0.02),
}
_TOKEN_TYPES = "bert.embeddings.token_type_embeddings.weight"
_POSITIONS = "bert.embeddings.position_embeddings.weight"
_QKV = "attention.self.query.{p} attention.self.key.{p} attention.self.value.{p}"
_LAYER = [
    ("attention.qkv.weight", _QKV.format(p="weight"), "qkv_split"),
    ("attention.qkv.bias", _QKV.format(p="bias"), "qkv_split"),
    *weight_and_bias("attention.dense", "attention.output.dense"),
    *weight_and_bias("mlp.fc1", "intermediate.dense"),
    *weight_and_bias("mlp.fc2", "output.dense"),
]
_LAYER_NORMS = {
    "post": {"ln1": "attention.output.LayerNorm", "ln2": "output.LayerNorm"},
    "pre": {"ln1": "attention.ln", "ln2": "ln"},
}


def _layer_pairs(position: str) -> list[tuple[str, str, str]]:
    """(our suffix, HF suffix(es), kind) for one layer, its LayerNorms placed per ``position``."""
    norms = _LAYER_NORMS[position].items()
    return _LAYER + [pair for ours, hf in norms for pair in weight_and_bias(ours, hf)]


class Bert(Architecture):
    """One of BertFor{PreTraining,MaskedLM} (post-LN) and MegatronBertFor... (pre-LN)."""

    base_prefix = "bert"
    head_prefixes = ("cls",)
    tied = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }
    ignored = ("embeddings.position_ids",)
    kind = "bert"

    def __init__(self, layernorm_position: str, binary_head: bool):
        self.layernorm_position, self.binary_head = layernorm_position, binary_head
        family = "MegatronBert" if layernorm_position == "pre" else "Bert"
        self.name = f"{family}For{'PreTraining' if binary_head else 'MaskedLM'}"
        self.model_type = "megatron-bert" if layernorm_position == "pre" else "bert"

    def rules(self, cfg: Config) -> list[Rule]:
        """Embeddings, every layer, the final LayerNorm (pre-LN), the heads."""
        rules = [
            Rule("embedding.word.weight", ("bert.embeddings.word_embeddings.weight",)),
            Rule("embedding.position.weight", (_POSITIONS,)),
        ]
        if cfg.bert.num_tokentypes:
            rules.append(Rule("embedding.tokentype.weight", (_TOKEN_TYPES,)))
        if self.layernorm_position == "post":
            rules += module_rules("embedding_ln", "bert.embeddings.LayerNorm")
        rules += layer_rules(
            cfg.model.num_layers, "bert.encoder.layer.{i}.", _layer_pairs(self.layernorm_position)
        )
        if self.layernorm_position == "pre":
            rules += module_rules("transformer.final_ln", "bert.encoder.ln")
        rules += module_rules("lm_head.dense", "cls.predictions.transform.dense")
        rules += module_rules("lm_head.layernorm", "cls.predictions.transform.LayerNorm")
        rules.append(Rule("lm_head.bias", ("cls.predictions.bias",)))
        if self.binary_head:
            rules += module_rules("pooler", "bert.pooler.dense")
            rules += module_rules("binary_head", "cls.seq_relationship")
        return rules

    def export_tensors(self, cfg: Config, ours: dict[str, Tensor]) -> dict[str, Tensor]:
        """As the rules say, plus a zero token-type row for a model without token types."""
        tensors = super().export_tensors(cfg, ours)
        if not cfg.bert.num_tokentypes:
            tensors[_TOKEN_TYPES] = torch.zeros(1, cfg.model.hidden_size)
        return tensors

    def import_tensors(self, cfg: Config, hf: dict[str, Tensor], where: str) -> dict[str, Tensor]:
        """As the rules say; a one-row token-type table is added into the position table."""
        if not cfg.bert.num_tokentypes and _TOKEN_TYPES in hf:
            hf = dict(hf)
            row = hf.pop(_TOKEN_TYPES)  # [1, h]: every token has type 0
            if row.any():
                hf[_POSITIONS] = hf[_POSITIONS] + row
        return super().import_tensors(cfg, hf, where)

    def hf_config(self, cfg: Config, vocab_size: int, tokenizer: Tokenizer) -> dict[str, Any]:
        """BertConfig's (or MegatronBertConfig's) keys."""
        m = cfg.model
        return {
            "architectures": [self.name],
            "model_type": self.model_type,
            "vocab_size": vocab_size,
            **to_hf_config(_CONFIG_KEYS, m),
            "hidden_act": ACTIVATION_TO_HF[m.activation],
            "type_vocab_size": max(cfg.bert.num_tokentypes, 1),
            "pad_token_id": tokenizer.pad if tokenizer.pad is not None else 0,
            "position_embedding_type": "absolute",
            "tie_word_embeddings": True,
        }

    def sections(self, hf: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
        """model.* and bert.* from BertConfig's keys (its defaults where config.json omits one)."""
        require(hf, "position_embedding_type", "absolute", where)
        require(hf, "is_decoder", False, where)
        require(hf, "add_cross_attention", False, where)
        model = from_hf_config(_CONFIG_KEYS, hf)
        model.update(
            seq_length=model["max_position_embeddings"],
            layernorm_position=self.layernorm_position,
            activation=activation_from_hf(hf.get("hidden_act", "gelu"), "hidden_act", where),
        )
        types = hf.get("type_vocab_size", 2)
        bert = {
            # Our data pipeline makes sentence-order pairs; the head is the same classifier.
            "binary_head": "sop" if self.binary_head else "none",
            "num_tokentypes": types if types > 1 else 0,
        }
        return {"model": model, "bert": bert}


ARCHITECTURES = [Bert(position, binary) for position in ("post", "pre") for binary in (True, False)]
