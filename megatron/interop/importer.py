"""Import a HF model directory as one of our checkpoints, at any TP size.

    DIR/latest, DIR/iter_0000000/   weights only (meta.json in our format: resolved config,
                                    tensor layout, checksums; no optimizer, RNG or schedule)
    DIR/tokenizer/                  the tokenizer files, copied
    DIR/config.yaml                 a config our entrypoints accept: the model, the copied
                                    tokenizer, checkpoint.load=DIR with finetune=true, and
                                    training defaults; data.paths is left to the user

Everything is checked (architecture, config.json, every tensor, the tokenizer's vocabulary)
before anything is written; DIR appears only once complete.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from megatron.atomic_file import write_contents
from megatron.checkpoint.format import checkpoint_name, read_meta
from megatron.config.load import config_from_dict
from megatron.config.schema import TokenizerConfig
from megatron.data.tokenizers.factory import build_tokenizer
from megatron.errors import ConfigError
from megatron.inference.loading import check_tp, model_type
from megatron.interop.architectures import from_config_json
from megatron.interop.hf_files import CONFIG, WEIGHTS, read_config, read_weights
from megatron.interop.hf_tokenizer import copy_tokenizer, find_tokenizer
from megatron.interop.ours import write_checkpoint
from megatron.interop.staging import check_output, staged

CONFIG_YAML = "config.yaml"
# Fine-tuning defaults for config.yaml (any key can be overridden on the command line).
DEFAULTS: dict[str, dict[str, Any]] = {
    "data": {"split": "949,50,1", "num_workers": 2},
    "training": {
        "micro_batch_size": 4,
        "global_batch_size": 32,
        "train_iters": 1000,
        "seed": 1234,
        "eval_interval": 100,
        "eval_iters": 10,
    },
    "optimizer": {
        "lr": 1.0e-5,
        "min_lr": 1.0e-6,
        "weight_decay": 0.01,
        "clip_grad": 1.0,
        "lr_warmup_iters": 100,
        "lr_decay_style": "cosine",
    },
    "precision": {"dtype": "fp32"},
}


def _sections(
    model: dict[str, dict[str, Any]], tokenizer: dict[str, Any], tp_size: int, output: str
) -> dict[str, dict[str, Any]]:
    """config.yaml's sections (without data.paths), in the order the shipped configs use."""
    load = os.path.abspath(output)
    return {
        **model,  # model, and bert for BERT
        "parallel": {"tensor_parallel_size": tp_size},
        "tokenizer": tokenizer,
        **{k: dict(v) for k, v in DEFAULTS.items()},
        "checkpoint": {
            "load": load,
            "finetune": True,
            "save": os.path.join(load, "finetuned"),
            "save_interval": 500,
        },
        "logging": {"log_interval": 10},
    }


def _command(output: str, kind: str) -> str:
    script = "pretrain_bert.py" if kind == "bert" else "pretrain_gpt.py"
    return f"python {script} --config {os.path.join(output, CONFIG_YAML)} data.paths=[PREFIX]"


def finetune_command(output: str) -> str:
    """The command that fine-tunes the import in ``output`` (the user supplies the data)."""
    return _command(output, model_type(read_meta(os.path.join(output, checkpoint_name(0)))))


def import_hf(hf_dir: str, output: str, tp_size: int) -> str:
    """Convert the HF model in ``hf_dir`` into a save directory ``output`` holding iteration 0
    at TP=``tp_size``; returns the checkpoint directory.

    Raises ConfigError (one line) for an unsupported architecture or config, weights that do
    not fit it, a tokenizer whose vocabulary differs, a TP size that does not divide the model,
    or an ``output`` that already holds files.
    """
    where = os.path.join(hf_dir, CONFIG)
    hf = read_config(hf_dir)
    architecture = from_config_json(hf, where)
    model = architecture.sections(hf, where)
    model["model"]["type"] = architecture.kind  # the other entrypoint refuses this config
    check_output(output)
    source = find_tokenizer(hf_dir)
    tokenizer = build_tokenizer(**source)
    vocab = hf.get("vocab_size")
    if vocab != tokenizer.vocab_size:
        raise ConfigError(
            f"{where}: vocab_size={vocab}, but the tokenizer ({source['type']}) has "
            f"{tokenizer.vocab_size} ids; give it the tokenizer the model was trained with"
        )
    if tp_size < 1:
        raise ConfigError(f"--tensor-parallel-size {tp_size} must be at least 1")
    sections = _sections(model, source, tp_size, output)
    cfg = config_from_dict({**sections, "data": {**sections["data"], "paths": []}}, where)
    check_tp(cfg, tp_size)
    sections["model"] = dataclasses.asdict(cfg.model)  # every model.* key, spelled out
    weights = read_weights(hf_dir, architecture.base_prefix, architecture.head_prefixes)
    source_weights = os.path.join(hf_dir, WEIGHTS)
    full = architecture.import_tensors(cfg, weights, source_weights)
    with staged(output) as tmp:
        sections["tokenizer"] = copy_tokenizer(
            source, os.path.join(tmp, "tokenizer"), os.path.join(output, "tokenizer")
        )
        cfg = dataclasses.replace(cfg, tokenizer=TokenizerConfig(**sections["tokenizer"]))
        imported = {"path": os.path.abspath(hf_dir), "architecture": architecture.name}
        extra = {"imported_from": imported}
        write_checkpoint(tmp, architecture.kind, cfg, full, vocab, source_weights, extra)
        header = (
            f"# Imported from {imported['path']} ({architecture.name}) by tools/import_hf.py.\n"
            "# data.paths is yours to give, e.g. on the command line:\n"
            f"#   {_command(output, architecture.kind)}\n"
        )
        write_contents(
            os.path.join(tmp, CONFIG_YAML), header + yaml.safe_dump(sections, sort_keys=False)
        )
    return os.path.join(output, checkpoint_name(0))
