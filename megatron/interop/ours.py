"""Our side of a conversion: whole (TP=1) models and state dicts, read from and written to our
checkpoints without any process group.

A *full* state dict holds every tensor whole, with vocabulary tables cut to the real vocabulary
(no padding rows): the form HF models take, and the same at every TP size.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from megatron.checkpoint import save_offline
from megatron.checkpoint.format import FORMAT_VERSION, META, shard_file
from megatron.checkpoint.reshard import take_shard, tensor_layout, vocab_params
from megatron.checkpoint.stages import open_checkpoint
from megatron.config.load import config_from_dict
from megatron.config.schema import Config, padded_vocab_size, to_dict
from megatron.errors import ConfigError
from megatron.inference.loading import model_type
from megatron.models.build import build_model
from megatron.parallel.layers import split_dim
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState


def serial_model(kind: str, cfg: Config, vocab_size: int, device: str = "cpu") -> nn.Module:
    """Our ``kind`` model of ``cfg`` at TP=1, in eval mode; ``device="meta"`` allocates nothing
    (enough to read split dimensions and shapes)."""
    state = ParallelState.serial(torch.device(device))
    tracker = RNGTracker(state.device)
    # The initial values are overwritten (or, on meta, never drawn) and eval mode draws no
    # dropout: the run's seed serves as well as any.
    tracker.seed(cfg.training.seed, 0)
    padded = padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    return build_model(kind, cfg, vocab_size, padded, state, tracker).eval()


def read_full(
    ckpt_dir: str, meta: dict[str, Any], padded_rows: int | None = None
) -> dict[str, Tensor]:
    """The checkpoint's model tensors merged over its TP ranks and pipeline stages, under
    state-dict keys (CPU, saved dtype); vocabulary tables hold ``padded_rows`` rows (default: the
    real vocabulary)."""
    source = open_checkpoint(ckpt_dir, meta, False)
    rows = meta["vocab_size"] if padded_rows is None else padded_rows
    return {
        key.removeprefix("model/"): source.read(key, 1, 0, rows)
        for key in meta["tensors"]
        if key.startswith("model/")
    }


def load_serial(ckpt_dir: str, meta: dict[str, Any], cast: torch.dtype | None = None) -> nn.Module:
    """The checkpoint's model at TP=1 on CPU in fp32, in eval mode; ``cast`` rounds the weights
    through that dtype first (to compare with an export in that dtype)."""
    cfg = config_from_dict(meta["config"], os.path.join(ckpt_dir, META))
    model = serial_model(model_type(meta), cfg, meta["vocab_size"])
    padded = padded_vocab_size(meta["vocab_size"], cfg.model.make_vocab_size_divisible_by, 1)
    weights = read_full(ckpt_dir, meta, padded)
    if cast is not None:
        weights = {k: t.to(cast) for k, t in weights.items()}
    model.load_state_dict({k: t.float() for k, t in weights.items()})
    return model


def _check_shapes(model: nn.Module, full: dict[str, Tensor], vocab_size: int, where: str) -> None:
    expected = {k: list(t.shape) for k, t in model.state_dict().items()}
    for name in vocab_params(model):
        expected[name][0] = vocab_size
    extra = sorted(set(full) - set(expected))
    if extra:
        raise ValueError(f"{extra[0]} is no tensor of our model: the mapping is wrong")
    for key, shape in expected.items():
        if key not in full:
            raise ConfigError(f"{where}: nothing maps to our {key}; not a complete model")
        if list(full[key].shape) != shape:
            raise ConfigError(
                f"{where}: {key} has shape {list(full[key].shape)}, config.json implies {shape}; "
                "the weights do not fit their config"
            )


def write_checkpoint(
    save_dir: str,
    kind: str,
    cfg: Config,
    full: dict[str, Tensor],
    vocab_size: int,
    where: str,
    extra_meta: dict[str, Any],
) -> str:
    """Publish ``full`` as iteration 0 of ``save_dir`` at ``parallel.tensor_parallel_size``;
    returns the checkpoint directory. ``where`` names the tensors' source in errors.

    The checkpoint holds weights only (meta.json ``weights_only``: no optimizer state, RNG
    states, schedule or progress); load it with ``checkpoint.finetune=true``. Split dimensions
    and vocabulary rows come from our model itself, built on the meta device.
    """
    tp = cfg.parallel.tensor_parallel_size
    model = serial_model(kind, cfg, vocab_size, device="meta")
    _check_shapes(model, full, vocab_size, where)
    splits = {name: split_dim(p) for name, p in model.named_parameters()}
    vocab = vocab_params(model)
    padded = padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, tp)

    def shard(rank: int, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return {
            f"model/{k}": take_shard(t, splits[k], tp, rank, padded if k in vocab else None)
            for k, t in tensors.items()
        }

    # The layout needs only shapes and dtypes: shard 0 of meta tensors copies nothing.
    layout = tensor_layout(shard(0, {k: t.to("meta") for k, t in full.items()}), model, tp)
    meta = {
        "format_version": FORMAT_VERSION,
        "iteration": 0,
        "progress": {},
        "tp_size": tp,
        "dp_size": 1,
        "world_size": tp,
        "device_type": "cpu",
        "vocab_size": vocab_size,
        "padded_vocab_size": padded,
        "seed": cfg.training.seed,
        "rng": False,
        "torch_version": torch.__version__,
        "lr_schedule": None,
        "grad_scaler": None,
        "tensors": layout,
        "files": {},  # filled in by save_offline
        "config": to_dict(cfg),
        "weights_only": True,
        **extra_meta,
    }
    return save_offline(save_dir, meta, ((shard_file(r), shard(r, full)) for r in range(tp)))
