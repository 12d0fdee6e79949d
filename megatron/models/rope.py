"""Rotary position embeddings (RoPE, Su et al. 2021) in Hugging Face's rotate-half convention,
the one Llama checkpoints are trained with.

The first ``rot = head_dim * rotary_percent`` channels of every query and key head rotate in
pairs (j, j + rot/2) by the angle ``position * inv_freq_j``, with ``inv_freq_j = base^(-2j / rot)``;
the other channels pass unchanged::

    x_rot' = x_rot * cos + rotate_half(x_rot) * sin,    rotate_half([x1, x2]) = [-x2, x1]

Llama 3.1's ``rope_scaling`` divides the long wavelengths' frequencies by ``factor`` and blends
those between. Everything is computed as transformers' Llama computes it (the frequencies in
fp32 on the CPU, the angles in fp32, cos and sin then cast to the activations' dtype), so
imported weights see the same rotations.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def inverse_frequencies(cfg) -> Tensor:
    """fp32 [rot / 2] on the CPU: transformers' default RoPE, or its ``llama3`` scaling."""
    rot = int(cfg.head_dim * cfg.rotary_percent)
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    if cfg.rope_scaling is None:
        return inv_freq
    s = cfg.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than context / low are divided by factor, those shorter than
    # context / high kept, and those between interpolated.
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(between, blended, scaled)


class RotaryEmbedding:
    """cos and sin of every position's angles, once per forward pass, for all layers."""

    def __init__(self, cfg, device: torch.device):
        # A plain tensor, not a buffer: model.to(bf16) must not round it, and checkpoints need
        # not hold what the config determines.
        self.inv_freq = inverse_frequencies(cfg).to(device)

    def __call__(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``position_ids`` [b or 1, s] -> (cos, sin), each [b or 1, s, 1, rot] in ``dtype``."""
        freqs = position_ids[..., None].float() * self.inv_freq  # [b, s, rot / 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # [b, s, 1, rot]: for all heads
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` [b, s, heads, head_dim] with its first ``rot`` channels rotated."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated
