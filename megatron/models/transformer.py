"""The tensor-parallel transformer: attention, MLP, a layer (pre-LN or post-LN), and the stack.

Per layer, attention and MLP each open a parallel region with a column-parallel matrix (f) and
close it with a row-parallel one (g): two all-reduces forward and two backward, nothing else.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from megatron.models.document_mask import BlockMask, attention
from megatron.models.kv_cache import KVCache
from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear, normal_init
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState


class ParallelAttention(nn.Module):
    """Multi-head self-attention with whole heads per TP rank.

    The fused QKV matrix orders its output rows [head, (q, k, v), head_dim], so a contiguous
    column split hands each rank the q, k and v of its own heads.
    """

    def __init__(self, cfg, state: ParallelState, tracker: RNGTracker, layer_index: int):
        super().__init__()
        self.layer_index = layer_index  # this layer's slot in a KV cache
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.heads_per_partition = heads // state.tp_size
        self.head_dim = h // heads
        self.dropout = cfg.attention_dropout
        self.tracker = tracker
        init = normal_init(cfg.init_method_std)
        out_init = normal_init(cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers))
        self.qkv = ColumnParallelLinear(h, 3 * h, state, init)
        self.dense = RowParallelLinear(h, h, state, out_init)

    def forward(
        self, x: Tensor, attn_mask: Tensor | BlockMask | None, kv_cache: KVCache | None = None
    ) -> Tensor:
        """``attn_mask``: None (causal), an SDPA mask, or a document BlockMask (see
        ``document_mask``). ``kv_cache``: attend over the cached positions too, and cache these
        (decoding)."""
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.heads_per_partition, 3, self.head_dim)
        # Unbind the (q, k, v) axis where it lies: backward then stacks the three gradients
        # straight into this layout, where unbinding a permuted view costs one more full copy.
        # each [b, heads_per_partition, s, head_dim]
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        causal = attn_mask is None
        if kv_cache is not None:
            attn_mask = kv_cache.causal_mask(s, x.device)
            causal = attn_mask is None and kv_cache.length == 0
            k, v = kv_cache.append(self.layer_index, k, v)  # [b, heads_pp, cached + s, head_dim]
        dropout = self.dropout if self.training else 0.0
        if dropout == 0.0:
            # Nothing is drawn, so the RNG fork is skipped: it swaps generator states, which
            # torch.compile cannot trace (a graph break mid-layer).
            ctx = attention(q, k, v, attn_mask, dropout, causal)
        else:
            # Attention probabilities are split by head, so their dropout draws from this TP
            # rank's own stream.
            with self.tracker.fork():
                ctx = attention(q, k, v, attn_mask, dropout, causal)
        ctx = ctx.transpose(1, 2).reshape(b, s, self.heads_per_partition * self.head_dim)
        return self.dense(ctx)  # [b, s, h], replicated


def gelu(x: Tensor, activation: str) -> Tensor:
    """``model.activation``: "gelu" is exact (erf); "gelu_tanh" is the tanh approximation that
    released GPT-2 weights were trained with (HF's ``gelu_new``)."""
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel), GeLU, ffn -> h (row-parallel)."""

    def __init__(self, cfg, state: ParallelState):
        super().__init__()
        self.activation = cfg.activation
        init = normal_init(cfg.init_method_std)
        out_init = normal_init(cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers))
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, state, init)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, state, out_init)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(gelu(self.fc1(x), self.activation))


class TransformerLayer(nn.Module):
    """Pre-LN: x + Attn(LN(x)), then x + MLP(LN(x)). Post-LN: LN(x + Attn(x)), LN(x + MLP(x))."""

    def __init__(self, cfg, state: ParallelState, tracker: RNGTracker, layer_index: int):
        super().__init__()
        self.pre_ln = cfg.layernorm_position == "pre"
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=state.device)
        self.attention = ParallelAttention(cfg, state, tracker, layer_index)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=state.device)
        self.mlp = ParallelMLP(cfg, state)
        self.dropout = cfg.hidden_dropout

    def forward(
        self, x: Tensor, attn_mask: Tensor | BlockMask | None, kv_cache: KVCache | None = None
    ) -> Tensor:
        # The sublayer outputs are replicated across TP ranks, so this dropout uses the shared
        # generator and every rank drops the same elements.
        drop = lambda t: F.dropout(t, self.dropout, self.training)  # noqa: E731
        if self.pre_ln:
            x = x + drop(self.attention(self.ln1(x), attn_mask, kv_cache))
            return x + drop(self.mlp(self.ln2(x)))
        x = self.ln1(x + drop(self.attention(x, attn_mask, kv_cache)))
        return self.ln2(x + drop(self.mlp(x)))


class TransformerStack(nn.Module):
    """N layers, a final LayerNorm when pre-LN, optional full activation recomputation, and
    optional ``torch.compile`` of each layer (``model.compile``)."""

    def __init__(self, cfg, state: ParallelState, tracker: RNGTracker):
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(cfg, state, tracker, i) for i in range(cfg.num_layers)
        )
        self.final_ln = None
        if cfg.layernorm_position == "pre":
            self.final_ln = nn.LayerNorm(
                cfg.hidden_size, eps=cfg.layernorm_epsilon, device=state.device
            )
        self.recompute = cfg.recompute == "full"
        self.tracker = tracker
        # Regional compilation (model.compile): each layer on its own, so layers share one
        # compiled graph and nothing outside them is traced. Decoding with a KV cache stays
        # eager: the cache length changes every step and would recompile the layer each time.
        self.compiled = [torch.compile(layer) for layer in self.layers] if cfg.compile else None

    def forward(
        self,
        x: Tensor,
        attn_mask: Tensor | BlockMask | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """``kv_cache`` (inference): each layer attends over and extends it; it then counts
        the new positions as cached."""
        for i, layer in enumerate(self.layers):
            if self.compiled is not None and kv_cache is None:
                layer = self.compiled[i]
            if self.recompute and self.training:
                x = torch.utils.checkpoint.checkpoint(
                    layer,
                    x,
                    attn_mask,
                    use_reentrant=False,
                    context_fn=self.tracker.recompute_context,
                )
            else:
                x = layer(x, attn_mask, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(x.shape[1])
        return x if self.final_ln is None else self.final_ln(x)
