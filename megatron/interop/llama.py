"""Our RoPE + RMSNorm + SwiGLU GPT as HF's LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
or Qwen3ForCausalLM, and back.

::

    ours                                  *ForCausalLM
    embedding.word                        model.embed_tokens         (no position table: RoPE)
    transformer.layers.{i}                model.layers.{i}
      ln1, ln2                              input_layernorm, post_attention_layernorm
      attention.qkv [(heads + 2 groups) d]  self_attn.q_proj [heads d], k_proj, v_proj [groups d]
                                            (rows; the biases too: Qwen2)
      attention.q_norm, k_norm [d]          self_attn.q_norm, k_norm   (Qwen3)
      attention.dense                       self_attn.o_proj
      mlp.fc1 [2 ffn], rows interleaved     mlp.gate_proj, up_proj [ffn] each
      mlp.fc2                               mlp.down_proj
    transformer.final_ln                  model.norm
    output_layer                          lm_head   (tie_word_embeddings: a copy of embed_tokens)

In transformers 5.24 the four classes compute one decoder: Mistral is Llama without its bias
switches (and with a sliding window), Qwen2 adds the QKV bias, Qwen3 the QK norms. A config.json
that says anything our model cannot compute exactly is refused in one line naming its key.
"""

from __future__ import annotations

from typing import Any

from megatron.config.model import ModelConfig
from megatron.config.schema import Config
from megatron.data.tokenizers.base import Tokenizer
from megatron.errors import ConfigError
from megatron.interop.mapping import (
    Architecture,
    ConfigKeys,
    Rule,
    from_hf_config,
    layer_rules,
    require,
    to_hf_config,
)

# Our model.* key -> (config.json key, the default all four classes share); None: per class.
_CONFIG_KEYS: ConfigKeys = {
    "num_layers": ("num_hidden_layers", 32),
    "hidden_size": ("hidden_size", 4096),
    "num_attention_heads": ("num_attention_heads", 32),
    "num_query_groups": ("num_key_value_heads", None),
    "kv_channels": ("head_dim", None),
    "ffn_hidden_size": ("intermediate_size", None),
    "max_position_embeddings": ("max_position_embeddings", None),
    "layernorm_epsilon": ("rms_norm_eps", 1e-6),
    "init_method_std": ("initializer_range", 0.02),
    "attention_dropout": ("attention_dropout", 0.0),
}
LAYER = "model.layers.{i}."
# A dense SwiGLU MLP (our suffix, HF suffixes, conversion), in every layer of these classes.
MLP = [
    ("mlp.fc1.weight", "mlp.gate_proj.weight mlp.up_proj.weight", "swiglu"),
    ("mlp.fc2.weight", "mlp.down_proj.weight", "same"),
]
_QKV = "self_attn.q_proj.{p} self_attn.k_proj.{p} self_attn.v_proj.{p}"
_NORMS = ("q_norm", "k_norm")
# Config keys that describe what we do not hold: a mixture of experts, quantized weights.
_MOE = "a mixture of experts (we convert dense MLPs only)"
_REFUSED = {
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), _MOE),
    **dict.fromkeys(("num_experts_per_tok", "moe_intermediate_size"), _MOE),
    "quantization_config": "quantized weights (convert the unquantized model)",
}
# What all four classes are, in our model.* keys: imports set them, exports need them.
FORM = {
    "position_embedding_type": "rope",
    "normalization": "rmsnorm",
    "activation": "swiglu",
    "add_bias_linear": False,
    "layernorm_position": "pre",
    "rotary_percent": 1.0,
}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor")
_ORIGINAL = "original_max_position_embeddings"


