"""Megatron's ``TikTokenizer``: a tiktoken BPE from a JSON list of ranks, special tokens first.

The vocabulary file is a JSON list of ``{"rank": i, "token_bytes": base64, "token_str": ...}``
(the first 256 ranks the single bytes, in byte order). As in megatron-core (0.16.1) ids
``[0, num_special_tokens)`` are the special tokens (``<unk> <s> </s> <mask> <pad> <cls> <sep>``
or the list given, then ``<SPECIAL_i>`` fillers), rank r is id ``r + num_special_tokens``, the
file is cut to ``vocab_size - num_special_tokens`` ranks, EOD is ``</s>``, and a special token
spelled in the text encodes as its id.
"""

from __future__ import annotations

import base64
import json

import numpy as np

from megatron.data.tokenizers.base import Tokenizer, flagged, require_file
from megatron.errors import ConfigError

# megatron-core's split patterns, named by --tiktoken-pattern.
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
DEFAULT_VOCAB_SIZE = 2**17  # megatron-core's default when --vocab-size is not given
DEFAULT_NUM_SPECIAL_TOKENS = 1000


def load_ranks(path: str, count: int) -> dict[bytes, int]:
    """The first ``count`` ranks of a tiktoken vocabulary JSON, as bytes -> rank."""
    what = "a tiktoken vocabulary .json (a list of rank, token_bytes, token_str)"
    if not path.endswith(".json"):
        raise ConfigError(f"tokenizer.model={path}: TikTokenizer reads {what}; give that file")
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"tokenizer.model={path}: not valid JSON ({e}); give {what}") from None
    if not isinstance(entries, list):
        raise ConfigError(f"tokenizer.model={path}: expected a JSON list; give {what}")
    ranks = {}
    for i, entry in enumerate(entries[:count]):
        if not isinstance(entry, dict) or entry.keys() != {"rank", "token_bytes", "token_str"}:
            raise ConfigError(f"tokenizer.model={path}: entry {i} is not {what}")
        token = base64.b64decode(entry["token_bytes"])
        if entry["rank"] != i or (i < 256 and token != bytes([i])) or token in ranks:
            raise ConfigError(
                f"tokenizer.model={path}: entry {i} has rank {entry['rank']} and bytes {token!r}; "
                "ranks must count up from 0, the first 256 being the bytes 0-255, each once"
            )
        ranks[token] = i
    return ranks


class TikTokenizer(Tokenizer):
    """megatron-core's TikTokenTokenizer: special tokens first, then the file's ranks."""

    def __init__(
        self,
        model_file: str | None,
        pattern: str | None = None,
        vocab_size: int | None = None,
        num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
        special_tokens: list[str] | None = None,
        num_threads: int = 1,
    ) -> None:
        import tiktoken

        path = require_file("tokenizer.model", model_file, "a tiktoken vocabulary .json")
        pattern = pattern or "v2"
        if pattern not in PATTERNS:
            raise ConfigError(
                f"{flagged('tokenizer.tiktoken_pattern')}={pattern} is unknown; use v1 or v2"
            )
        vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
        specials = list(special_tokens or SPECIAL_TOKENS)
        missing = [t for t in SPECIAL_TOKENS if t not in specials]
        if missing or len(set(specials)) != len(specials):
            raise ConfigError(
                f"{flagged('tokenizer.special_tokens')}: TikTokenizer's special tokens must be "
                f"distinct and include {' '.join(SPECIAL_TOKENS)} (missing: {' '.join(missing)})"
            )
        if not len(specials) <= num_special_tokens < vocab_size:
            raise ConfigError(
                f"{flagged('tokenizer.tiktoken_num_special_tokens')}={num_special_tokens} must be "
                f"at least the {len(specials)} special tokens and below "
                f"{flagged('tokenizer.vocab_size')}={vocab_size}; fix either"
            )
        inner = vocab_size - num_special_tokens
        ranks = load_ranks(path, inner)
        if len(ranks) < inner:
            raise ConfigError(
                f"{flagged('tokenizer.vocab_size')}={vocab_size} needs {inner} ranks after the "
                f"{num_special_tokens} special tokens, but {path} has {len(ranks)}; set it to "
                f"{len(ranks) + num_special_tokens}"
            )
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        self._enc = tiktoken.Encoding(
            name=f"tiktoken-{vocab_size}",
            pat_str=PATTERNS[pattern],
            mergeable_ranks={t: r + num_special_tokens for t, r in ranks.items()},
            special_tokens={t: i for i, t in enumerate(specials)},
        )
        self.num_threads = num_threads
        self.vocab_size = vocab_size
        self.files = (path,)
        self.options = {
            "tiktoken_pattern": pattern,
            "tiktoken_num_special_tokens": num_special_tokens,
            "special_tokens": specials[: len(special_tokens or SPECIAL_TOKENS)],
        }
        index = {t: i for i, t in enumerate(specials)}
        self.eod = index["</s>"]
        self.pad, self.cls, self.sep = index["<pad>"], index["<cls>"], index["<sep>"]
        self.mask, self.unk, self.bos = index["<mask>"], index["<unk>"], index["<s>"]

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``; special tokens in it count, as in megatron-core."""
        return self._enc.encode(text, allowed_special="all")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """tiktoken's batch encode on ``num_threads`` threads."""
        return self._enc.encode_batch(
            texts, num_threads=max(1, self.num_threads), allowed_special="all"
        )

    def encode_np(self, text: str) -> np.ndarray:
        """Ids as a uint32 array straight from tiktoken's buffer."""
        return self._enc.encode_to_numpy(text, allowed_special="all")

    def encode_packed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """tiktoken's buffers concatenated (one thread: the workers already use the cores)."""
        arrays = [self.encode_np(t) for t in texts]
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        return (np.concatenate(arrays) if arrays else np.zeros(0, np.uint32)), lengths

    def decode(self, ids: list[int]) -> str:
        """Special tokens as their names, other ids as their bytes (cut characters: U+FFFD)."""
        return self._enc.decode(ids, errors="replace")
