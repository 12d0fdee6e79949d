"""GPT: embeddings, a causal pre-LN transformer, and an LM head tied to the word embeddings, or
(``model.untie_embeddings_and_output_weights``) an output layer of its own: Llama's layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.models.document_mask import RingMask, document_mask, uses_flex
from megatron.models.embedding import Embedding
from megatron.models.kv_cache import KVCache
from megatron.models.transformer import TransformerStack
from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.layers import VocabParallelEmbedding, normal_init
from megatron.parallel.mappings import copy_to_tp, gather_seq_to_tp
from megatron.parallel.random import OUTPUT_LAYER, RNGTracker
from megatron.parallel.state import ParallelState


class GPTModel(nn.Module):
    """Returns vocab-parallel logits [b, s, padded_vocab / tp], or per-token fp32 losses [b, s]
    when ``labels`` are given (the logits then go straight into the vocab-parallel loss).

    ``document_ids`` (optional, int [b, s], as ``gpt_dataset.ltor_masks`` makes them) keeps each
    token to earlier tokens of its own document, when documents reset attention; the mask is
    built from them on the device once per forward and shared by every layer. ``kv_cache``
    (inference): ``tokens`` continue the cached positions; see ``new_kv_cache``.

    ``positions`` (optional, int [b, p], evaluation) picks the positions of each sample whose
    logits or losses are computed: the result is [b, p, padded_vocab / tp], or [b, p] losses
    of ``labels`` [b, s] at those positions. Only they go through the LM head and the loss, the
    largest GEMM of a small model, where a sliding window scores a part of its positions.

    ``sequence_parallel`` (training; needs TP > 1 and a sequence length TP divides) splits the
    activations between the TP regions along the sequence; the LM head all-gathers them back.
    Decoding with a KV cache needs a model built without it.

    In a pipeline (``state.pp_size > 1``) this is one stage, in ``chunks`` model chunks
    (interleaved 1F1B): the first stage holds the embeddings, the last the final norm, the
    LM head and the loss, with its own copy of the word table for the tied head (see
    ``Embedding``) or the untied ``output_layer``; its layers keep their global names
    (``transformer.layers.<i>``). A stage builds and draws only what it holds.

    With context parallelism (``state.cp_size > 1``) ``tokens``, ``position_ids`` and
    ``labels`` are this rank's two chunks of each sequence (``megatron.parallel.context_batch``)
    and ``document_ids`` the whole samples'; attention runs around the ring.
    """

    def __init__(
        self,
        cfg,
        vocab_size: int,
        padded_vocab_size: int,
        state: ParallelState,
        tracker: RNGTracker,
        sequence_parallel: bool = False,
        chunks: int = 1,
    ):
        super().__init__()
        self.vocab_size, self.tp_group = vocab_size, state.tp_group
        self.context_parallel = state.cp_size > 1
        self.sequence_parallel = sequence_parallel and state.tp_size > 1
        self.attention_dropout = cfg.attention_dropout  # flex attention has none
        self.max_positions = cfg.max_position_embeddings  # the longest sequence it takes
        self.pre_process, self.post_process = state.is_first_stage, state.is_last_stage
        self.num_chunks = chunks
        # Called whole (no pipeline, or one chunk on the last stage) the model returns the loss.
        self.computes_loss = self.post_process and chunks == 1
        tied = not cfg.untie_embeddings_and_output_weights
        self.embedding = self.output_layer = None
        if self.pre_process or (self.post_process and tied):
            self.embedding = Embedding(
                cfg, vocab_size, padded_vocab_size, state, tracker, 0, sequence_parallel
            )
        if self.post_process and not tied:
            # The untied head: a vocabulary-split table like the word embedding (padded alike,
            # flagged vocab_padded for resharding, from a stream of its own), used through its
            # weight as the tied head uses the word table.
            init = normal_init(cfg.init_method_std, tracker.init_generator(OUTPUT_LAYER))
            self.output_layer = VocabParallelEmbedding(
                vocab_size, padded_vocab_size, cfg.hidden_size, state, init
            )
        self.transformer = TransformerStack(
            cfg, state, tracker, sequence_parallel, state.layer_ranges(cfg.num_layers, chunks)
        )
        self.routing = self.transformer.routing  # MoE: the step's routing figures (else None)

    def forward(
        self,
        tokens: Tensor,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        labels: Tensor | None = None,
        kv_cache: KVCache | None = None,
        hidden: Tensor | None = None,
        chunk: int = 0,
        positions: Tensor | None = None,
    ) -> Tensor:
        """In a pipeline, model chunk ``chunk`` of this stage runs: it takes ``hidden`` (the
        previous stage's output) unless it is the first stage's first chunk, and returns its
        activation [b, s, h] ([b, s / tp, h] split) unless it is the last stage's last chunk."""
        if kv_cache is not None and self.sequence_parallel:
            raise ValueError("a KV cache needs a model built without sequence_parallel")
        if positions is not None and self.sequence_parallel:
            # each TP rank holds a slice of the sequence, not the positions picked from it
            raise ValueError("positions need a model built without sequence_parallel")
        if position_ids is None:
            start = 0 if kv_cache is None else kv_cache.length
            position_ids = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        if self.pre_process and chunk == 0:
            hidden = self.embedding(tokens, position_ids)  # [b, s, h]
        mask = None  # plain causal attention
        if self.context_parallel:
            if kv_cache is not None:
                raise ValueError("decoding runs at context_parallel_size 1")
            mask = RingMask(causal=True, document_ids=document_ids)
        elif document_ids is not None:
            if kv_cache is not None:
                raise ValueError("document_ids and a KV cache together are not supported")
            dropout = self.attention_dropout if self.training else 0.0
            flex = uses_flex(hidden.device, dropout)
            mask = document_mask(document_ids, hidden.dtype, flex)  # BlockMask, or [b, 1, s, s]
        h = self.transformer(hidden, mask, kv_cache, chunk, position_ids)  # [b, s (/ tp), h]
        if not (self.post_process and chunk == self.num_chunks - 1):
            return h  # to the next pipeline stage
        # The head is a column-parallel matmul with the vocab-split table (the word embedding's,
        # or the untied output layer's), entered through f; with sequence parallelism that f
        # also gathers the sequence back.
        table = self.embedding.word if self.output_layer is None else self.output_layer
        enter = gather_seq_to_tp if self.sequence_parallel else copy_to_tp
        if positions is not None:
            # The head's input is whole on every TP rank, so each picks the same rows.
            b, s, width = h.shape
            rows = (positions + s * torch.arange(b, device=h.device)[:, None]).reshape(-1)
            h = h.reshape(b * s, width).index_select(0, rows).view(*positions.shape, width)
            if labels is not None:
                labels = labels.reshape(-1).index_select(0, rows).view(positions.shape)
        logits = F.linear(enter(h, self.tp_group), table.weight)
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
            len(self.transformer.layers), batch_size, attention.groups_per_partition, max_length,
            attention.head_dim, weight.dtype, weight.device,
        )  # fmt: skip
