"""Input embeddings shared by GPT and BERT: word (vocab-parallel) + learned position (+ token
type)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megatron.parallel import sequence_parallel as sp
from megatron.parallel.layers import InitMethod, VocabParallelEmbedding, normal_init
from megatron.parallel.mappings import scatter_seq
from megatron.parallel.random import (
    POSITION_EMBEDDING,
    TOKENTYPE_EMBEDDING,
    WORD_EMBEDDING,
    RNGTracker,
)
from megatron.parallel.state import ParallelState


class Embedding(nn.Module):
    """Sum of word, learned position (``model.position_embedding_type=learned``; RoPE and none
    have no table) and optional token-type embeddings, then dropout.

    The word table is split by vocabulary across TP ranks (and reused as the LM head unless
    ``untie_embeddings_and_output_weights``); position and token-type tables are small and
    replicated, and the output is replicated, so its dropout draws from the shared generator and
    matches across TP ranks. With ``sequence_parallel`` the sum is scattered along the sequence
    before the dropout, which keeps this rank's slice of the same mask: the output is this
    rank's [b, s / tp, h].

    In a pipeline the first stage holds it all; the last (another stage) only the word table,
    the tied LM head's copy (none when untied); the others none of it. Each table draws from its
    own stream (``tracker.init_generator``), so both copies start equal. They carry
    ``pipeline_tied`` so that their gradients are summed over ``state.embedding_group`` and the
    gradient norm counts them once (on the first stage).
    """

    def __init__(
        self,
        cfg,
        vocab_size: int,
        padded_vocab_size: int,
        state: ParallelState,
        tracker: RNGTracker,
        num_tokentypes: int = 0,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.seq_group = sp.sequence_group(state, sequence_parallel)

        def init(index: int) -> InitMethod:
            return normal_init(cfg.init_method_std, tracker.init_generator(index))

        h = cfg.hidden_size
        self.word = VocabParallelEmbedding(
            vocab_size, padded_vocab_size, h, state, init(WORD_EMBEDDING)
        )
        if state.pp_size > 1 and not cfg.untie_embeddings_and_output_weights:
            self.word.weight.pipeline_tied = True
        self.position = self.tokentype = None
        if state.is_first_stage:
            if cfg.position_embedding_type == "learned":
                rows = cfg.max_position_embeddings
                self.position = _table(rows, h, init(POSITION_EMBEDDING), state)
            if num_tokentypes:
                self.tokentype = _table(num_tokentypes, h, init(TOKENTYPE_EMBEDDING), state)
        self.dropout = cfg.hidden_dropout

    def forward(
        self, ids: Tensor, position_ids: Tensor | None = None, tokentype_ids: Tensor | None = None
    ) -> Tensor:
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # [1, s]
        h = self.word(ids)  # [b, s, h]
        if self.position is not None:
            h = h + self.position(position_ids)
        if self.tokentype is not None:
            h = h + self.tokentype(tokentype_ids)
        h = scatter_seq(h, self.seq_group)  # [b, s / tp, h] with sequence parallelism
        return sp.dropout(h, self.dropout, self.training, self.seq_group)


def _table(rows: int, dim: int, init: InitMethod, state: ParallelState) -> nn.Embedding:
    """A replicated table drawn by ``init`` alone: built around its weight, nn.Embedding draws
    none of its own."""
    weight = init(torch.empty(rows, dim, device=state.device))
    return nn.Embedding.from_pretrained(weight, freeze=False)
