"""The seeds of a run: initial parameter values, and dropout identical where activations are
replicated and distinct where split.

Initial values come from one generator per part of the model (``init_generator``): a transformer
layer's stream is seeded from the run's seed and the layer's global index, and the embeddings and
heads have fixed indices of their own. A part therefore draws the same values on every rank that
holds it, and a rank draws only the parts it holds (a pipeline stage its own layers; a TP rank
draws each whole matrix and keeps its slice).

The device's default generator is seeded identically on every TP rank: it drives dropout on
replicated activations (embeddings, after row-parallel layers). A tracked second state, seeded
per TP rank, drives dropout on split activations (attention probabilities of this rank's heads);
``fork()`` swaps it in.
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

# Initialisation streams of the parts outside the transformer layers, whose streams are their
# global indices 0, 1, ...: fixed, and past any layer count.
WORD_EMBEDDING, POSITION_EMBEDDING, TOKENTYPE_EMBEDDING, LM_HEAD, POOLER, BINARY_HEAD = range(
    2**32, 2**32 + 6
)
OUTPUT_LAYER = 2**32 + 6  # GPT's untied LM head


def default_generator(device: torch.device) -> torch.Generator:
    """The generator that ops on ``device`` draw from when given none."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


class RNGTracker:
    """Owns the per-TP-rank dropout state and switches the device generator to it on demand;
    hands out the initialisation streams."""

    def __init__(self, device: torch.device):
        self.device = device
        self.generator = default_generator(device)
        self.tp_state: Tensor | None = None
        self.init_seed: int | None = None
        # True while activation recomputation replays a forward (what a forward records once,
        # such as routing statistics, is not recorded again).
        self.recomputing = False

    def seed(self, seed: int, tp_rank: int) -> None:
        """Seed python, numpy and the shared generator with ``seed``; the TP state per rank; and
        the initialisation streams (``init_generator``)."""
        self.init_seed = seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        saved = self.generator.get_state()
        self.generator.manual_seed(seed + TP_SEED_OFFSET + tp_rank)
        self.tp_state = self.generator.get_state()
        self.generator.set_state(saved)

    def init_generator(self, index: int) -> torch.Generator:
        """A fresh generator for the initial values of model part ``index`` (a transformer
        layer's global index, or one of the fixed indices above), seeded from the run's seed and
        ``index`` alone: the part draws the same values whatever else this rank builds."""
        if self.init_seed is None:
            raise RuntimeError("RNGTracker.seed() must run before init_generator()")
        # SeedSequence mixes (seed, index) into 64 unrelated bits, where seed + index would give
        # seed 0's layer 1 the stream of seed 1's layer 0.
        (mixed,) = np.random.SeedSequence([self.init_seed, index]).generate_state(1, np.uint64)
        # Shape-only (meta) tensors accept any generator, and there is no meta generator.
        device = torch.device("cpu") if self.device.type == "meta" else self.device
        return torch.Generator(device=device).manual_seed(int(mixed))

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
            self.recomputing = True
            try:
                yield
            finally:
                self.tp_state = current
                self.recomputing = False

        return at_forward(), at_recompute()
