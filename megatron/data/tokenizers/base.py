"""The interface every tokenizer implements, and the file checks the implementations share.

Its own module so that each implementation (``gpt2_bpe``, ``sentencepiece``, ``tiktoken``,
``null``, ``wordpiece``, ``hf``) can import it while ``factory.build_tokenizer`` imports
them all.
"""

from __future__ import annotations

import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from megatron.errors import ConfigError

# Command-line flags of tools/preprocess_data.py, named next to the config key in errors.
_FLAGS = {
    "tokenizer.type": "--tokenizer-type",
    "tokenizer.model": "--tokenizer-model",
    "tokenizer.vocab_file": "--vocab-file",
    "tokenizer.merges_file": "--merge-file",
    "tokenizer.lower_case": "--lower-case",
    "tokenizer.vocab_size": "--vocab-size",
    "tokenizer.vocab_extra_ids": "--vocab-extra-ids",
    "tokenizer.special_tokens": "--tokenizer-special-tokens",
    "tokenizer.sentencepiece_legacy": "--tokenizer-sentencepiece-legacy",
    "tokenizer.tiktoken_pattern": "--tiktoken-pattern",
    "tokenizer.tiktoken_num_special_tokens": "--tiktoken-num-special-tokens",
}


def flagged(key: str) -> str:
    """A config key with its preprocess_data.py flag: ``tokenizer.model (--tokenizer-model)``."""
    return f"{key} ({_FLAGS[key]})"


def require_file(key: str, path: str | None, what: str) -> str:
    """``path`` if it names an existing file, else a ConfigError naming the key and the fix."""
    if not path:
        raise ConfigError(f"{flagged(key)} is not set; give {what}")
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path}: file not found; give {what} ({_FLAGS[key]})")
    return path


class Tokenizer(ABC):
    """Text to token ids and back; ``eod`` closes a document, specials are None where absent.

    ``files`` are the files it was built from (hashed into a dataset's sidecar); ``options`` the
    settings besides those files that change which id a text gets (also in the sidecar).
    """

    vocab_size: int
    eod: int
    pad: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    files: tuple[str, ...] = ()
    options: Mapping[str, object] = MappingProxyType({})  # implementations assign their own

    def bad_text(self, text: str) -> str | None:
        """Why ``text`` cannot be encoded (e.g. NullTokenizer's non-integers), or None."""
        return None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (no special tokens added)."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text; the library's batch call where it has one."""
        return [self.encode(t) for t in texts]

    def encode_np(self, text: str) -> np.ndarray:
        """``encode`` as a 1-D integer array, skipping Python ints where the library allows."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_packed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Every text's ids back to back (1-D integers) and each text's length (int64).

        One call per batch of texts: per-text Python overhead is a large share of encoding short
        documents. This default goes through ``encode_batch`` (the library's batch call).
        """
        batch = self.encode_batch(texts)
        lengths = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
        ids = itertools.chain.from_iterable(batch)
        return np.fromiter(ids, dtype=np.int64, count=int(lengths.sum())), lengths

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``."""
