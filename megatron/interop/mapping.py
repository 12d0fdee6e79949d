"""Renaming and reshaping between our full (TP=1, unpadded) state dict and a HF one.

A ``Rule`` pairs one of our keys with the HF key(s) it becomes and names the conversion. Both
directions read the same rule list, so export and import cannot disagree. Our fused QKV matrix
orders its rows [head, (q, k, v), head_dim] (whole heads per TP rank); HF orders them
[(q, k, v), head, head_dim], as one matrix (GPT-2's ``c_attn``) or three (BERT's query, key,
value). GPT-2's ``Conv1D`` stores its weight as [in, out], the transpose of ``nn.Linear``'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron.config.schema import Config
from megatron.data.tokenizers.base import Tokenizer
from megatron.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """Our state-dict key, the HF key(s) holding the same numbers, and the conversion's name:
    ``same``, ``t`` (Conv1D, transposed), ``qkv`` (fused QKV bias), ``qkv_t`` (fused QKV Conv1D
    weight) or ``qkv_split`` (QKV as separate q, k, v tensors)."""

    ours: str
    hf: tuple[str, ...]
    kind: str = "same"


def _by_head(t: Tensor, heads: int) -> Tensor:
    """Rows [(q, k, v), head, head_dim] -> [head, (q, k, v), head_dim] (ours)."""
    rest = t.shape[1:]
    # [3, heads, head_dim, *rest] -> [heads, 3, head_dim, *rest]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def _by_part(t: Tensor, heads: int) -> Tensor:
    """Rows [head, (q, k, v), head_dim] (ours) -> [(q, k, v), head, head_dim]."""
    rest = t.shape[1:]
    # [heads, 3, head_dim, *rest] -> [3, heads, head_dim, *rest]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


Convert = Callable[[tuple[Tensor, ...], int], tuple[Tensor, ...]]
# kind -> (ours -> HF, HF -> ours); each takes a tuple of tensors and the number of heads.
CONVERSIONS: dict[str, tuple[Convert, Convert]] = {
    "same": (lambda ts, h: ts, lambda ts, h: ts),
    "t": (lambda ts, h: (ts[0].t(),), lambda ts, h: (ts[0].t(),)),
    "qkv": (
        lambda ts, h: (_by_part(ts[0], h),),
        lambda ts, h: (_by_head(ts[0], h),),
    ),
    "qkv_t": (
        lambda ts, h: (_by_part(ts[0], h).t(),),
        lambda ts, h: (_by_head(ts[0].t(), h),),
    ),
    "qkv_split": (
        lambda ts, h: _by_part(ts[0], h).chunk(3),
        lambda ts, h: (_by_head(torch.cat(ts), h),),
    ),
}


def to_hf(rules: list[Rule], ours: dict[str, Tensor], heads: int) -> dict[str, Tensor]:
    """HF tensors (contiguous copies) from our full state dict; every key of ``ours`` is used."""
    unused = set(ours) - {r.ours for r in rules}
    if unused:
        raise ValueError(f"no HF name for {sorted(unused)[0]}: the mapping is incomplete")
    out = {}
    for rule in rules:
        converted = CONVERSIONS[rule.kind][0]((ours[rule.ours],), heads)
        out.update({k: t.contiguous().clone() for k, t in zip(rule.hf, converted, strict=True)})
    return out


def from_hf(rules: list[Rule], hf: dict[str, Tensor], heads: int, where: str) -> dict[str, Tensor]:
    """Our full state dict from HF tensors; ConfigError naming ``where`` for a missing tensor."""
    out = {}
    for rule in rules:
        missing = [k for k in rule.hf if k not in hf]
        if missing:
            raise ConfigError(f"{where} has no tensor {missing[0]}: not a complete model")
        converted = CONVERSIONS[rule.kind][1](tuple(hf[k] for k in rule.hf), heads)
        out[rule.ours] = converted[0].contiguous().clone()
    return out


def weight_and_bias(ours: str, hf: str) -> list[tuple[str, str, str]]:
    """(our suffix, HF suffix, "same") for the weight and the bias of one module."""
    return [(f"{ours}.{p}", f"{hf}.{p}", "same") for p in ("weight", "bias")]


def module_rules(ours: str, hf: str) -> list[Rule]:
    """Rules for the weight and the bias of one module outside the layers."""
    return [Rule(o, (h,), kind) for o, h, kind in weight_and_bias(ours, hf)]


def layer_rules(num_layers: int, prefix: str, pairs: list[tuple[str, str, str]]) -> list[Rule]:
    """Per-layer rules from ``pairs`` of (our suffix, HF suffix(es), kind): several HF suffixes
    are separated by spaces, and each follows ``prefix`` with ``{i}`` the layer index."""
    return [
        Rule(
            f"transformer.layers.{i}.{ours}",
            tuple(prefix.format(i=i) + h for h in hf.split()),
            kind,
        )
        for i in range(num_layers)
        for ours, hf, kind in pairs
    ]


# Our ``model.activation`` and HF's names. ``gelu_new`` is GPT-2's own tanh formula, which
# F.gelu(approximate="tanh") computes up to float rounding (~1e-7); it is what released GPT-2
# configs name, so every consumer of GPT-2 understands it. HF's ``gelu`` is the exact erf form.
ACTIVATION_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
ACTIVATION_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def activation_from_hf(name: object, key: str, where: str) -> str:
    """Our ``model.activation`` for HF's ``name`` (config key ``key``); ConfigError otherwise."""
    if name not in ACTIVATION_FROM_HF:
        raise ConfigError(
            f"{where}: {key}={name!r} has no counterpart here; supported: "
            f"{', '.join(ACTIVATION_FROM_HF)}"
        )
    return ACTIVATION_FROM_HF[name]


