"""Renaming and reshaping between our full (TP=1, unpadded) state dict and a HF one.

A ``Rule`` pairs one of our keys with the HF key(s) it becomes and names the conversion. Both
directions read the same rule list, so export and import cannot disagree. Our fused QKV matrix
orders its rows [group, (q x heads / groups, k, v), head_dim] (whole query groups per TP rank;
without grouped queries a group is one head: [head, (q, k, v), head_dim]); HF orders them
[q (heads x head_dim), k, v (groups x head_dim each)], as one matrix (GPT-2's ``c_attn``) or
three (BERT's query, key, value; Llama's q_proj, k_proj, v_proj). GPT-2's ``Conv1D`` stores its
weight as [in, out], the transpose of ``nn.Linear``'s. Our SwiGLU ``fc1`` interleaves its rows
[ffn, (gate, up)]; Llama's are two matrices, gate_proj and up_proj.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron.config.model import ModelConfig
from megatron.config.schema import Config
from megatron.data.tokenizers.base import Tokenizer
from megatron.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """Our state-dict key, the HF key(s) holding the same numbers, and the conversion's name:
    ``same``, ``t`` (Conv1D, transposed), ``qkv`` (fused QKV bias), ``qkv_t`` (fused QKV Conv1D
    weight), ``qkv_split`` (QKV as separate q, k, v tensors), ``swiglu`` (fc1 as gate, up), or
    for routed experts ``experts`` (one tensor per expert) and ``experts_swiglu`` (fc1 as each
    expert's gate and up)."""

    ours: str
    hf: tuple[str, ...]
    kind: str = "same"


@dataclass(frozen=True)
class Heads:
    """What the QKV conversions need of the model: query heads, key/value groups, head_dim."""

    heads: int
    groups: int
    head_dim: int

    @classmethod
    def of(cls, m: ModelConfig) -> Heads:
        """The attention shape of our ``model`` section."""
        return cls(m.num_attention_heads, m.query_groups, m.head_dim)

    def sizes(self) -> list[int]:
        """Rows of HF's q, k and v."""
        kv = self.groups * self.head_dim
        return [self.heads * self.head_dim, kv, kv]


def _parts(t: Tensor, h: Heads) -> tuple[Tensor, Tensor, Tensor]:
    """Our fused QKV rows -> HF's q, k, v (any trailing dims)."""
    per = h.heads // h.groups
    g = t.reshape(h.groups, per + 2, h.head_dim, *t.shape[1:])  # [groups, per + 2, d, *rest]
    return g[:, :per].flatten(0, 2), g[:, per].flatten(0, 1), g[:, per + 1].flatten(0, 1)


def _fused(q: Tensor, k: Tensor, v: Tensor, h: Heads) -> Tensor:
    """HF's q, k, v -> our fused QKV rows."""
    rest = q.shape[1:]
    q = q.reshape(h.groups, h.heads // h.groups, h.head_dim, *rest)  # [groups, per, d, *rest]
    k, v = (x.reshape(h.groups, 1, h.head_dim, *rest) for x in (k, v))  # [groups, 1, d, *rest]
    return torch.cat((q, k, v), dim=1).flatten(0, 2)


Convert = Callable[[tuple[Tensor, ...], Heads], tuple[Tensor, ...]]
# kind -> (ours -> HF, HF -> ours); each takes a tuple of tensors and the attention shape.
CONVERSIONS: dict[str, tuple[Convert, Convert]] = {
    "same": (lambda ts, h: ts, lambda ts, h: ts),
    "t": (lambda ts, h: (ts[0].t(),), lambda ts, h: (ts[0].t(),)),
    "qkv": (
        lambda ts, h: (torch.cat(_parts(ts[0], h)),),
        lambda ts, h: (_fused(*ts[0].split(h.sizes()), h),),
    ),
    "qkv_t": (
        lambda ts, h: (torch.cat(_parts(ts[0], h)).t(),),
        lambda ts, h: (_fused(*ts[0].t().split(h.sizes()), h),),
    ),
    "qkv_split": (lambda ts, h: _parts(ts[0], h), lambda ts, h: (_fused(*ts, h),)),
    # fc1 [2 * ffn, h] rows (gate_0, up_0, gate_1, ...) <-> gate, up [ffn, h] each.
    "swiglu": (
        lambda ts, h: (ts[0][0::2], ts[0][1::2]),
        lambda ts, h: (torch.stack(ts, dim=1).flatten(0, 1),),  # [ffn, 2, h] -> [2 * ffn, h]
    ),
    # Routed experts: fc2 [E, h, f] <-> one down projection [h, f] per expert.
    "experts": (lambda ts, h: tuple(ts[0].unbind(0)), lambda ts, h: (torch.stack(ts),)),
    # fc1 [E, 2f, h], each expert's rows interleaved <-> gate_0, up_0, gate_1, ... [f, h] each.
    "experts_swiglu": (
        lambda ts, h: tuple(w for e in ts[0] for w in (e[0::2], e[1::2])),
        lambda ts, h: (
            torch.stack(ts)  # [2E, f, h]: gate_0, up_0, gate_1, ...
            .unflatten(0, (-1, 2))  # [E, 2, f, h]
            .transpose(1, 2)  # [E, f, 2, h]
            .flatten(1, 2),  # [E, 2f, h]
        ),
    ),
}


def to_hf(rules: list[Rule], ours: dict[str, Tensor], heads: Heads) -> dict[str, Tensor]:
    """HF tensors (contiguous copies) from our full state dict; every key of ``ours`` is used."""
    unused = set(ours) - {r.ours for r in rules}
    if unused:
        raise ValueError(f"no HF name for {sorted(unused)[0]}: the mapping is incomplete")
    out = {}
    for rule in rules:
        converted = CONVERSIONS[rule.kind][0]((ours[rule.ours],), heads)
        out.update({k: t.contiguous().clone() for k, t in zip(rule.hf, converted, strict=True)})
    return out


def from_hf(
    rules: list[Rule], hf: dict[str, Tensor], heads: Heads, where: str
) -> dict[str, Tensor]:
    """Our full state dict from HF tensors; ConfigError naming ``where`` for a missing tensor."""
    out = {}
    for rule in rules:
        missing = [k for k in rule.hf if k not in hf]
        if missing:
            raise ConfigError(f"{where} has no tensor {missing[0]}: not a complete model")
        try:
            converted = CONVERSIONS[rule.kind][1](tuple(hf[k] for k in rule.hf), heads)
        except RuntimeError:  # a reshape or concatenation the shapes do not allow
            shapes = ", ".join(f"{k} {list(hf[k].shape)}" for k in rule.hf)
            raise ConfigError(
                f"{where}: {shapes} do not make our {rule.ours} of the shape config.json "
                "implies; the weights do not fit their config"
            ) from None
        out[rule.ours] = converted[0].contiguous().clone()
    return out


def weight_and_bias(ours: str, hf: str) -> list[tuple[str, str, str]]:
    """(our suffix, HF suffix, "same") for the weight and the bias of one module."""
    return [(f"{ours}.{p}", f"{hf}.{p}", "same") for p in ("weight", "bias")]


def module_rules(ours: str, hf: str) -> list[Rule]:
    """Rules for the weight and the bias of one module outside the layers."""
    return [Rule(o, (h,), kind) for o, h, kind in weight_and_bias(ours, hf)]


def layer_rules(
    layers: int | Iterable[int], prefix: str, pairs: list[tuple[str, str, str]]
) -> list[Rule]:
    """Rules of every layer (``layers`` of them) or of the layers ``layers`` lists, from
    ``pairs`` of (our suffix, HF suffix(es), kind): several HF suffixes are separated by spaces,
    and each follows ``prefix`` with ``{i}`` the layer index."""
    return [
        Rule(
            f"transformer.layers.{i}.{ours}",
            tuple(prefix.format(i=i) + h for h in hf.split()),
            kind,
        )
        for i in (range(layers) if isinstance(layers, int) else layers)
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

    def tied_copies(self, cfg: Config) -> dict[str, str]:
        """HF keys that hold a copy of another in a model of this config (``tied``)."""
        return self.tied

    def export_tensors(self, cfg: Config, ours: dict[str, Tensor]) -> dict[str, Tensor]:
        """HF tensors from our full (TP=1, real vocabulary) state dict."""
        return to_hf(self.rules(cfg), ours, Heads.of(cfg.model))

    def import_tensors(self, cfg: Config, hf: dict[str, Tensor], where: str) -> dict[str, Tensor]:
        """Our full state dict from HF tensors; refuses untied copies and unknown tensors."""
        tied = self.tied_copies(cfg)
        for copy, original in tied.items():
            if copy in hf and original in hf and not torch.equal(hf[copy], hf[original]):
                raise ConfigError(
                    f"{where}: {copy} differs from {original}; our model ties them, so an untied "
                    "model cannot be converted exactly"
                )
        rules = self.rules(cfg)
        known = {k for r in rules for k in r.hf} | set(tied)
        unknown = [k for k in hf if k not in known and not k.endswith(self.ignored)]
        if unknown:
            raise ConfigError(
                f"{where} holds {unknown[0]}, which a {self.name} of this config.json has not; "
                "it is another architecture"
            )
        return from_hf(rules, hf, Heads.of(cfg.model), where)
