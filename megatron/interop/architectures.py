"""Every HF architecture we convert, found by config.json's name or by our checkpoint's kind."""

from __future__ import annotations

from typing import Any

from megatron.config.schema import Config
from megatron.errors import ConfigError
from megatron.interop import bert, gpt2
from megatron.interop.mapping import Architecture

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in [gpt2.GPT2(), *bert.ARCHITECTURES]}
# config.json without "architectures": the task model each model_type means.
_BY_MODEL_TYPE = {
    "gpt2": "GPT2LMHeadModel",
    "bert": "BertForPreTraining",
    "megatron-bert": "MegatronBertForPreTraining",
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


def for_checkpoint(kind: str, cfg: Config) -> Architecture:
    """The architecture our ``kind`` ("gpt"/"bert") model of ``cfg`` exports as."""
    if kind == "gpt":
        return ARCHITECTURES["GPT2LMHeadModel"]
    binary = cfg.bert.binary_head != "none"
    position = cfg.model.layernorm_position
    return next(
        a
        for a in bert.ARCHITECTURES
        if a.layernorm_position == position and a.binary_head == binary
    )