# Our model.* key -> (config.json key, HF's default when config.json omits it): one table per
# architecture, read by export (``to_hf_config``) and import (``from_hf_config``) alike.
ConfigKeys = dict[str, tuple[str, Any]]


def to_hf_config(keys: ConfigKeys, model: Any) -> dict[str, Any]:
    """config.json's values of the keys in ``keys`` from our ``model`` section."""
    return {hf_key: getattr(model, ours) for ours, (hf_key, _) in keys.items()}


def from_hf_config(keys: ConfigKeys, hf: dict[str, Any]) -> dict[str, Any]:
    """Our model.* values of the keys in ``keys`` from config.json (HF's defaults for absent
    keys)."""
    return {ours: hf.get(hf_key, default) for ours, (hf_key, default) in keys.items()}


def require(hf: dict[str, Any], key: str, wanted: object, where: str) -> None:
    """ConfigError unless config.json's ``key`` is absent (HF's default: ``wanted``) or equals
    ``wanted``."""
    value = hf.get(key, wanted)
    if value != wanted:
        raise ConfigError(
            f"{where}: {key}={value!r} is not supported (only {wanted!r}): our model has no such "
            "variant"
        )


class Architecture(ABC):
    """One HF model class: its tensor names, its config.json, and which of our models it is."""

    name: str  # the class, as config.json's "architectures" names it
    model_type: str  # config.json's "model_type"
    kind: str  # ours: "gpt" or "bert"
    base_prefix: str  # the base model's attribute in the task model
    head_prefixes: tuple[str, ...]  # keys outside the base model
    tied: dict[str, str]  # HF keys that hold a copy of another (export leaves them out)
    ignored: tuple[str, ...] = ()  # suffixes of HF buffers that are not weights

    @abstractmethod
    def rules(self, cfg: Config) -> list[Rule]:
        """The tensor mapping for a model of this config."""

    @abstractmethod
    def hf_config(self, cfg: Config, vocab_size: int, tokenizer: Tokenizer) -> dict[str, Any]:
        """config.json of the exported model (without ``dtype``)."""

    @abstractmethod
    def sections(self, hf: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
        """Our config sections (``model``, and ``bert`` for BERT) for this config.json."""

    def export_tensors(self, cfg: Config, ours: dict[str, Tensor]) -> dict[str, Tensor]:
        """HF tensors from our full (TP=1, real vocabulary) state dict."""
        return to_hf(self.rules(cfg), ours, cfg.model.num_attention_heads)

    def import_tensors(self, cfg: Config, hf: dict[str, Tensor], where: str) -> dict[str, Tensor]:
        """Our full state dict from HF tensors; refuses untied copies and unknown tensors."""
        for copy, original in self.tied.items():
            if copy in hf and original in hf and not torch.equal(hf[copy], hf[original]):
                raise ConfigError(
                    f"{where}: {copy} differs from {original}; our model ties them, so an untied "
                    "model cannot be converted exactly"
                )
        rules = self.rules(cfg)
        known = {k for r in rules for k in r.hf} | set(self.tied)
        unknown = [k for k in hf if k not in known and not k.endswith(self.ignored)]
        if unknown:
            raise ConfigError(
                f"{where} holds {unknown[0]}, which a {self.name} of this config.json has not; "
                "it is another architecture"
            )
        return from_hf(rules, hf, cfg.model.num_attention_heads, where)
