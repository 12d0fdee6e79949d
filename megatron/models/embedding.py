"""Input embeddings shared by GPT and BERT: word (vocab-parallel) + position (+ token type)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megatron.parallel import sequence_parallel as sp
from megatron.parallel.layers import VocabParallelEmbedding, normal_init
from megatron.parallel.mappings import scatter_seq
from megatron.parallel.state import ParallelState


class Embedding(nn.Module):
    """Sum of word, learned position and optional token-type embeddings, then dropout.

    The word table is split by vocabulary across TP ranks (and reused as the LM head); position
    and token-type tables are small and replicated, and the output is replicated, so its dropout
    draws from the shared generator and matches across TP ranks. With ``sequence_parallel`` the
    sum is scattered along the sequence before the dropout, which keeps this rank's slice of the
    same mask: the output is this rank's [b, s / tp, h].
    """

    def __init__(
        self,
        cfg,
        vocab_size: int,
        padded_vocab_size: int,
        state: ParallelState,
        num_tokentypes: int = 0,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.seq_group = sp.sequence_group(state, sequence_parallel)
        init = normal_init(cfg.init_method_std)
        self.word = VocabParallelEmbedding(
            vocab_size, padded_vocab_size, cfg.hidden_size, state, init
        )
        self.position = nn.Embedding(
            cfg.max_position_embeddings, cfg.hidden_size, device=state.device
        )
        init(self.position.weight.data)
        self.tokentype = None
        if num_tokentypes:
            self.tokentype = nn.Embedding(num_tokentypes, cfg.hidden_size, device=state.device)
            init(self.tokentype.weight.data)
        self.dropout = cfg.hidden_dropout

    def forward(
        self, ids: Tensor, position_ids: Tensor | None = None, tokentype_ids: Tensor | None = None
    ) -> Tensor:
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # [1, s]
        h = self.word(ids) + self.position(position_ids)  # [b, s, h]
        if self.tokentype is not None:
            h = h + self.tokentype(tokentype_ids)
        h = scatter_seq(h, self.seq_group)  # [b, s / tp, h] with sequence parallelism
        return sp.dropout(h, self.dropout, self.training, self.seq_group)


def stage_embedding(embedding: Embedding, state: ParallelState) -> Embedding | None:
    """The part of ``embedding`` this pipeline stage keeps: all of it on the first stage; on the
    last (another stage) only the word table, the tied LM head's copy; nothing in between.

    Both copies are drawn alike (every stage builds the embedding first), so they start equal;
    they carry ``pipeline_tied`` so that their gradients are summed over
    ``state.embedding_group`` and the gradient norm counts them once (on the first stage).
    """
    if state.pp_size > 1 and (state.is_first_stage or state.is_last_stage):
        embedding.word.weight.pipeline_tied = True
    if state.is_first_stage:
        return embedding
    if not state.is_last_stage:
        return None
    embedding.position = embedding.tokentype = None
    return embedding
