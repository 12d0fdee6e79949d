"""A plain single-process PyTorch GPT: the baseline that ``bench_gpt_step.py`` times ours against.

Only stock modules and functional calls (nn.Embedding, nn.Linear, nn.LayerNorm, causal
F.scaled_dot_product_attention, GeLU, F.cross_entropy), written the way one would without any
tensor parallelism in mind. Same shape and initialisation as ``megatron.models.gpt.GPTModel``:
pre-LN, learned positions, LM head tied to the word embeddings, weights N(0, std), output
projections N(0, std / sqrt(2 * layers)), zero biases. No dropout: the benchmark runs both
models with dropout off.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Block(nn.Module):
    """x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, hidden: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)  # each [b, s, h]
        # [b, heads, s, head_dim]
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    """Token + position embeddings, pre-LN blocks, final LN, tied LM head; returns the mean loss."""

    def __init__(
        self,
        vocab_size: int,
        seq_length: int,
        num_layers: int,
        hidden: int,
        heads: int,
        ffn: int | None = None,
        std: float = 0.02,
        eps: float = 1e-5,
    ):
        super().__init__()
        ffn = ffn or 4 * hidden
        self.wte = nn.Embedding(vocab_size, hidden)
        self.wpe = nn.Embedding(seq_length, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, eps) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        out_std = std / math.sqrt(2.0 * num_layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                scaled = name.endswith(("proj.weight", "fc2.weight"))
                nn.init.normal_(p, mean=0.0, std=out_std if scaled else std)

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)  # [b, s, h]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
