"""GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``, encoded by ``tiktoken``.

The files are turned into tiktoken's mergeable ranks offline (no download). On these machines
tiktoken is several times faster than HF ``tokenizers`` with identical ids (tests check them).
"""

from __future__ import annotations

import json

import numpy as np

from megatron.data.tokenizers.base import Tokenizer, require_file
from megatron.errors import ConfigError

# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, other symbols, whitespace.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character, in GPT-2's id order.

    ``vocab.json`` and ``merges.txt`` spell tokens with these characters: printable Latin-1 bytes
    stand for themselves; the 68 others (controls, space, ...) map to code points from 256 up.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``; ``<|endoftext|>`` is EOD.

    Encoding runs on tiktoken, whose BPE merges by the rank of the merged bytes. When the ids of
    merge results grow with merge order (true of GPT-2's and of HF-trained files) the ids are the
    ranks; otherwise ranks follow merge order and a lookup table maps them back to ids.
    """

    def __init__(self, vocab_file: str, merges_file: str, num_threads: int = 1) -> None:
        import tiktoken

        vocab = _load_gpt2_vocab(vocab_file)
        merges = _load_gpt2_merges(merges_file, vocab, vocab_file)
        if GPT2_EOD not in vocab:
            raise ConfigError(
                f"tokenizer.vocab_file={vocab_file}: no {GPT2_EOD} token, which GPT-2 BPE uses "
                "as end of document; add it to vocab.json"
            )
        byte_char = bytes_to_unicode()
        char_byte = {c: b for b, c in byte_char.items()}
        missing = [b for b, c in byte_char.items() if c not in vocab]
        if missing:
            raise ConfigError(
                f"tokenizer.vocab_file={vocab_file}: {len(missing)} of the 256 single-byte tokens "
                f"are missing (first: byte {missing[0]}); byte-level BPE needs all of them"
            )

        def to_bytes(token: str) -> bytes:
            return bytes(char_byte[c] for c in token)

        # The first merge producing a token fixes its priority, as in GPT-2's own files.
        merged: dict[bytes, int] = {}
        for a, b in merges:
            merged.setdefault(to_bytes(a + b), vocab[a + b])
        merged_ids = np.fromiter(merged.values(), dtype=np.int64, count=len(merged))
        single = {bytes([b]): vocab[c] for b, c in byte_char.items()}
        self.num_threads = num_threads
        self.files = (vocab_file, merges_file)
        self.vocab_size = max(vocab.values()) + 1
        self.eod = vocab[GPT2_EOD]
        self._rank_to_id: np.ndarray | None = None
        if np.all(np.diff(merged_ids) > 0):
            ranks = {**single, **merged}
            special = {GPT2_EOD: self.eod}
        else:
            # Ranks 0-255 are the bytes, 256+i the i-th merge, then EOD; ids come back by lookup.
            ranks = {bytes([b]): b for b in range(256)}
            ranks.update((tok, 256 + i) for i, tok in enumerate(merged))
            special = {GPT2_EOD: 256 + len(merged)}
            rank_ids = [single[bytes([b])] for b in range(256)] + [*merged.values(), self.eod]
            self._rank_to_id = np.array(rank_ids, dtype=np.int64)
        self._enc = tiktoken.Encoding(
            f"gpt2-bpe-{self.vocab_size}",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=special,
        )
        # Tokens that are not byte strings (EOD, added tokens) decode to their own text.
        self._id_bytes = [b""] * self.vocab_size
        for token, i in vocab.items():
            spelled = all(c in char_byte for c in token) and token != GPT2_EOD
            self._id_bytes[i] = to_bytes(token) if spelled else token.encode("utf-8")

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; a literal ``<|endoftext|>`` in it is ordinary text, as in Megatron."""
        if self._rank_to_id is None:
            return self._enc.encode_ordinary(text)
        return self.encode_np(text).tolist()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode on ``num_threads`` threads (tiktoken releases the GIL)."""
        if self.num_threads <= 1 or self._rank_to_id is not None:
            return [self.encode(t) for t in texts]
        return self._enc.encode_ordinary_batch(texts, num_threads=self.num_threads)

    def encode_np(self, text: str) -> np.ndarray:
        """Ids as a uint32 array straight from tiktoken's buffer (int64 if remapped)."""
        ranks = self._enc.encode_to_numpy(text, disallowed_special=())
        return ranks if self._rank_to_id is None else self._rank_to_id[ranks]

    def encode_packed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """tiktoken's buffers concatenated; one thread (encode_ordinary_batch's thread pool costs
        more per text than it saves on short documents, and workers already use the cores)."""
        arrays = [self._enc.encode_to_numpy(t, disallowed_special=()) for t in texts]
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        ranks = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint32)
        return (ranks if self._rank_to_id is None else self._rank_to_id[ranks]), lengths

    def decode(self, ids: list[int]) -> str:
        """Concatenate the tokens' bytes; invalid UTF-8 (a cut character) becomes U+FFFD."""
        return b"".join(self._id_bytes[i] for i in ids).decode("utf-8", errors="replace")


def _load_gpt2_vocab(path: str | None) -> dict[str, int]:
    path = require_file("tokenizer.vocab_file", path, "the GPT-2 vocab.json")
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"tokenizer.vocab_file={path}: not a JSON vocabulary ({e}); give GPT-2's vocab.json"
        ) from None
    if not isinstance(vocab, dict) or not all(
        isinstance(i, int) and i >= 0 for i in vocab.values()
    ):
        raise ConfigError(
            f"tokenizer.vocab_file={path}: expected a JSON object of token -> id (ints >= 0); "
            "give GPT-2's vocab.json"
        )
    if len(set(vocab.values())) != len(vocab):
        raise ConfigError(
            f"tokenizer.vocab_file={path}: two tokens share an id; ids must be unique"
        )
    return vocab


def _load_gpt2_merges(path: str | None, vocab: dict[str, int], vocab_file: str) -> list:
    path = require_file("tokenizer.merges_file", path, "the GPT-2 merges.txt")
    with open(path, "rb") as f:
        data = f.read()
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"tokenizer.merges_file={path}: not UTF-8 text (byte {e.start}); give GPT-2's "
            "merges.txt"
        ) from None
    merges = []
    for lineno, line in enumerate(lines, 1):
        if (lineno == 1 and line.startswith("#version")) or not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(
                f"tokenizer.merges_file={path}:{lineno}: expected two tokens per line, got "
                f"{len(parts)}; give GPT-2's merges.txt"
            )
        for token in (*parts, parts[0] + parts[1]):
            if token not in vocab:
                raise ConfigError(
                    f"tokenizer.merges_file={path}:{lineno}: token {token!r} is not in "
                    f"{vocab_file}; the vocab and merges files do not belong together"
                )
        merges.append((parts[0], parts[1]))
    return merges
