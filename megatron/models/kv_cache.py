"""Key/value cache for incremental decoding through the tensor-parallel attention.

Each TP rank caches only its own key/value heads, one per query group (grouped-query attention):
``[b, groups_per_partition, max_length, head_dim]`` per layer, so the cache is split like the
QKV matrix and decoding needs no extra communication. Keys are cached rotated (RoPE). A
forward pass over ``s`` new positions appends their keys and values at ``length`` and attends
over everything cached so far; the stack then advances ``length`` by ``s``.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Preallocated keys and values of every layer, filled left to right."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        groups_per_partition: int,
        max_length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_layers, batch_size, groups_per_partition, max_length, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.max_length = max_length
        self.length = 0  # positions cached, the same for every layer between forward passes

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k``, ``v`` ([b, groups_per_partition, s, head_dim]) after the cached positions
        of ``layer``; return that layer's keys and values so far, [b, groups, length + s, dim]."""
        end = self.length + k.shape[2]
        if end > self.max_length:
            raise ValueError(f"KV cache holds {self.max_length} positions; {end} were asked for")
        self.keys[layer, :, :, self.length : end] = k
        self.values[layer, :, :, self.length : end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def causal_mask(self, new: int, device: torch.device) -> Tensor | None:
        """Bool [new, length + new] (True = attend) for ``new`` queries after ``length`` cached
        keys; None when plain top-left causal attention (empty cache) or no mask (one query)
        already says it."""
        if self.length == 0 or new == 1:
            return None
        query = torch.arange(new, device=device).unsqueeze(1) + self.length  # [new, 1]
        return torch.arange(self.length + new, device=device).unsqueeze(0) <= query

    def advance(self, new: int) -> None:
        """Mark ``new`` more positions as cached (after every layer has appended them)."""
        self.length += new
