"""The tensor-parallel transformer: attention, MLP, a layer (pre-LN or post-LN), and the stack.

Per layer, attention and MLP each open a parallel region with a column-parallel matrix (f) and
close it with a row-parallel one (g): two all-reduces forward and two backward, nothing else.
The config names the architecture (``model.*``): LayerNorm or RMSNorm, learned positions or RoPE,
GeLU or SwiGLU, grouped-query attention and its head width, the biases, QK norms.

With ``sequence_parallel`` the activations between the regions (LayerNorms, dropouts, residual
adds) are each rank's slice of the sequence, [b, s / tp, h]: f all-gathers along the sequence and
g reduce-scatters, so a layer does two all-gathers and two reduce-scatters each way and no
all-reduce. The LayerNorms' parameters see split activations and are flagged for the gradient
all-reduce over TP (``megatron.parallel.sequence_parallel``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch.utils.checkpoint
from torch import Tensor, nn

from megatron.models.activations import activate
from megatron.models.document_mask import BlockMask, RingMask, attention
from megatron.models.kv_cache import KVCache
from megatron.models.moe.layer import MoELayer
from megatron.models.moe.stats import RoutingStats
from megatron.models.rope import RotaryEmbedding, apply_rotary
from megatron.parallel import sequence_parallel as sp
from megatron.parallel.context_parallel import Ring, ring_attention
from megatron.parallel.layers import (
    ColumnParallelLinear,
    InitMethod,
    RowParallelLinear,
    normal_init,
)
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState


def norm_layer(
    cfg, state: ParallelState, sequence_parallel: bool, dim: int | None = None
) -> nn.Module:
    """A ``model.normalization`` norm over ``dim`` (the hidden size unless given); flagged when it
    sees sequence-split activations. torch's RMSNorm computes in fp32 and casts back, as
    transformers' LlamaRMSNorm does (bit for bit in fp32)."""
    kind = nn.RMSNorm if cfg.normalization == "rmsnorm" else nn.LayerNorm
    norm = kind(dim or cfg.hidden_size, eps=cfg.layernorm_epsilon, device=state.device)
    if sp.sequence_group(state, sequence_parallel) is not None:
        sp.mark_sequence_parallel(*norm.parameters())
    return norm


def init_methods(cfg, generator: torch.Generator) -> tuple[InitMethod, InitMethod]:
    """N(0, std) for the matrices that open a parallel region, and N(0, std / sqrt(2 layers)) for
    those that close one into the residual stream (GPT-2's scaled init), both from ``generator``."""
    out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    return normal_init(cfg.init_method_std, generator), normal_init(out_std, generator)


class ParallelAttention(nn.Module):
    """Self-attention with whole query groups per TP rank: the heads / groups query heads of a
    group share its key and value head (grouped-query attention; one group per head is
    multi-head attention, one group multi-query).

    The fused QKV matrix orders its output rows [group, (q x heads / groups, k, v), head_dim]
    ([head, (q, k, v), head_dim] with a group per head), so a contiguous column split hands each
    rank the queries, key and value of its own groups. With ``sequence_parallel`` the input and
    output are this rank's sequence slice; attention itself sees the whole sequence.

    ``qk_layernorm``: q and k are normalised over head_dim, each head alike (one replicated
    weight each), before RoPE. Each TP rank's heads contribute only their part of those weights'
    gradients, so they are flagged for the TP all-reduce as sequence-split parameters are.
    """

    def __init__(
        self,
        cfg,
        state: ParallelState,
        tracker: RNGTracker,
        generator: torch.Generator,
        kv_slot: int,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.kv_slot = kv_slot
        h, d = cfg.hidden_size, cfg.head_dim
        heads, groups = cfg.num_attention_heads, cfg.query_groups
        self.heads_per_partition = heads // state.tp_size
        self.groups_per_partition = groups // state.tp_size
        self.q_per_group, self.head_dim = heads // groups, d
        self.dropout = cfg.attention_dropout
        self.tracker = tracker
        self.ring = None  # context parallelism: the CP ranks that hold the other chunks
        if state.cp_size > 1:
            self.ring = Ring(state.cp_group, state.cp_ranks, state.cp_rank)
        init, out_init = init_methods(cfg, generator)
        qkv_bias, bias = cfg.add_bias_linear or cfg.add_qkv_bias, cfg.add_bias_linear
        self.qkv = ColumnParallelLinear(
            h, (heads + 2 * groups) * d, state, init, qkv_bias, sequence_parallel=sequence_parallel
        )
        self.dense = RowParallelLinear(
            heads * d, h, state, out_init, bias, sequence_parallel=sequence_parallel
        )
        self.q_norm = self.k_norm = None
        if cfg.qk_layernorm:
            self.q_norm, self.k_norm = (norm_layer(cfg, state, False, d) for _ in "qk")
            if state.tp_size > 1:
                sp.mark_sequence_parallel(*self.q_norm.parameters(), *self.k_norm.parameters())

    def forward(
        self,
        x: Tensor,
        attn_mask: Tensor | BlockMask | RingMask | None,
        rotary: tuple[Tensor, Tensor] | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """``attn_mask``: None (causal), an SDPA mask, a document BlockMask (see
        ``document_mask``), or with context parallelism a RingMask. ``rotary``: RoPE's (cos,
        sin) of these positions. ``kv_cache``: attend over the cached positions too, and cache
        these (decoding)."""
        qkv = self.qkv(x)  # [b, s, (heads + 2 groups) * head_dim / tp]: the whole sequence
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, self.groups_per_partition, self.q_per_group + 2, self.head_dim)
        # Split the (q, k, v) axis where it lies: backward then concatenates the gradients
        # straight into this layout, where splitting a permuted view costs one more full copy.
        q, k, v = qkv.split([self.q_per_group, 1, 1], dim=3)
        # [b, s, heads_per_partition, head_dim]: a copy where the rank holds several groups of
        # several heads, else a view
        q = q.reshape(b, s, self.heads_per_partition, self.head_dim)
        k, v = k.squeeze(3), v.squeeze(3)  # [b, s, groups_per_partition, head_dim]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            # Before the transpose: new tensors then keep the [b, s, heads, head_dim] memory
            # order of the views they replace, so attention's output stays one too, and the
            # dense layer's input a view of it.
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        # [b, heads_per_partition, s, head_dim]; k and v [b, groups_per_partition, s, head_dim]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        causal = attn_mask is None
        if kv_cache is not None:
            attn_mask = kv_cache.causal_mask(s, x.device)
            causal = attn_mask is None and kv_cache.length == 0
            k, v = kv_cache.append(self.kv_slot, k, v)  # [b, groups_pp, cached + s, head_dim]
        dropout = self.dropout if self.training else 0.0
        if isinstance(attn_mask, RingMask):  # the config checks refuse dropout with CP
            ctx = ring_attention(
                q, k, v, self.ring, attn_mask.causal, attn_mask.document_ids, attn_mask.runs
            )
        elif dropout == 0.0:
            # Nothing is drawn, so the RNG fork is skipped: it swaps generator states, which
            # torch.compile cannot trace (a graph break mid-layer).
            ctx = attention(q, k, v, attn_mask, dropout, causal)
        else:
            # Attention probabilities are split by head, so their dropout draws from this TP
            # rank's own stream.
            with self.tracker.fork():
                ctx = attention(q, k, v, attn_mask, dropout, causal)
        ctx = ctx.transpose(1, 2).reshape(b, s, self.heads_per_partition * self.head_dim)
        return self.dense(ctx)  # [b, s, h] replicated, or [b, s / tp, h] with sequence_parallel


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel), GeLU, ffn -> h (row-parallel); or SwiGLU: fc1 is the gate and
    up projections h -> 2 ffn, then SiLU(gate) * up -> fc2.

    SwiGLU's fc1 interleaves its output rows [ffn, (gate, up)], so a contiguous column split
    hands each rank matching gate and up slices (as the QKV layout does the heads' q, k, v), and
    resharding splits it like any column-parallel matrix.
    """

    def __init__(
        self, cfg, state: ParallelState, generator: torch.Generator, sequence_parallel: bool = False
    ):
        super().__init__()
        self.activation = cfg.activation
        h, ffn, bias = cfg.hidden_size, cfg.ffn_hidden_size, cfg.add_bias_linear
        fc1 = 2 * ffn if self.activation == "swiglu" else ffn
        init, out_init = init_methods(cfg, generator)
        self.fc1 = ColumnParallelLinear(
            h, fc1, state, init, bias, sequence_parallel=sequence_parallel
        )
        self.fc2 = RowParallelLinear(
            ffn, h, state, out_init, bias, sequence_parallel=sequence_parallel
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc1(x)  # [b, s, ffn / tp], SwiGLU [b, s, 2 ffn / tp]
        return self.fc2(activate(y, self.activation))  # fc2 of [b, s, ffn / tp]


class TransformerLayer(nn.Module):
    """Pre-LN: x + Attn(LN(x)), then x + MLP(LN(x)). Post-LN: LN(x + Attn(x)), LN(x + MLP(x)).

    ``x`` is [b, s, h], or this rank's [b, s / tp, h] with ``sequence_parallel``. ``index`` is
    the layer's global index: its initial values come from that index's stream alone
    (``RNGTracker.init_generator``). ``kv_slot``, its place in a KV cache, is ``index`` unless
    the layer sits in a pipeline stage (which caches only its own layers). Its MLP is a mixture
    of experts where ``model.moe_layers`` says so, adding its routing figures to ``routing``.
    """

    def __init__(
        self,
        cfg,
        state: ParallelState,
        tracker: RNGTracker,
        index: int,
        sequence_parallel: bool = False,
        kv_slot: int | None = None,
        routing: RoutingStats | None = None,
    ):
        super().__init__()
        self.pre_ln = cfg.layernorm_position == "pre"
        generator = tracker.init_generator(index)
        kv_slot = index if kv_slot is None else kv_slot
        self.ln1 = norm_layer(cfg, state, sequence_parallel)
        self.attention = ParallelAttention(
            cfg, state, tracker, generator, kv_slot, sequence_parallel
        )
        self.ln2 = norm_layer(cfg, state, sequence_parallel)
        if cfg.moe_layers[index]:
            init, out_init = init_methods(cfg, generator)
            self.mlp = MoELayer(
                cfg, state, tracker, init, out_init, index, routing, sequence_parallel
            )
        else:
            self.mlp = ParallelMLP(cfg, state, generator, sequence_parallel)
        self.dropout = cfg.hidden_dropout
        self.seq_group = sp.sequence_group(state, sequence_parallel)

    def forward(
        self,
        x: Tensor,
        attn_mask: Tensor | BlockMask | RingMask | None,
        rotary: tuple[Tensor, Tensor] | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        # The sublayer outputs are replicated across TP ranks, so this dropout uses the shared
        # generator and every rank drops the same elements; split along the sequence, each rank
        # keeps its slice of that same mask.
        drop = lambda t: sp.dropout(t, self.dropout, self.training, self.seq_group)  # noqa: E731
        if self.pre_ln:
            x = x + drop(self.attention(self.ln1(x), attn_mask, rotary, kv_cache))
            return x + drop(self.mlp(self.ln2(x)))
        x = self.ln1(x + drop(self.attention(x, attn_mask, rotary, kv_cache)))
        return self.ln2(x + drop(self.mlp(x)))


class LayerSlots(nn.Module):
    """Transformer layers named by their global index (``"4"``: layer 4 of the whole model), so
    a pipeline stage's state_dict keys are the whole model's keys for the layers it holds.
    Indexing, ``len`` and iteration are by local position, as for an ``nn.ModuleList``."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __getitem__(self, position: int) -> nn.Module:
        return list(self._modules.values())[position]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())


