"""Every HF architecture we convert, found by config.json's name or by our checkpoint's config."""

from __future__ import annotations

from typing import Any

from megatron.config.model import ModelConfig
from megatron.config.schema import Config
from megatron.errors import ConfigError
from megatron.interop import bert, gpt2, llama, moe
from megatron.interop.mapping import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in [gpt2.GPT2(), *bert.ARCHITECTURES, *llama.ARCHITECTURES, *moe.ARCHITECTURES.values()]
}
# config.json without "architectures": the task model each model_type means.
_BY_MODEL_TYPE = {
    "gpt2": "GPT2LMHeadModel",
    "bert": "BertForPreTraining",
    "megatron-bert": "MegatronBertForPreTraining",
    **{a.model_type: a.name for a in [*llama.ARCHITECTURES, *moe.ARCHITECTURES.values()]},
}
# What GPT2LMHeadModel and the BERT classes hold (our defaults, learned positions): a model with
# another value of any of these has none of their forms.
_CLASSIC = {
    "position_embedding_type": ("learned",),
    "normalization": ("layernorm",),
    "activation": ("gelu", "gelu_tanh"),
    "num_query_groups": (None,),
    "kv_channels": (None,),
    "add_bias_linear": (True,),
    "add_qkv_bias": (False,),
    "qk_layernorm": (False,),
    "untie_embeddings_and_output_weights": (False,),
}


def from_config_json(hf: dict[str, Any], where: str) -> Architecture:
    """The architecture config.json names; ConfigError for one we do not convert."""
    names = hf.get("architectures") or [_BY_MODEL_TYPE.get(hf.get("model_type"), None)]
    name = names[0] if isinstance(names, list) and names else None
    if name not in ARCHITECTURES:
        shown = name or f"model_type {hf.get('model_type')!r}"
        raise ConfigError(
            f"{where}: {shown} is not supported; import_hf converts {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def _llama_family(m: ModelConfig, imported: str | None) -> Architecture:
    """The class a RoPE GPT exports as: Qwen3 with QK norms, Qwen2 with a QKV bias, else Llama
    (Mistral when ``imported`` from one, so the round trip keeps its class); with experts, the
    mixture-of-experts class that holds it (``moe.for_model``)."""
    names = [a.name for a in llama.ARCHITECTURES]
    for key, held in llama.FORM.items():
        if getattr(m, key) != held:
            raise ConfigError(
                f"model.{key}={getattr(m, key)}: the Llama-family classes ({', '.join(names)}) "
                f"hold only {key}={held} with RoPE, and GPT2LMHeadModel has learned positions; "
                "no Hugging Face class we export holds this GPT exactly"
            )
    if m.num_experts is not None:
        return moe.for_model(m)
    if m.qk_layernorm and m.add_qkv_bias:
        raise ConfigError(
            "model.add_qkv_bias=True with model.qk_layernorm=True: Qwen3ForCausalLM's "
            "attention_bias also adds an output-projection bias, which we have not; no Hugging "
            "Face class we export holds this GPT exactly"
        )
    if m.qk_layernorm:
        return ARCHITECTURES["Qwen3ForCausalLM"]
    if m.add_qkv_bias:
        return ARCHITECTURES["Qwen2ForCausalLM"]
    mistral = imported == "MistralForCausalLM"
    return ARCHITECTURES["MistralForCausalLM" if mistral else "LlamaForCausalLM"]


def for_checkpoint(kind: str, cfg: Config, imported: str | None = None) -> Architecture:
    """The architecture our ``kind`` ("gpt"/"bert") model of ``cfg`` exports as; ``imported``:
    the HF class it was imported from, if any. ConfigError (naming our model.* key) for a model
    no class we export holds exactly."""
    m = cfg.model
    if kind == "gpt" and m.position_embedding_type != "learned":
        return _llama_family(m, imported)
    for key, held in _CLASSIC.items():
        if getattr(m, key) not in held:
            holders = "GPT2LMHeadModel holds" if kind == "gpt" else "the BERT classes hold"
            others = (
                ", and the Llama-family classes need model.position_embedding_type=rope"
                if kind == "gpt"
                else ""
            )
            raise ConfigError(
                f"model.{key}={getattr(m, key)}: {holders} only {key}="
                f"{' or '.join(map(str, held))}{others}; no Hugging Face class we export holds "
                f"this {kind.upper()} exactly"
            )
    if kind == "gpt":
        return ARCHITECTURES["GPT2LMHeadModel"]
    binary = cfg.bert.binary_head != "none"
    position = cfg.model.layernorm_position
    return next(
        a
        for a in bert.ARCHITECTURES
        if a.layernorm_position == position and a.binary_head == binary
    )
