"""A plain single-process PyTorch Llama: the baseline that ``bench_gpt_step.py`` times ours against.

Written as one writes a Llama first, with no tensor parallelism in mind: separate q, k and v
projections, rotate-half RoPE with cos and sin computed each forward, RMSNorm as
``x * rsqrt(mean(x^2) + eps) * w``, SwiGLU with separate gate and up projections, grouped-query
attention by repeating each key/value head (``repeat_interleave``) for its query heads before a
causal ``F.scaled_dot_product_attention``, an untied LM head and ``F.cross_entropy``. No biases,
no dropout. Initialised as ``megatron.models.gpt.GPTModel`` is (weights N(0, std), output
projections N(0, std / sqrt(2 * layers)), norm weights one); the benchmark copies our weights in.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w, over the last dimension."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension's halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    """x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    def __init__(self, hidden: int, heads: int, groups: int, ffn: int, eps: float):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        self.attn_norm = RMSNorm(hidden, eps)
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k = nn.Linear(hidden, groups * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, groups * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        y = self.attn_norm(x)
        # [b, heads, s, head_dim]; k and v [b, groups, s, head_dim]
        q = self.q(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(y).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        v = self.v(y).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        repeat = self.heads // self.groups  # query heads per key/value head
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, head_dim]
        x = x + self.o(ctx.transpose(1, 2).reshape(b, s, -1))
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class PlainLlama(nn.Module):
    """Token embeddings, RoPE blocks, a final RMSNorm and an untied LM head; returns the mean
    loss."""

    def __init__(
        self,
        vocab_size: int,
        num_layers: int,
        hidden: int,
        heads: int,
        groups: int,
        ffn: int,
        theta: float = 500000.0,
        std: float = 0.02,
        eps: float = 1e-5,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList(
            Block(hidden, heads, groups, ffn, eps) for _ in range(num_layers)
        )
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        head_dim = hidden // heads
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 2]
        out_std = std / math.sqrt(2.0 * num_layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scaled = name.endswith(("o.weight", "down.weight"))
                nn.init.normal_(p, mean=0.0, std=out_std if scaled else std)

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).float()
        freqs = torch.outer(positions, self.inv_freq)  # [s, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [s, head_dim]: broadcast over b and heads
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens)  # [b, s, h]
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