class TransformerStack(nn.Module):
    """N layers, a final norm when pre-LN, optional full activation recomputation, and
    optional ``torch.compile`` of each layer (``model.compile``). With ``sequence_parallel``
    its input and output are this rank's sequence slice. With RoPE it turns the position ids
    into the rotations every layer applies.

    ``chunks`` (a pipeline stage): the global indices of the layers this stage holds, one range
    per model chunk; ``forward(chunk=c)`` runs chunk c's. Only those layers are built, each from
    its own global index's stream, so they equal the whole model's (as TP slices do). The final
    LayerNorm belongs to the chunk that holds the last layer.
    """

    def __init__(
        self,
        cfg,
        state: ParallelState,
        tracker: RNGTracker,
        sequence_parallel: bool = False,
        chunks: list[range] | None = None,
    ):
        super().__init__()
        chunks = chunks or [range(cfg.num_layers)]
        held = [i for chunk in chunks for i in chunk]  # global indices, in local order
        slots = {index: slot for slot, index in enumerate(held)}  # the KV cache holds these only
        # The step's routing figures of every MoE layer (None: a dense model).
        self.routing = RoutingStats(cfg, state, sequence_parallel) if any(cfg.moe_layers) else None
        routing, sp_on = self.routing, sequence_parallel
        self.layers = LayerSlots(
            {i: TransformerLayer(cfg, state, tracker, i, sp_on, slots[i], routing) for i in held}
        )
        self.chunk_slices = [slice(slots[c[0]], slots[c[-1]] + 1) for c in chunks]
        self.final_ln = None
        if cfg.layernorm_position == "pre" and cfg.num_layers - 1 in held:
            self.final_ln = norm_layer(cfg, state, sequence_parallel)
        self.rotary = None
        if cfg.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(cfg, state.device)
        self.recompute = cfg.recompute == "full"
        self.tracker = tracker
        # Regional compilation (model.compile): each layer on its own, so layers share one
        # compiled graph and nothing outside them is traced. Decoding with a KV cache stays
        # eager: the cache length changes every step and would recompile the layer each time.
        self.compiled = [torch.compile(layer) for layer in self.layers] if cfg.compile else None

    def forward(
        self,
        x: Tensor,
        attn_mask: Tensor | BlockMask | RingMask | None = None,
        kv_cache: KVCache | None = None,
        chunk: int = 0,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """Chunk ``chunk``'s layers (all of them without a pipeline). ``kv_cache`` (inference):
        each layer attends over and extends it; it then counts the new positions as cached.
        ``position_ids`` [b or 1, s] (whole sequences): RoPE's positions; RoPE needs them."""
        rotary = None if self.rotary is None else self.rotary(position_ids, x.dtype)
        layers = list(self.layers)
        if self.compiled is not None and kv_cache is None:
            layers = self.compiled
        for layer in layers[self.chunk_slices[chunk]]:
            if self.recompute and self.training:
                x = torch.utils.checkpoint.checkpoint(
                    layer,
                    x,
                    attn_mask,
                    rotary,
                    use_reentrant=False,
                    context_fn=self.tracker.recompute_context,
                )
            else:
                x = layer(x, attn_mask, rotary, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(x.shape[1])
        last = chunk == len(self.chunk_slices) - 1
        return x if self.final_ln is None or not last else self.final_ln(x)
