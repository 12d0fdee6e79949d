"""GPT: embeddings, a causal pre-LN transformer, and an LM head tied to the word embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.models.document_mask import document_mask, uses_flex
from megatron.models.embedding import Embedding
from megatron.models.kv_cache import KVCache
from megatron.models.transformer import TransformerStack
from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.mappings import copy_to_tp
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState


class GPTModel(nn.Module):
    """Returns vocab-parallel logits [b, s, padded_vocab / tp], or per-token fp32 losses [b, s]
    when ``labels`` are given (the logits then go straight into the vocab-parallel loss).

    ``document_ids`` (optional, int [b, s], as ``gpt_dataset.ltor_masks`` makes them) keeps each
    token to earlier tokens of its own document, when documents reset attention; the mask is
    built from them on the device once per forward and shared by every layer. ``kv_cache``
    (inference): ``tokens`` continue the cached positions; see ``new_kv_cache``.
    """

    def __init__(
        self,
        cfg,
        vocab_size: int,
        padded_vocab_size: int,
        state: ParallelState,
        tracker: RNGTracker,
    ):
        super().__init__()
        self.vocab_size, self.tp_group = vocab_size, state.tp_group
        self.attention_dropout = cfg.attention_dropout  # flex attention has none
        self.embedding = Embedding(cfg, vocab_size, padded_vocab_size, state)
        self.transformer = TransformerStack(cfg, state, tracker)

    def forward(
        self,
        tokens: Tensor,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        labels: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        if kv_cache is not None and position_ids is None:
            start = kv_cache.length
            position_ids = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        h = self.embedding(tokens, position_ids)  # [b, s, h]
        mask = None  # plain causal attention
        if document_ids is not None:
            if kv_cache is not None:
                raise ValueError("document_ids and a KV cache together are not supported")
            dropout = self.attention_dropout if self.training else 0.0
            flex = uses_flex(h.device, dropout)
            mask = document_mask(document_ids, h.dtype, flex)  # BlockMask, or [b, 1, s, s]
        h = self.transformer(h, mask, kv_cache)
        # The tied head is a column-parallel matmul with the vocab-split embedding table.
        logits = F.linear(copy_to_tp(h, self.tp_group), self.embedding.word.weight)
        if labels is None:
            return logits
        # The logits are this call's own temporary, so the loss may overwrite them.
        return vocab_parallel_cross_entropy(
            logits, labels, self.vocab_size, self.tp_group, inplace=True
        )

    def new_kv_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty cache for ``batch_size`` sequences of up to ``max_length`` positions."""
        attention = self.transformer.layers[0].attention
        weight = self.embedding.word.weight
        return KVCache(
            len(self.transformer.layers),
            batch_size,
            attention.heads_per_partition,
            max_length,
            attention.head_dim,
            weight.dtype,
            weight.device,
        )
