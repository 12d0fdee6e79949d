"""Megatron's ``NullTokenizer``: text that already is token ids, separated by single spaces.

For benchmarks and for corpora tokenized elsewhere. As in megatron-core (0.16.1), ``--vocab-size
N`` gives N + 1 ids: 0..N-1 for the data and N for EOD (unless ``eod_id`` names another).
"""

from __future__ import annotations

import numpy as np

from megatron.data.tokenizers.base import Tokenizer, flagged
from megatron.errors import ConfigError


class NullTokenizer(Tokenizer):
    """``"17 4 9"`` -> ``[17, 4, 9]``; each id must lie in ``[0, vocab_size)``."""

    def __init__(self, vocab_size: int | None, eod_id: int | None = None, pad_id: int = -1):
        if vocab_size is None or vocab_size < 1:
            raise ConfigError(
                f"{flagged('tokenizer.vocab_size')}={vocab_size}: NullTokenizer needs the number "
                "of ids in the data (a positive integer); set it"
            )
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size if eod_id is None else eod_id
        if not 0 <= self.eod < self.vocab_size:
            raise ConfigError(
                f"--null-tokenizer-eod-id {eod_id} is outside [0, {self.vocab_size}); pick an id "
                "in the vocabulary"
            )
        self.pad = pad_id if pad_id >= 0 else None
        self.options = {} if eod_id is None else {"eod_id": eod_id}

    def bad_text(self, text: str) -> str | None:
        """Why ``text`` is not single-space separated integer ids in range, or None."""
        for word in text.split(" "):
            try:
                i = int(word)  # int() as Megatron parses them: surrounding whitespace allowed
            except ValueError:
                return f"not an integer id: {word[:20]!r} (NullTokenizer reads ids split by spaces)"
            if not 0 <= i < self.vocab_size:
                return f"id {i} is outside [0, {self.vocab_size}) (--vocab-size)"
        return None

    def encode(self, text: str) -> list[int]:
        """The ids written in ``text``."""
        return [int(word) for word in text.split(" ")]

    def encode_np(self, text: str) -> np.ndarray:
        """The ids as an int64 array."""
        return np.array(self.encode(text), dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        """The ids written out, separated by spaces."""
        return " ".join(map(str, ids))
