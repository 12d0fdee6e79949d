"""Input embeddings shared by GPT and BERT: word (vocab-parallel) + position (+ token type)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.parallel.layers import VocabParallelEmbedding, normal_init
from megatron.parallel.state import ParallelState


class Embedding(nn.Module):
    """Sum of word, learned position and optional token-type embeddings, then dropout.

    The word table is split by vocabulary across TP ranks (and reused as the LM head); position
    and token-type tables are small and replicated, and the output is replicated, so its dropout
    draws from the shared generator and matches across TP ranks.
    """

    def __init__(
        self,
        cfg,
        vocab_size: int,
        padded_vocab_size: int,
        state: ParallelState,
        num_tokentypes: int = 0,
    ):
        super().__init__()
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
        return F.dropout(h, self.dropout, self.training)
