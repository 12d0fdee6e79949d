"""Checkpoints: sharded, atomic, optionally written in the background, resharded on load.

The public face: ``Checkpointer`` (inline or in the background) and ``save_checkpoint`` save a
``TrainState``, ``load_checkpoint`` restores one from the newest intact checkpoint, ``save_offline``
publishes a checkpoint made in one process (conversions, imports); ``find_latest``, ``iterations``,
``candidates`` and ``checkpoint_dir`` say what a save directory holds, ``find_checkpoint`` which
checkpoint a ``--load`` path names. ``format`` names the files,
``save``/``async_save`` write them, ``load``, ``reshard``, ``stages`` and ``optim_shards`` read
them back at any layout.
"""

from megatron.checkpoint.async_save import Checkpointer
from megatron.checkpoint.load import (
    candidates,
    checkpoint_dir,
    find_checkpoint,
    find_latest,
    iterations,
    load_checkpoint,
)
from megatron.checkpoint.publish import save_offline
from megatron.checkpoint.save import save_checkpoint

__all__ = [
    "Checkpointer",
    "candidates",
    "checkpoint_dir",
    "find_checkpoint",
    "find_latest",
    "iterations",
    "load_checkpoint",
    "save_checkpoint",
    "save_offline",
]
