"""A HF model directory's config.json and weights, read and written without transformers.

Weights are read from ``model.safetensors`` or a sharded ``model.safetensors.index.json`` only:
a directory holding nothing but ``pytorch_model.bin`` is refused, since loading it would unpickle.
Keys saved from a base model (``h.0.attn...`` for GPT-2, ``embeddings...`` for BERT) get the
task model's prefix, and the old ``gamma``/``beta`` LayerNorm names become ``weight``/``bias``,
as ``from_pretrained`` does.
"""

from __future__ import annotations

import json
import os
from typing import Any

from safetensors.torch import save as serialize
from torch import Tensor

from megatron.atomic_file import write_contents, write_durable
from megatron.checkpoint.format import open_safetensors
from megatron.errors import ConfigError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} not found; {what}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); restore it") from None


def read_config(hf_dir: str) -> dict[str, Any]:
    """The model's config.json, as a dict."""
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"--input {hf_dir}: no such directory; give a HF model directory")
    config = _read_json(os.path.join(hf_dir, CONFIG), "give a HF model directory (save_pretrained)")
    if not isinstance(config, dict):
        raise ConfigError(f"{os.path.join(hf_dir, CONFIG)} does not hold a JSON object; restore it")
    return config


def write_config(hf_dir: str, config: dict[str, Any]) -> None:
    """config.json, indented like save_pretrained's."""
    write_contents(os.path.join(hf_dir, CONFIG), json.dumps(config, indent=2) + "\n")


def _weight_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, WEIGHTS_INDEX)
    if os.path.isfile(index):
        weight_map = _read_json(index, "restore it").get("weight_map", {})
        return [os.path.join(hf_dir, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(hf_dir, WEIGHTS)
    if os.path.isfile(single):
        return [single]
    if any(n.endswith(".bin") for n in os.listdir(hf_dir)):
        raise ConfigError(
            f"--input {hf_dir} holds only pytorch_model.bin, a pickle, which is never loaded here; "
            "convert it to safetensors first (from_pretrained, then save_pretrained)"
        )
    raise ConfigError(f"--input {hf_dir}: no {WEIGHTS}; give a HF model directory")


def _normalise(key: str) -> str:
    """Old BERT files name LayerNorm parameters gamma and beta."""
    for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
        if key.endswith(old):
            key = key[: -len(old)] + new
    return key


def read_weights(hf_dir: str, base_prefix: str, heads: tuple[str, ...]) -> dict[str, Tensor]:
    """Every tensor of the model's safetensors file(s), as fp32, under the task model's keys.

    ``base_prefix`` is the base model's attribute (``transformer``, ``bert``); ``heads`` the
    prefixes of keys outside it (``lm_head``, ``cls``), which keep their names.
    """
    tensors = {}
    for path in _weight_files(hf_dir):
        f = open_safetensors(path)
        for key in f.keys():
            tensors[_normalise(key)] = f.get_tensor(key).float()
    owned = (base_prefix + ".", *(h + "." for h in heads))
    # Keys saved from the base model (hub GPT-2's "h.0...", "wte.weight") lack its prefix.
    return {k if k.startswith(owned) else f"{base_prefix}.{k}": t for k, t in tensors.items()}


def write_weights(hf_dir: str, tensors: dict[str, Tensor]) -> None:
    """model.safetensors with the ``format: pt`` header transformers expects."""
    data = serialize({k: t.contiguous() for k, t in tensors.items()}, {"format": "pt"})
    write_durable(os.path.join(hf_dir, WEIGHTS), data)
