"""Picking the next token from the last position's logits: greedy, or temperature, top-k and
top-p (nucleus) sampling, always in fp32."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.errors import ConfigError
from megatron.parallel.mappings import gather_from_tp


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``greedy`` takes the argmax and ignores the rest;
    otherwise logits are divided by ``temperature``, cut to the ``top_k`` largest (0: no cut)
    and to the smallest set whose probability reaches ``top_p`` (1.0: no cut), then sampled."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.temperature < math.inf:  # nan fails both comparisons
            raise ConfigError(
                f"--temperature {self.temperature}: must be a finite number > 0; leave the "
                "sampling flags out for greedy decoding"
            )
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k}: must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p}: must be in (0, 1] (1 keeps every token)")


def full_vocab_logits(
    logits: Tensor, vocab_size: int, tp_group: dist.ProcessGroup | None
) -> Tensor:
    """Vocab-parallel logits [b, padded_vocab / tp] -> fp32 [b, vocab_size] on every TP rank;
    the padded columns, which no real token owns, are dropped."""
    return gather_from_tp(logits, tp_group)[:, :vocab_size].float()


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, top-k and top-p applied to fp32 [b, V] logits; cut tokens get -inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        # Keep exactly k per row (a threshold test would keep every tie of the k-th value).
        top = logits.topk(params.top_k, dim=-1)
        logits = torch.full_like(logits, -torch.inf).scatter_(-1, top.indices, top.values)
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Cut a token when the tokens ranked above it already reach top_p: the top one stays.
        cut = probs.cumsum(dim=-1) - probs >= params.top_p
        sorted_logits.masked_fill_(cut, -torch.inf)
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def choose_tokens(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None
) -> Tensor:
    """The next token of each row of fp32 [b, V] logits, int64 [b]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