def _rope(hf: dict[str, Any], max_positions: int, where: str) -> tuple[float, dict | None]:
    """RoPE's theta and Llama 3.1 scaling from either spelling: 5.x's ``rope_parameters``, or
    the older top-level ``rope_theta`` beside ``rope_scaling`` (which transformers reads first)."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ConfigError(
            f"{where}: {key}.rope_type={kind!r} is not supported: our RoPE computes "
            "transformers' 'default' and 'llama3' frequencies only"
        )
    known = _ROPE_KEYS | ({*_LLAMA3, _ORIGINAL} if kind == "llama3" else set())
    extra = sorted(set(params) - known)
    if extra:
        raise ConfigError(f"{where}: {key}.{extra[0]} has no counterpart in our {kind} RoPE")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(
            f"{where}: partial_rotary_factor={partial} is not supported: transformers' "
            "Llama-family classes rotate every channel whatever it says, so the weights' meaning "
            "is unclear; set it to 1.0 if the model was trained rotating every channel"
        )
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, None
    missing = [k for k in _LLAMA3 if k not in params]
    if missing:
        raise ConfigError(f"{where}: {key} (llama3) has no {missing[0]}; restore config.json")
    scaling = {k: float(params[k]) for k in _LLAMA3}
    # transformers takes a top-level original_max_position_embeddings first (Phi-3's spelling).
    original = hf.get(_ORIGINAL, params.get(_ORIGINAL, max_positions))
    return theta, {**scaling, _ORIGINAL: float(original)}


class LlamaFamily(Architecture):
    """One of LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM."""

    kind = "gpt"
    base_prefix = "model"
    head_prefixes = ("lm_head",)
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    ignored = ("rotary_emb.inv_freq",)  # older transformers saved RoPE's frequencies
    refused = _REFUSED  # config.json keys whose (truthy) presence means what we do not hold

    def __init__(
        self,
        name: str,
        defaults: dict[str, Any],
        required: dict[str, Any],
        qkv_bias: bool = False,
        qk_norm: bool = False,
    ):
        """``defaults``: the class's own config.json defaults (by HF key); ``required``: keys
        whose other values add what we have not (biases, sliding windows), with the one we hold."""
        self.name, self.model_type = name, name.removesuffix("ForCausalLM").lower()
        self.keys = {o: (h, defaults.get(h, d)) for o, (h, d) in _CONFIG_KEYS.items()}
        self.defaults, self.required = defaults, required
        self.qkv_bias, self.qk_norm = qkv_bias, qk_norm

    def rules(self, cfg: Config) -> list[Rule]:
        """Embeddings, every layer, the final norm, the untied head."""
        m = cfg.model
        attention = [("attention.qkv.weight", _QKV.format(p="weight"), "qkv_split")]
        if m.add_qkv_bias:
            attention.append(("attention.qkv.bias", _QKV.format(p="bias"), "qkv_split"))
        if m.qk_layernorm:
            attention += [
                (f"attention.{n}.weight", f"self_attn.{n}.weight", "same") for n in _NORMS
            ]
        layer = [
            ("ln1.weight", "input_layernorm.weight", "same"),
            *attention,
            ("attention.dense.weight", "self_attn.o_proj.weight", "same"),
            ("ln2.weight", "post_attention_layernorm.weight", "same"),
        ]
        rules = [
            Rule("embedding.word.weight", ("model.embed_tokens.weight",)),
            *layer_rules(m.num_layers, LAYER, layer),
            *self.mlp_rules(m),
            Rule("transformer.final_ln.weight", ("model.norm.weight",)),
        ]
        if m.untie_embeddings_and_output_weights:
            rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
        return rules

    def mlp_rules(self, m: ModelConfig) -> list[Rule]:
        """Every layer's MLP: a dense SwiGLU."""
        return layer_rules(m.num_layers, LAYER, MLP)

    def tied_copies(self, cfg: Config) -> dict[str, str]:
        """lm_head is a copy of the word table only in a tied model."""
        return {} if cfg.model.untie_embeddings_and_output_weights else self.tied

    def hf_config(self, cfg: Config, vocab_size: int, tokenizer: Tokenizer) -> dict[str, Any]:
        """The keys 5.24's save_pretrained writes for this class."""
        m = cfg.model
        rope: dict[str, Any] = {"rope_theta": m.rotary_base, "rope_type": "default"}
        if m.rope_scaling is not None:
            original = m.rope_scaling[_ORIGINAL]
            rope = {
                **{k: m.rope_scaling[k] for k in _LLAMA3},
                _ORIGINAL: int(original) if float(original).is_integer() else original,
                **rope,
                "rope_type": "llama3",
            }
        # Mistral's sliding_window defaults to 4096 where config.json omits it; write null.
        window = {"sliding_window": None} if "sliding_window" in self.defaults else {}
        return {
            "architectures": [self.name],
            "model_type": self.model_type,
            "vocab_size": vocab_size,
            **to_hf_config(self.keys, m),
            # Spelled out where ours are null (one per head, hidden / heads): the classes'
            # defaults differ (Qwen3's head_dim is 128).
            "num_key_value_heads": m.query_groups,
            "head_dim": m.head_dim,
            "hidden_act": "silu",
            "rope_parameters": rope,
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
            "bos_token_id": None,  # our tokenizers name no beginning-of-text token
            "eos_token_id": tokenizer.eod,
            "pad_token_id": tokenizer.pad,
            "use_cache": True,
            **self.required,
            **window,
        }

    def _refuse(self, hf: dict[str, Any], max_positions: int, where: str) -> None:
        """ConfigError for what our model cannot compute exactly."""
        require(hf, "hidden_act", "silu", where)
        for key, value in self.required.items():
            require(hf, key, value, where)
        for key, what in self.refused.items():
            if hf.get(key):
                raise ConfigError(f"{where}: {key}={hf[key]!r} means {what}; it does not convert")
        sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
        if sliding:
            raise ConfigError(
                f"{where}: layer_types holds {sliding[0]!r}; our attention is full causal "
                "attention in every layer, so only 'full_attention' layers convert"
            )
        window = hf.get("sliding_window", self.defaults.get("sliding_window"))
        # A window no shorter than the position table never hides a key: full attention.
        if "sliding_window" in self.defaults and window is not None and window < max_positions:
            raise ConfigError(
                f"{where}: sliding_window={window} (below max_position_embeddings="
                f"{max_positions}) limits attention, ours attends to every earlier position; "
                "only null (or a window spanning every position) converts"
            )

    def sections(self, hf: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
        """model.* from the class's keys (its defaults where config.json omits one)."""
        model = from_hf_config(self.keys, hf)
        self._refuse(hf, model["max_position_embeddings"], where)
        # The class's own theta where config.json names none (Mixtral's is 1e6).
        theta_default = {"rope_theta": self.defaults.get("rope_theta", 10000.0)}
        theta, scaling = _rope({**theta_default, **hf}, model["max_position_embeddings"], where)
        model.update(
            # Training samples: the model's context, capped, since recent models' 128k positions
            # are a long-context extension of shorter pretraining, and a 128k sample's attention
            # fits no single device; override model.seq_length to train longer.
            seq_length=min(model["max_position_embeddings"], 4096),
            hidden_dropout=0.0,  # these classes have no dropout but the attention's
            **FORM,
            rotary_base=theta,
            rope_scaling=scaling,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        )
        return {"model": model}


_NO_BIAS = {"attention_bias": False}
_QWEN = {"intermediate_size": 22016, "max_position_embeddings": 32768, "num_key_value_heads": 32}
ARCHITECTURES = [
    LlamaFamily(
        "LlamaForCausalLM",
        {"intermediate_size": 11008, "max_position_embeddings": 2048},
        {**_NO_BIAS, "mlp_bias": False},
    ),
    LlamaFamily(
        "MistralForCausalLM",
        {
            "intermediate_size": 14336,
            "max_position_embeddings": 131072,
            "num_key_value_heads": 8,
            "sliding_window": 4096,
        },
        {},
    ),
    LlamaFamily("Qwen2ForCausalLM", _QWEN, {"use_sliding_window": False}, qkv_bias=True),
    LlamaFamily(
        "Qwen3ForCausalLM",
        {**_QWEN, "head_dim": 128},
        {**_NO_BIAS, "use_sliding_window": False},
        qk_norm=True,
    ),
]
