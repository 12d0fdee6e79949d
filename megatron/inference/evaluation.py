"""Scoring a GPT on evaluation data: sliding-window loss over a token stream and greedy last-word
accuracy, split over the DP ranks and summed exactly.

Sliding windows, ``seq_length`` L and ``stride`` S (1 <= S <= L), over tokens t_0 .. t_{N-1}:
window k reads inputs t[kS, kS+L) and predicts targets t[kS+1, kS+L], cut at t_{N-1}. Each target
is scored once, by the first window that holds it, so a window scores only the targets beyond its
predecessor's (the later ones see the most context); the last window is the first whose targets
reach t_{N-1}. L=4, S=2, N=9::

    k=0  inputs 0 1 2 3   targets 1 2 3 4   scores 1 2 3 4
    k=1  inputs 2 3 4 5   targets 3 4 5 6   scores     5 6
    k=2  inputs 4 5 6 7   targets 5 6 7 8   scores     7 8    (reaches t_8: the last)

Windows (and LAMBADA examples) go to the DP ranks round-robin; each rank runs its share in
micro-batches, padded on the right (causal attention: padding never reaches a real position)
and masked out of the sums; only the positions scored go through the LM head and the loss.
Losses are summed in float64 and all-reduced over the DP group, so the totals do not depend on
the TP or DP size beyond fp32 rounding of each token's loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.parallel.mappings import gather_from_tp
from megatron.parallel.state import ParallelState


@dataclass(frozen=True)
class Window:
    """One window: inputs ``tokens[start : start + length]``, targets one position later; the
    targets at offsets ``[first_scored, length)`` are the ones it scores."""

    start: int
    length: int
    first_scored: int


class SlidingWindows(Sequence[Window]):
    """The windows over ``num_tokens`` tokens (see the module docstring), computed on demand."""

    def __init__(self, num_tokens: int, seq_length: int, stride: int) -> None:
        if not 1 <= stride <= seq_length:
            # a stride past the window would leave the targets between windows unscored
            raise ValueError(f"stride {stride} must be 1 to seq_length {seq_length}")
        self.num_tokens, self.seq_length, self.stride = num_tokens, seq_length, stride
        last_target = num_tokens - 1
        # the last window is the first k with kS + L >= N - 1
        self._count = 0 if last_target < 1 else -(-max(0, last_target - seq_length) // stride) + 1

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, k: int) -> Window:
        if not 0 <= k < self._count:
            raise IndexError(f"window {k} of {self._count}")
        start = k * self.stride
        end = min(start + self.seq_length, self.num_tokens - 1)  # last target held
        # window k-1 is not the last, so it holds full length: targets up to (k-1)S + L
        scored_before = 0 if k == 0 else start - self.stride + self.seq_length
        return Window(start, end - start, scored_before - start)


@dataclass(frozen=True)
class LossTotal:
    """Summed loss over the targets scored (float64, every DP rank's share)."""

    loss_sum: float
    tokens: int

    @property
    def loss(self) -> float:
        """Mean loss per target token."""
        return self.loss_sum / self.tokens

    @property
    def ppl(self) -> float:
        """Perplexity: exp of the mean loss (not capped)."""
        return math.exp(self.loss)

    def ppl_per(self, units: int) -> float:
        """exp(total loss / ``units``): perplexity per word of the original text, for one."""
        return math.exp(self.loss_sum / units)


@dataclass(frozen=True)
class LastWordTotal:
    """LAMBADA counts, and the loss over the last words' tokens."""

    n: int
    correct: int
    target: LossTotal

    @property
    def accuracy(self) -> float:
        """Share of examples whose every last-word token is the greedy prediction."""
        return self.correct / self.n


def dp_share(count: int, state: ParallelState) -> range:
    """This DP rank's items of ``count``, round-robin (the TP ranks of a DP rank share them)."""
    return range(state.dp_rank, count, state.dp_size)


def dp_sum(totals: Tensor, state: ParallelState) -> list[float]:
    """This rank's float64 ``totals`` summed over the DP group (in place), as Python floats."""
    if state.dp_size > 1:
        dist.all_reduce(totals, group=state.dp_group)
    return totals.tolist()  # the one host sync of a scoring pass


def micro_batches(items: range, size: int) -> Iterator[range]:
    """``items`` in consecutive chunks of up to ``size``."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


@torch.no_grad()
def score_windows(
    model: nn.Module,
    tokens: np.ndarray,
    windows: SlidingWindows,
    state: ParallelState,
    micro_batch_size: int,
) -> LossTotal:
    """Sum of the per-target losses of every window (each target once), over all DP ranks.

    ``model(tokens, labels=labels, positions=positions)`` returns the per-token fp32 losses of
    the vocab-parallel cross entropy (exact across TP without gathering the logits) at the
    scored positions only: the LM head and the loss skip the targets a window leaves to its
    predecessor.
    """
    stream = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    # [loss sum, targets scored], accumulated on the device so batches run without host syncs
    totals = torch.zeros(2, dtype=torch.float64, device=state.device)
    for chunk in micro_batches(dp_share(len(windows), state), micro_batch_size):
        batch = [windows[k] for k in chunk]
        width = max(w.length for w in batch)
        picked = max(w.length - w.first_scored for w in batch)
        inputs = torch.zeros(len(batch), width, dtype=torch.int64)  # [b, s]
        labels = torch.zeros_like(inputs)
        # A row scoring fewer than ``picked`` targets (the first window's neighbours, a short
        # last window) repeats its position 0, a real one, masked out of the sum.
        positions = torch.zeros(len(batch), picked, dtype=torch.int64)  # [b, p]
        scored = torch.zeros(len(batch), picked, dtype=torch.bool)
        for row, w in enumerate(batch):
            inputs[row, : w.length] = stream[w.start : w.start + w.length]
            labels[row, : w.length] = stream[w.start + 1 : w.start + w.length + 1]
            positions[row, : w.length - w.first_scored] = torch.arange(w.first_scored, w.length)
            scored[row, : w.length - w.first_scored] = True
        losses = model(
            inputs.to(state.device),
            labels=labels.to(state.device),
            positions=positions.to(state.device),
        )  # [b, p] fp32
        scored = scored.to(state.device)
        totals[0] += torch.where(scored, losses.double(), 0.0).sum()
        totals[1] += scored.sum()
    loss_sum, count = dp_sum(totals, state)
    return LossTotal(loss_sum, int(count))


@torch.no_grad()
def score_last_words(
    model: nn.Module,
    examples: list[tuple[list[int], list[int]]],
    state: ParallelState,
    micro_batch_size: int,
    seq_length: int,
    vocab_size: int,
) -> LastWordTotal:
    """Greedy last-word accuracy (LAMBADA, strict) over ``examples`` of (context, target) ids.

    An example reads ``context + target[:-1]`` (its last ``seq_length`` tokens when longer) and
    is correct when the argmax over the real vocabulary is the target at every target position.
    Only the target positions go through the LM head, and only their logits are gathered over
    TP.
    """
    device = state.device
    # [examples right, target tokens, their loss sum], on the device until the end
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for chunk in micro_batches(dp_share(len(examples), state), micro_batch_size):
        rows = [(examples[i][0] + examples[i][1])[-(seq_length + 1) :] for i in chunk]
        width = max(len(r) for r in rows) - 1
        inputs = torch.zeros(len(rows), width, dtype=torch.int64)  # [b, s]
        picked = max(len(examples[i][1]) for i in chunk)
        # [b, p]: the positions predicting each target; a shorter target repeats position 0
        positions = torch.zeros(len(rows), picked, dtype=torch.int64)
        row_of, flat, targets = [], [], []  # per target token: its row, its index in [b * p]
        for row, (ids, i) in enumerate(zip(rows, chunk)):
            inputs[row, : len(ids) - 1] = torch.tensor(ids[:-1])
            n = len(examples[i][1])
            positions[row, :n] = torch.arange(len(ids) - 1 - n, len(ids) - 1)
            row_of += [row] * n
            flat += range(row * picked, row * picked + n)
            targets += examples[i][1]
        row_of = torch.tensor(row_of, device=device)
        logits = model(inputs.to(device), positions=positions.to(device))  # [b, p, v / tp]
        picked_logits = logits.flatten(0, 1).index_select(0, torch.tensor(flat, device=device))
        full = gather_from_tp(picked_logits, state.tp_group)[:, :vocab_size].double()  # [t, v]
        target_ids = torch.tensor(targets, device=device)
        misses = torch.zeros(len(rows), dtype=torch.int64, device=device)
        misses.index_add_(0, row_of, full.argmax(-1).ne(target_ids).long())
        totals[0] += misses.eq(0).sum()
        totals[1] += len(targets)
        totals[2] += F.cross_entropy(full, target_ids, reduction="sum")
    correct, target_tokens, loss_sum = dp_sum(totals, state)
    return LastWordTotal(len(examples), int(correct), LossTotal(loss_sum, int(target_tokens)))
