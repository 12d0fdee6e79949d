"""BERT: word + position + token-type embeddings, a bidirectional transformer, and two heads.

::

    text, types --> Embedding --> TransformerStack (padding mask, no causal mask) --> h [b, s, h]
    h (masked positions) --> dense, GeLU, LayerNorm --> x word_embeddings^T + bias --> MLM loss
    h[:, 0] ([CLS])      --> pooler: dense, tanh --> binary head (h -> 2)  --> SOP / NSP logits

Pre-LN by default; ``model.layernorm_position=post`` gives the original BERT arrangement, which
also normalises the embedding sum (pre-LN normalises it in the first layer instead). The decoder
options (RoPE, RMSNorm, SwiGLU, query groups, biases, QK norms) apply as they do to GPT. The MLM
head's last matmul reuses the vocab-split word table (always tied), so its logits and its output
bias are split by vocabulary like the embedding; the pooler, the head's dense and norm and the
binary head are small and replicated, and see replicated activations, so every TP rank computes
them alike.

With ``sequence_parallel`` the embedding output and the transformer's activations are split along
the sequence over TP; the transformer's output is gathered before the heads, which see it
replicated as before (post-LN's embedding LayerNorm then sees split activations and is flagged).

In a pipeline each stage is a BertModel holding its layers (by global name); the embeddings (and
post-LN's embedding LayerNorm) are the first stage's, the heads the last's, with a copy of the
word table for the tied MLM head (``embedding.Embedding``). Each head draws from its own stream.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.models.activations import gelu
from megatron.models.document_mask import RingMask
from megatron.models.embedding import Embedding
from megatron.models.transformer import TransformerStack, norm_layer
from megatron.parallel import sequence_parallel as sp
from megatron.parallel.context_parallel import held_positions
from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.layers import normal_init
from megatron.parallel.mappings import copy_to_tp, gather_seq
from megatron.parallel.random import BINARY_HEAD, LM_HEAD, POOLER, RNGTracker
from megatron.parallel.state import ParallelState

BINARY_HEADS = ("sop", "nsp", "none")


def _linear(
    cfg, in_features: int, out_features: int, generator: torch.Generator, device: torch.device
) -> nn.Linear:
    """A replicated dense layer: N(0, init_method_std) weight from ``generator`` (the same on
    every TP rank), zero bias; ``skip_init`` spares nn.Linear's own draw."""
    layer = nn.utils.skip_init(nn.Linear, in_features, out_features, device=device)
    normal_init(cfg.init_method_std, generator)(layer.weight.data)
    layer.bias.data.zero_()
    return layer


class BertLMHead(nn.Module):
    """Masked-LM head: dense (h -> h), GeLU, LayerNorm, then logits against the word table.

    With the word table E = [E_1; ...; E_p] split by vocabulary, rank i computes
    ``LN(GeLU(x W + c)) E_i^T + b_i``: its slice of the logits, ready for the vocab-parallel loss.
    The output bias b = [b_1, ..., b_p] is split the same way (``tp_split_dim`` 0) and, like E,
    has a row per padded vocabulary entry (``vocab_padded``); it starts at zero.
    """

    def __init__(self, cfg, padded_vocab_size: int, state: ParallelState, tracker: RNGTracker):
        super().__init__()
        h = cfg.hidden_size
        self.group, self.activation = state.tp_group, cfg.activation
        self.dense = _linear(cfg, h, h, tracker.init_generator(LM_HEAD), state.device)
        self.layernorm = norm_layer(cfg, state, False)
        vocab_per_partition = padded_vocab_size // state.tp_size
        self.bias = nn.Parameter(torch.zeros(vocab_per_partition, device=state.device))
        self.bias.tp_split_dim = 0
        self.bias.vocab_padded = True

    def forward(self, x: Tensor, word_weight: Tensor) -> Tensor:
        x = self.layernorm(gelu(self.dense(x), self.activation))  # [..., h], replicated
        # f: the logits are column-parallel in the word table, so the input's gradient is summed
        return F.linear(copy_to_tp(x, self.group), word_weight, self.bias)  # [..., V / tp]


