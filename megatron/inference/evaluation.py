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
and masked out of the sums. Losses are summed in float64 and all-reduced over the DP group, so
the totals do not depend on the TP or DP size beyond fp32 rounding of each token's loss.
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

    ``model(tokens, labels=labels)`` returns the per-token fp32 losses of the vocab-parallel
    cross entropy, exact across TP without gathering the logits.
    """
    stream = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    # [loss sum, targets scored], accumulated on the device so batches run without host syncs
    totals = torch.zeros(2, dtype=torch.float64, device=state.device)
    for chunk in micro_batches(dp_share(len(windows), state), micro_batch_size):
        batch = [windows[k] for k in chunk]
        width = max(w.length for w in batch)
        inputs = torch.zeros(len(batch), width, dtype=torch.int64)  # [b, s]
        labels = torch.zeros_like(inputs)
        scored = torch.zeros(len(batch), width, dtype=torch.bool)
        for row, w in enumerate(batch):
            inputs[row, : w.length] = stream[w.start : w.start + w.length]
            labels[row, : w.length] = stream[w.start + 1 : w.start + w.length + 1]
            scored[row, w.first_scored : w.length] = True
        losses = model(inputs.to(state.device), labels=labels.to(state.device))  # [b, s] fp32
        scored = scored.to(state.device)
        totals[0] += losses.double()[scored].sum()
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
    Only the target positions' logits are gathered over TP.
    """
    device = state.device
    # [examples right, target tokens, their loss sum], on the device until the end
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for chunk in micro_batches(dp_share(len(examples), state), micro_batch_size):
        rows = [(examples[i][0] + examples[i][1])[-(seq_length + 1) :] for i in chunk]
        width = max(len(r) for r in rows) - 1
        inputs = torch.zeros(len(rows), width, dtype=torch.int64)  # [b, s]
        row_of, col_of, targets = [], [], []
        for row, (ids, i) in enumerate(zip(rows, chunk)):
            inputs[row, : len(ids) - 1] = torch.tensor(ids[:-1])
            n = len(examples[i][1])
            row_of += [row] * n
            col_of += range(len(ids) - 1 - n, len(ids) - 1)  # positions predicting the target
            targets += examples[i][1]
        row_of = torch.tensor(row_of, device=device)
        logits = model(inputs.to(device))  # [b, s, padded_vocab / tp]
        picked = logits[row_of, torch.tensor(col_of, device=device)]  # [targets, v / tp]
        full = gather_from_tp(picked, state.tp_group)[:, :vocab_size].double()  # [targets, v]
        target_ids = torch.tensor(targets, device=device)
        misses = torch.zeros(len(rows), dtype=torch.int64, device=device)
        misses.index_add_(0, row_of, full.argmax(-1).ne(target_ids).long())
        totals[0] += misses.eq(0).sum()
        totals[1] += len(targets)
        totals[2] += F.cross_entropy(full, target_ids, reduction="sum")
    correct, target_tokens, loss_sum = dp_sum(totals, state)
    return LastWordTotal(len(examples), int(correct), LossTotal(loss_sum, int(target_tokens)))
