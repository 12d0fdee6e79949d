"""Dropout randomness that is identical where activations are replicated and distinct where split.

The device's default generator is seeded identically on every TP rank: it drives initialisation
(every rank draws the same full matrices) and dropout on replicated activations (embeddings, after
row-parallel layers). A tracked second state, seeded per TP rank, drives dropout on split
activations (attention probabilities of this rank's heads); ``fork()`` swaps it in.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

# Offset between the shared seed and the per-TP-rank seeds, so the two streams never coincide.
TP_SEED_OFFSET = 2718


def default_generator(device: torch.device) -> torch.Generator:
    """The generator that ops on ``device`` draw from when given none."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


class RNGTracker:
    """Owns the per-TP-rank dropout state and switches the device generator to it on demand."""

    def __init__(self, device: torch.device):
        self.generator = default_generator(device)
        self.tp_state: Tensor | None = None

    def seed(self, seed: int, tp_rank: int) -> None:
        """Seed python, numpy and the shared generator with ``seed``; the TP state per rank."""
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        saved = self.generator.get_state()
        self.generator.manual_seed(seed + TP_SEED_OFFSET + tp_rank)
        self.tp_state = self.generator.get_state()
        self.generator.set_state(saved)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from the per-TP-rank state inside the block; the shared state is left untouched."""
        if self.tp_state is None:
            raise RuntimeError("RNGTracker.seed() must run before fork()")
        shared = self.generator.get_state()
        self.generator.set_state(self.tp_state)
        try:
            yield
        finally:
            self.tp_state = self.generator.get_state()
            self.generator.set_state(shared)

    def state_dict(self) -> dict[str, Tensor]:
        """Both device states (the shared one and this TP rank's), for checkpoints."""
        return {"shared": self.generator.get_state(), "tp": self.tp_state}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.generator.set_state(state["shared"])
        self.tp_state = state["tp"]

    def recompute_context(self) -> tuple[contextlib.AbstractContextManager, ...]:
        """Contexts for ``torch.utils.checkpoint``: replay the TP state during recomputation.

        torch's checkpoint restores the default generator itself; the tracked state has moved on
        by the time backward recomputes, so it is captured at forward and swapped back in.
        """
        captured: dict[str, Tensor | None] = {}

        @contextlib.contextmanager
        def at_forward() -> Iterator[None]:
            captured["tp"] = self.tp_state
            yield

        @contextlib.contextmanager
        def at_recompute() -> Iterator[None]:
            current = self.tp_state
            self.tp_state = captured["tp"]
            try:
                yield
            finally:
                self.tp_state = current

        return at_forward(), at_recompute()