class BertModel(nn.Module):
    """BERT with a masked-LM head and an optional binary (sentence-order or next-sentence) head.

    ``binary_head`` is "sop", "nsp" (the same h -> 2 classifier on the pooled [CLS]; the data
    decides what its label means) or "none" (no pooler, no classifier). ``forward`` returns
    ``(lm, binary)``: see its docstring.
    """

    def __init__(
        self,
        cfg,
        vocab_size: int,
        padded_vocab_size: int,
        state: ParallelState,
        tracker: RNGTracker,
        num_tokentypes: int = 2,
        binary_head: str = "sop",
        sequence_parallel: bool = False,
        chunks: int = 1,
    ):
        super().__init__()
        if binary_head not in BINARY_HEADS:
            raise ValueError(f"binary_head={binary_head!r}; use one of {', '.join(BINARY_HEADS)}")
        h, device = cfg.hidden_size, state.device
        self.vocab_size, self.tp_group = vocab_size, state.tp_group
        self.cp_rank, self.cp_size = state.cp_rank, state.cp_size
        self.binary_task = binary_head
        self.dropout = cfg.hidden_dropout
        self.seq_group = sp.sequence_group(state, sequence_parallel)
        self.pre_process, self.post_process = state.is_first_stage, state.is_last_stage
        self.num_chunks = chunks
        # Called whole (no pipeline, or one chunk on the last stage) the model returns the loss.
        self.computes_loss = self.post_process and chunks == 1
        self.embedding_ln = None
        embedding_cfg = cfg
        if cfg.layernorm_position == "post":
            # Original BERT drops out the *normalised* embedding sum: the dropout moves here.
            embedding_cfg = dataclasses.replace(cfg, hidden_dropout=0.0)
            if self.pre_process:
                self.embedding_ln = norm_layer(cfg, state, sequence_parallel)
        self.embedding = None
        if self.pre_process or self.post_process:
            self.embedding = Embedding(
                embedding_cfg, vocab_size, padded_vocab_size, state, tracker, num_tokentypes,
                sequence_parallel,
            )  # fmt: skip
        self.transformer = TransformerStack(
            cfg, state, tracker, sequence_parallel, state.layer_ranges(cfg.num_layers, chunks)
        )
        self.lm_head = self.pooler = self.binary_head = None
        if not self.post_process:
            return  # the heads are the last stage's
        self.lm_head = BertLMHead(cfg, padded_vocab_size, state, tracker)
        if binary_head != "none":
            self.pooler = _linear(cfg, h, h, tracker.init_generator(POOLER), device)
            self.binary_head = _linear(cfg, h, 2, tracker.init_generator(BINARY_HEAD), device)

    def _mask(self, padding_mask: Tensor, dtype: torch.dtype) -> Tensor | RingMask:
        """Every query attends to every real (non-padding) key: bidirectional, no causal mask.

        Additive (0 / -inf) in the activations' dtype, made once: given a bool mask, every
        layer's attention would convert it again and keep its own copy for backward. Around a
        ring, padding is a document of its own: real queries then see exactly the real keys, as
        here (a padding query sees only padding, but no loss reads a padding position).
        """
        padding = padding_mask == 0  # [b, s]
        if self.cp_size > 1:
            return RingMask(causal=False, document_ids=padding.long())
        attend = torch.zeros(padding[:, None, None, :].shape, dtype=dtype, device=padding.device)
        return attend.masked_fill_(padding[:, None, None, :], float("-inf"))  # [b, 1, 1, s]

    def forward(
        self,
        tokens: Tensor,
        types: Tensor | None,
        padding_mask: Tensor,
        labels: Tensor | None = None,
        masked_positions: Tensor | None = None,
        hidden: Tensor | None = None,
        chunk: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        """``tokens``, ``types``, ``padding_mask`` (1 on real tokens), ``labels``: [b, s];
        ``masked_positions``: [b, p], each sample's masked positions padded to a fixed ``p``
        with positions whose label is -1 (the datasets pad with 0, the [CLS]).

        With context parallelism ``tokens``, ``types`` and ``labels`` are this rank's two chunks
        of each sequence, ``padding_mask`` the whole samples', and ``masked_positions`` index
        the rank's own positions, -1 where another rank holds one (``context_batch``).

        Returns ``(lm, binary)``. Without ``labels``, ``lm`` is this rank's vocab-parallel logits
        [b, s, padded_vocab / tp] at every position. With ``labels``, it is the per-token fp32
        loss [b, s]: only the ``masked_positions`` (every position when None) go through the LM
        head, positions whose label is >= 0 (the masked ones; -1 elsewhere) get their loss, and
        the others hold 0. ``binary`` is [b, 2] logits on the pooled [CLS], or None without a
        binary head.

        In a pipeline, model chunk ``chunk`` of this stage runs: it takes ``hidden`` (the
        previous stage's output) unless it is the first stage's first chunk, and returns
        ``(activation, None)`` unless it is the last stage's last chunk.
        """
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        if self.cp_size > 1:  # the global positions this rank holds
            seq = padding_mask.shape[1]
            positions = held_positions(seq, self.cp_rank, self.cp_size, tokens.device)[None]
        if self.pre_process and chunk == 0:
            hidden = self.embedding(tokens, positions, types)  # [b, s, h], or [b, s / tp, h]
            if self.embedding_ln is not None:
                hidden = self.embedding_ln(hidden)
                hidden = sp.dropout(hidden, self.dropout, self.training, self.seq_group)
        mask = self._mask(padding_mask, hidden.dtype)
        x = self.transformer(hidden, mask, chunk=chunk, position_ids=positions)
        if not (self.post_process and chunk == self.num_chunks - 1):
            return x, None  # to the next pipeline stage
        # The heads' consumers are replicated (the LM head's f sums its input gradient), so the
        # gathered gradient is whole on every rank and each keeps its slice.
        x = gather_seq(x, self.seq_group)  # [b, s, h], replicated across TP ranks

        binary = None
        if self.binary_head is not None:
            pooled = torch.tanh(self.pooler(x[:, 0]))  # [b, h]: the [CLS] position
            binary = self.binary_head(pooled)  # [b, 2]
        word = self.embedding.word.weight
        if labels is None:
            return self.lm_head(x, word), binary

        b, s, h = x.shape
        if masked_positions is None:
            masked_positions = torch.arange(s, device=x.device).expand(b, s)
        # ~15% of positions are masked; the head and the loss (most of BERT's step at small
        # widths) run on at most p of them per sample. A fixed p, where picking the masked
        # positions out of the labels (nonzero) would make the host wait for the device.
        here = masked_positions >= 0  # another CP rank's position: -1
        rows = masked_positions.clamp(min=0) + s * torch.arange(b, device=x.device)[:, None]
        rows = rows.reshape(-1)  # [b * p], into the flattened [b * s]
        selected = x.reshape(b * s, h).index_select(0, rows)  # [b * p, h]
        logits = self.lm_head(selected, word)  # [b * p, V / tp]
        targets = labels.reshape(-1).index_select(0, rows)  # [b * p], -1 on padding
        masked = (targets >= 0) & here.reshape(-1)
        # The logits are this call's own temporary, so the loss may overwrite them.
        losses = vocab_parallel_cross_entropy(
            logits, targets.clamp(min=0), self.vocab_size, self.tp_group, inplace=True
        )
        # Padding rows add exact zeros (to the [CLS] position, whose label is -1).
        losses = torch.where(masked, losses, 0.0)
        lm = losses.new_zeros(b * s).index_add(0, rows, losses)
        return lm.view(b, s), binary
