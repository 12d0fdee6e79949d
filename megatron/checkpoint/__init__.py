"""Checkpoints: sharded, atomic, optionally written in the background, resharded on load.

The public face: ``Checkpointer`` saves (synchronously or in the background), ``load_checkpoint``
restores the newest intact checkpoint, ``find_latest`` and ``iterations`` say what a save
directory holds. ``format`` names the files, ``save``/``async_save`` write them, ``load``,
``reshard``, ``stages`` and ``optim_shards`` read them back at any layout.
"""

from megatron.checkpoint.async_save import Checkpointer
from megatron.checkpoint.load import (
    candidates,
    checkpoint_dir,
    find_latest,
    iterations,
    load_checkpoint,
)
from megatron.checkpoint.save import save_checkpoint

__all__ = [
    "Checkpointer",
    "candidates",
    "checkpoint_dir",
    "find_latest",
    "iterations",
    "load_checkpoint",
    "save_checkpoint",
]
