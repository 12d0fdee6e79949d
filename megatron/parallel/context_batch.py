"""Each context-parallel rank's share of a batch.

Every rank of a CP ring loads the same samples (the ring shares one DP index) and keeps its two
chunks of each sequence (``megatron.parallel.context_parallel``'s layout): tokens, labels, loss
mask, token types and position ids are cut alike, so positions stay global and RoPE and learned
position embeddings see the true ones. Document ids (and BERT's padding mask) stay whole: ring
attention reads the ids of any block's keys from them by global position, so nothing about the
mask travels.

The losses are the rank's share of the sample's sums, divided by the sample's whole count: the
batch carries ``loss_tokens`` (the loss mask's sum before the cut), so the ranks' means add up to
the sample's mean without a collective. BERT's masked positions index the whole sequence: each
rank keeps those it holds, renumbered into its local sequence, and -1 for the rest (the model
skips them); its sentence head reads the first token, which only ring rank 0 holds
(``holds_first_token``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron.parallel.context_parallel import held_positions, split_sequence
from megatron.parallel.state import ParallelState

Batch = dict[str, Tensor]

# The [b, s] per-token values cut along the sequence.
_GPT_SEQUENCE = ("tokens", "labels", "loss_mask", "position_ids")
_BERT_SEQUENCE = ("text", "types", "labels", "loss_mask")


def loss_counts(batch: Batch) -> Batch:
    """``batch`` with ``loss_tokens``, its loss mask's sum: what its token loss is divided by."""
    return {**batch, "loss_tokens": batch["loss_mask"].sum()}


def split_batch(batch: Batch, state: ParallelState, model_type: str) -> Batch:
    """This rank's share of ``batch`` (one micro-batch, on the device), with ``loss_tokens``
    counted over the whole samples; ``batch`` itself when there is no context parallelism."""
    batch = loss_counts(batch)
    if state.cp_size == 1:
        return batch
    index, size = state.cp_rank, state.cp_size
    cut = _BERT_SEQUENCE if model_type == "bert" else _GPT_SEQUENCE
    out = {k: split_sequence(v, 1, index, size) if k in cut else v for k, v in batch.items()}
    if model_type == "bert":
        out["masked_positions"] = _local_masked_positions(batch, index, size)
        # torch.full passes the value as a kernel argument: no host-to-device copy to wait for
        out["holds_first_token"] = torch.full((), float(index == 0), device=batch["text"].device)
    return out


def _local_masked_positions(batch: Batch, index: int, size: int) -> Tensor:
    """BERT's masked positions [b, p] as indices into this rank's sequence; -1 where another
    rank holds the position."""
    positions, seq = batch["masked_positions"], batch["text"].shape[1]
    local_of = torch.full((seq,), -1, dtype=positions.dtype, device=positions.device)
    held = held_positions(seq, index, size, positions.device)
    local_of[held] = torch.arange(held.numel(), dtype=positions.dtype, device=positions.device)
    return local_of[positions]
