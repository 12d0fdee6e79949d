"""Import a HF model directory as one of our checkpoints, at any TP size.

    DIR/latest, DIR/iter_0000000/   weights only (meta.json in our format: resolved config,
                                    tensor layout, checksums; no optimizer, RNG or schedule)
    DIR/tokenizer/                  the tokenizer files, copied (see ``hf_tokenizer``: GPT-2's
                                    and BERT's as they are, another model's as AutoTokenizer
                                    loads them, or those the tokenizer flags name)
    DIR/config.yaml                 a config our entrypoints accept at any world size: the
                                    model, the copied tokenizer, TP=1 (the checkpoint reshards
                                    on load to whatever TP a run asks for), checkpoint.load=DIR
                                    with finetune=true and save=DIR/finetuned, and training
                                    defaults; data.paths is left to the user. Its paths into
                                    DIR are ${config_dir} paths: DIR moves as a whole

Everything is checked (architecture, config.json, every tensor, the tokenizer's vocabulary)
before anything is written; DIR appears only once complete.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import yaml

from megatron.atomic_file import write_contents
from megatron.checkpoint.format import checkpoint_name, read_meta
from megatron.config.load import config_from_dict, under_config_dir
from megatron.config.tokenizer import TokenizerConfig
from megatron.data.tokenizers.base import Tokenizer
from megatron.data.tokenizers.factory import build_tokenizer, family
from megatron.errors import ConfigError
from megatron.inference.loading import check_tp, model_type
from megatron.interop import bert, gpt2
from megatron.interop.architectures import from_config_json
from megatron.interop.hf_files import CONFIG, WEIGHTS, read_config, read_weights
from megatron.interop.hf_tokenizer import copy_tokenizer, find_tokenizer
from megatron.interop.ours import write_checkpoint
from megatron.interop.staging import check_output, staged

CONFIG_YAML = "config.yaml"
# Continued-pretraining defaults for config.yaml (any key can be overridden on the command line).
# No warmup: the weights are trained already, and any training.train_iters then validates.
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
        "lr_warmup_iters": 0,
        "lr_decay_style": "cosine",
    },
    "precision": {"dtype": "fp32"},
}


def _sections(
    model: dict[str, dict[str, Any]], tokenizer: dict[str, Any], output: str
) -> dict[str, dict[str, Any]]:
    """config.yaml's sections (without data.paths), in the order the shipped configs use. TP=1,
    whatever the checkpoint's: one process runs it as it is, torchrun overrides it."""
    load = os.path.abspath(output)
    return {
        **model,  # model, and bert for BERT
        "parallel": {"tensor_parallel_size": 1},
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


def _commands(output: str, kind: str, tp_size: int) -> list[str]:
    """One process, and (for a checkpoint saved at TP > 1) torchrun at its TP size: the
    commands that continue pretraining the import in ``output`` on the user's data."""
    # The entrypoint as seen from the working directory, where the printed command will run.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.relpath(os.path.join(root, f"pretrain_{kind}.py"))
    args = f"{script} --config {os.path.join(output, CONFIG_YAML)} data.paths=[PREFIX]"
    if tp_size == 1:
        return [f"python {args}"]
    torchrun = f"python -m megatron.launch.torchrun --standalone --nproc-per-node {tp_size}"
    return [f"python {args}", f"{torchrun} {args} parallel.tensor_parallel_size={tp_size}"]


def finetune_commands(output: str) -> list[str]:
    """``_commands`` of the import in ``output``."""
    meta = read_meta(os.path.join(output, checkpoint_name(0)))
    return _commands(output, model_type(meta), meta["tp_size"])


def _fit_vocabulary(
    source: dict[str, Any], rows: Any, where: str
) -> tuple[dict[str, Any], Tokenizer]:
    """``source`` and its tokenizer, for a model with ``rows`` embedding rows (config.json's
    vocab_size). Rows past the tokenizer's ids are kept as vocabulary it never produces
    (``tokenizer.vocab_size``, hf only), so the import holds every row and its logits, softmax
    included, are the HF model's; a tokenizer with more ids than rows is refused."""
    tokenizer = build_tokenizer(**source)
    ids = tokenizer.vocab_size
    if rows == ids:
        return source, tokenizer
    if not isinstance(rows, int) or rows < ids:
        raise ConfigError(
            f"{where}: vocab_size={rows}, but the tokenizer ({source['type']}) has {ids} ids; "
            "give it the tokenizer the model was trained with"
        )
    if family(source["type"]) != "hf":
        raise ConfigError(
            f"{where}: vocab_size={rows} is {rows - ids} rows more than the {ids} ids of the "
            f"tokenizer ({source['type']}); only a HF tokenizer.json can leave rows unused: name "
            "one with --tokenizer-type HuggingFaceTokenizer --tokenizer-model, or give the "
            "tokenizer the model was trained with"
        )
    source = {**source, "vocab_size": rows}
    return source, build_tokenizer(**source)


def import_hf(
    hf_dir: str, output: str, tp_size: int, tokenizer_overrides: Sequence[str] = ()
) -> str:
    """Convert the HF model in ``hf_dir`` into a save directory ``output`` holding iteration 0
    at TP=``tp_size``; returns the checkpoint directory.

    ``tokenizer_overrides`` (``tokenizer.key=value``, tools/import_hf.py's --tokenizer-* flags)
    name the tokenizer instead of ``hf_dir``'s files (``hf_tokenizer.find_tokenizer``).
    Raises ConfigError (one line) for an unsupported architecture or config, weights that do
    not fit it, no tokenizer or one with more ids than the model has rows, a TP size that does
    not divide the model, or an ``output`` that already holds files.
    """
    where = os.path.join(hf_dir, CONFIG)
    hf = read_config(hf_dir)
    architecture = from_config_json(hf, where)
    model = architecture.sections(hf, where)
    model["model"]["type"] = architecture.kind  # the other entrypoint refuses this config
    check_output(output)
    # GPT-2's and BERT's HF tokenizers are our gpt2 and wordpiece ones, file for file.
    own_files = isinstance(architecture, gpt2.GPT2 | bert.Bert)
    # Holds the tokenizer.json made from AutoTokenizer until it is copied into the import.
    with tempfile.TemporaryDirectory(prefix="import_hf-") as scratch:
        found = find_tokenizer(hf_dir, own_files, tokenizer_overrides, scratch)
        source, tokenizer = _fit_vocabulary(found, hf.get("vocab_size"), where)
        if tp_size < 1:
            raise ConfigError(f"--tensor-parallel-size {tp_size} must be at least 1")
        sections = _sections(model, source, output)
        # The checkpoint's TP size, in its meta.json.
        stored_tp = [f"parallel.tensor_parallel_size={tp_size}"]
        cfg = config_from_dict(
            {**sections, "data": {**sections["data"], "paths": []}}, where, stored_tp
        )
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
            write_checkpoint(
                tmp, architecture.kind, cfg, full, tokenizer.vocab_size, source_weights, extra
            )
            commands = _commands(output, architecture.kind, tp_size)
            header = (
                f"# Imported from {imported['path']} ({architecture.name}) by tools/import_hf.py.\n"
                f"# The checkpoint is saved at TP={tp_size}; it reshards on load to the run's "
                "parallel.tensor_parallel_size.\n"
                "# data.paths is yours to give, e.g. on the command line:\n"
                + "".join(f"#   {c}\n" for c in commands)
            )
            relocatable = under_config_dir(sections, os.path.abspath(output))
            write_contents(
                os.path.join(tmp, CONFIG_YAML),
                header + yaml.safe_dump(relocatable, sort_keys=False),
            )
        return os.path.join(output, checkpoint_name(0))
