"""Load a checkpoint for inference: its saved config, the tokenizer, and the model at this
launch's TP size (resharded on load), in eval mode.

The model type is read off the saved tensors (BERT has an LM-head bias, GPT does not), so any
checkpoint our entrypoints or ``tools/import_hf.py`` wrote loads without naming it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from megatron import checkpoint
from megatron.checkpoint import find_checkpoint
from megatron.checkpoint.train_state import TrainState
from megatron.config.dtypes import DTYPES
from megatron.config.load import config_from_dict
from megatron.config.schema import Config, padded_vocab_size
from megatron.data.tokenizers.factory import Tokenizer, build_tokenizer
from megatron.errors import ConfigError
from megatron.models.build import build_model
from megatron.parallel import state as parallel_state
from megatron.parallel.launcher import launcher_env
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState

# Megatron-style flags of generate.py and evaluate.py, and the config key each overrides.
TOKENIZER_FLAGS = {
    "tokenizer_type": "tokenizer.type",
    "vocab_file": "tokenizer.vocab_file",
    "merge_file": "tokenizer.merges_file",
    "tokenizer_model": "tokenizer.model",
}


def add_tokenizer_flags(parser: argparse.ArgumentParser) -> None:
    """``--tokenizer-type --vocab-file --merge-file --tokenizer-model``: override the
    checkpoint's tokenizer (an imported checkpoint, or files that have moved)."""
    group = parser.add_argument_group("tokenizer (default: the checkpoint's)")
    for dest in TOKENIZER_FLAGS:
        group.add_argument("--" + dest.replace("_", "-"), dest=dest)


def tokenizer_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides the tokenizer flags given on the command line ask for."""
    return [f"{key}={getattr(args, d)}" for d, key in TOKENIZER_FLAGS.items() if getattr(args, d)]


def model_type(meta: dict[str, Any]) -> str:
    """ "bert" or "gpt", from the checkpoint's tensors."""
    return "bert" if "model/lm_head.bias" in meta["tensors"] else "gpt"


@dataclass
class Loaded:
    """A model ready for inference, and what it came with."""

    model: nn.Module
    tokenizer: Tokenizer
    cfg: Config
    state: ParallelState
    kind: str  # "gpt" or "bert"
    path: str  # the checkpoint directory read


def check_tp(cfg: Config, tp: int) -> None:
    """The model's heads, key/value groups and MLP must split into ``tp`` equal parts."""
    m = cfg.model
    for key, n in (
        ("num_attention_heads", m.num_attention_heads),
        ("num_query_groups", m.query_groups),
        ("ffn_hidden_size", m.ffn_hidden_size),
    ):
        if n % tp:
            raise ConfigError(
                f"TP={tp} does not divide the checkpoint's model.{key}={n}; launch a number of "
                "processes (or --tensor-parallel-size) that divides it"
            )


def load_for_inference(
    load_dir: str, overrides: list[str], tp_size: int | None = None, dtype: str | None = None
) -> Loaded:
    """Start the process groups (``tp_size``, default the world size) and load the checkpoint
    ``load_dir`` names (``find_checkpoint``: a save directory's newest, or one ``iter_*``
    directory) into a model in eval mode.

    ``overrides`` (``section.key=value``) apply to the checkpoint's config, e.g. the tokenizer;
    ``dtype`` (fp32, bf16, fp16) replaces the saved ``precision.dtype``.
    """
    world = int(launcher_env()["WORLD_SIZE"])
    tp = world if tp_size is None else tp_size
    if tp < 1 or world % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the world size {world}")
    path, meta = find_checkpoint(load_dir)
    # Decoding with a KV cache runs one token at a time: no sequence to split over TP.
    extra = [f"parallel.tensor_parallel_size={tp}", "parallel.sequence_parallel=false"]
    if dtype is not None:
        extra.append(f"precision.dtype={dtype}")
    cfg = config_from_dict(meta["config"], os.path.join(path, "meta.json"), overrides + extra)
    check_tp(cfg, tp)
    tokenizer = build_tokenizer(**asdict(cfg.tokenizer))
    state = parallel_state.initialize(tp, cfg.parallel.timeout_minutes)
    tracker = RNGTracker(state.device)
    tracker.seed(cfg.training.seed, state.tp_rank)
    padded = padded_vocab_size(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    kind = model_type(meta)
    model = build_model(kind, cfg, tokenizer.vocab_size, padded, state, tracker)
    model.to(DTYPES[cfg.precision.dtype])
    weights = TrainState(model)
    checkpoint.load_checkpoint(load_dir, weights, state, tokenizer.vocab_size, finetune=True)
    return Loaded(model.eval(), tokenizer, cfg, state, kind, path)
