"""Batched autoregressive generation with the KV cache through the tensor-parallel model.

Prompts of different lengths share one batch without padding inside attention: every sequence
uses positions 0, 1, ...; the shortest prompt length is prefilled in one forward pass, then the
whole batch advances one position per forward pass. At a position that still lies inside a
longer prompt, that sequence takes its prompt token (teacher forcing) instead of the sample, so
each sequence sees exactly what it would see alone. The prefix is never recomputed.

A sequence stops at end of document (``eod``, which is not returned), after ``max_new_tokens``,
or when prompt plus generation fill the position table (Megatron's rule: a sequence never holds
more than ``max_position_embeddings`` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.errors import ConfigError
from megatron.inference.sampling import SamplingParams, choose_tokens, full_vocab_logits
from megatron.models.gpt import GPTModel

GREEDY = SamplingParams()


@dataclass
class Generation:
    """One sequence's continuation: the generated ids (prompt and eod excluded), why it stopped
    ("eod", "max_new_tokens" or "max_positions"), and, when asked for, the fp32 logits
    [len(tokens), vocab_size] each token was chosen from."""

    tokens: list[int]
    stop: str
    logits: Tensor | None = None


def check_prompts(prompts: list[list[int]], max_positions: int) -> None:
    """Every prompt is non-empty and leaves room for at least one new token."""
    for i, prompt in enumerate(prompts, 1):
        if not prompt:
            raise ConfigError(f"prompt {i} of {len(prompts)}: no tokens; give a non-empty one")
        if len(prompt) >= max_positions:
            raise ConfigError(
                f"prompt {i} of {len(prompts)}: {len(prompt)} tokens, but the model's position "
                f"table holds {max_positions} (model.max_position_embeddings), leaving no room to "
                f"generate; shorten it to at most {max_positions - 1} tokens"
            )


def _pick(
    logits: Tensor, model: GPTModel, params: SamplingParams, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """(full fp32 logits [b, vocab], chosen tokens [b]) from the last position's vocab-parallel
    logits [b, padded_vocab / tp]; identical on every TP rank."""
    full = full_vocab_logits(logits, model.vocab_size, model.tp_group)
    tokens = choose_tokens(full, params, generator)
    if model.tp_group is not None and dist.get_world_size(model.tp_group) > 1:
        # The gathered logits and the generators agree across TP ranks in exact arithmetic;
        # taking TP rank 0's choice keeps their KV caches identical even where a backend's
        # reductions round differently on different ranks.
        dist.broadcast(tokens, group=model.tp_group, group_src=0)
    return full, tokens


@torch.inference_mode()
def generate(
    model: GPTModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    eod: int,
    params: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
    stop_at_eod: bool = True,
    return_logits: bool = False,
) -> list[Generation]:
    """Continue each of ``prompts`` (token ids) by up to ``max_new_tokens`` tokens.

    Collective: every TP rank calls it with the same prompts and arguments, and a ``generator``
    seeded alike. ``stop_at_eod=False`` keeps going through end-of-document tokens (benchmarks,
    comparisons with a reference that ignores them). One host sync per step (the stop check).
    """
    max_positions = model.max_positions
    check_prompts(prompts, max_positions)
    if not prompts:
        return []
    device = model.embedding.word.weight.device
    batch = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # [b]
    # Position (exclusive) where each sequence ends unless it meets eod first.
    limits = (lengths + max_new_tokens).clamp(max=max_positions)  # [b]
    total = int(limits.max())
    # A finished sequence's slots keep this filler: it is fed on, but never read back.
    buf = torch.zeros((batch, total), dtype=torch.long)  # [b, total]
    for i, prompt in enumerate(prompts):
        buf[i, : len(prompt)] = torch.tensor(prompt)
    buf = buf.to(device)
    ends = limits.clone()  # [b]; an eod moves a sequence's end to it
    done = limits <= lengths  # [b]; max_new_tokens=0 generates nothing
    cache = model.new_kv_cache(batch, total)
    start = int(lengths.min())
    logits = model(buf[:, :start], kv_cache=cache)[:, -1]  # [b, padded_vocab / tp]
    kept: list[Tensor] = []
    for pos in range(start, total):
        if bool(done.all()):  # the step's one host sync: has every sequence stopped?
            break
        full, chosen = _pick(logits, model, params, generator)
        if return_logits:
            kept.append(full)
        forced = pos < lengths  # [b], still inside its prompt
        active = ~forced & ~done
        buf[:, pos] = torch.where(active, chosen, buf[:, pos])
        if stop_at_eod:
            hit = active & (chosen == eod)
            ends = torch.where(hit, pos, ends)
            done |= hit
        done |= pos + 1 >= limits
        if pos + 1 < total:
            logits = model(buf[:, pos : pos + 1], kv_cache=cache)[:, -1]
    return _results(prompts, buf, ends, limits, max_new_tokens, start, kept)


def _results(
    prompts: list[list[int]],
    buf: Tensor,
    ends: Tensor,
    limits: Tensor,
    max_new_tokens: int,
    start: int,
    kept: list[Tensor],
) -> list[Generation]:
    """Each sequence's slice of the token buffer, with its stop reason and logits."""
    steps = torch.stack(kept, dim=1) if kept else None  # [b, steps, vocab], step 0 at ``start``
    out = []
    for i, (prompt, end, limit) in enumerate(zip(prompts, ends.tolist(), limits.tolist())):
        if end < limit:
            stop = "eod"
        elif limit - len(prompt) == max_new_tokens:
            stop = "max_new_tokens"
        else:
            stop = "max_positions"
        logits = None if steps is None else steps[i, len(prompt) - start : end - start]
        out.append(Generation(buf[i, len(prompt) : end].tolist(), stop, logits))
    return out
