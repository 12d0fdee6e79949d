"""One tokenizer interface over sentencepiece, GPT-2 byte-level BPE, BERT WordPiece and HF files.

``build_tokenizer`` takes the ``tokenizer`` config section (``type``, ``model``, ``vocab_file``,
``merges_file``, ``lower_case``) and accepts Megatron's type names as aliases, so Megatron scripts
run unchanged. Every tokenizer exposes ``vocab_size`` (before model padding), ``eod`` (the id
appended at document ends) and ``pad``/``cls``/``sep``/``mask`` where the vocabulary has them.

The GPT-2 path runs on ``tiktoken`` built offline from ``vocab.json``/``merges.txt``: on these
machines it is several times faster than HF ``tokenizers`` with identical ids (tests check them).
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod

import numpy as np

from megatron.errors import ConfigError

# Megatron's --tokenizer-type names map onto ours.
TOKENIZER_TYPES: dict[str, str] = {
    "sentencepiece": "sentencepiece",
    "gpt2": "gpt2",
    "wordpiece": "wordpiece",
    "hf": "hf",
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "GPT2BPETokenizer": "gpt2",
    "BertWordPieceLowerCase": "wordpiece",
    "BertWordPieceCase": "wordpiece",
    "HuggingFaceTokenizer": "hf",
}
# Megatron's BERT aliases carry the casing in their name.
_ALIAS_LOWER_CASE = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}
# Command-line flags of tools/preprocess_data.py, named next to the config key in errors.
_FLAGS = {
    "tokenizer.type": "--tokenizer-type",
    "tokenizer.model": "--tokenizer-model",
    "tokenizer.vocab_file": "--vocab-file",
    "tokenizer.merges_file": "--merge-file",
    "tokenizer.lower_case": "--lower-case",
}
# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, other symbols, whitespace.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"


def _key(key: str) -> str:
    return f"{key} ({_FLAGS[key]})"


def _require_file(key: str, path: str | None, what: str) -> str:
    """``path`` if it names an existing file, else a ConfigError naming the key and the fix."""
    if not path:
        raise ConfigError(f"{_key(key)} is not set; give {what}")
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path}: file not found; give {what} ({_FLAGS[key]})")
    return path


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


class Tokenizer(ABC):
    """Text to token ids and back; ``eod`` closes a document, specials are None where absent."""

    vocab_size: int
    eod: int
    pad: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (no special tokens added)."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text; the library's batch call where it has one."""
        return [self.encode(t) for t in texts]

    def encode_np(self, text: str) -> np.ndarray:
        """``encode`` as a 1-D integer array, skipping Python ints where the library allows."""
        return np.asarray(self.encode(text), dtype=np.int64)

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``."""


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

    def decode(self, ids: list[int]) -> str:
        """Concatenate the tokens' bytes; invalid UTF-8 (a cut character) becomes U+FFFD."""
        return b"".join(self._id_bytes[i] for i in ids).decode("utf-8", errors="replace")


def _load_gpt2_vocab(path: str | None) -> dict[str, int]:
    path = _require_file("tokenizer.vocab_file", path, "the GPT-2 vocab.json")
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
    path = _require_file("tokenizer.merges_file", path, "the GPT-2 merges.txt")
    merges = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
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


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``.model``; EOD is its eos piece, like GPTSentencePieceTokenizer's."""

    def __init__(self, model_file: str, num_threads: int = 1) -> None:
        import sentencepiece

        path = _require_file("tokenizer.model", model_file, "a sentencepiece .model")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise ConfigError(
                f"tokenizer.model={path}: not a sentencepiece model ({str(e).strip()}); "
                "train one with tools/train_tokenizer.py"
            ) from None
        self.num_threads = num_threads
        self.vocab_size = self._sp.vocab_size()
        if self._sp.eos_id() < 0:
            raise ConfigError(
                f"tokenizer.model={path}: the model defines no eos piece for end of document; "
                "retrain it with tools/train_tokenizer.py (it defines eos)"
            )
        self.eod = self._sp.eos_id()
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        self.cls = self._piece_id("[CLS]", "<cls>", "<CLS>")
        self.sep = self._piece_id("[SEP]", "<sep>", "<SEP>")
        self.mask = self._piece_id("[MASK]", "<mask>", "<MASK>")

    def _piece_id(self, *pieces: str) -> int | None:
        """The id of the first of ``pieces`` in the vocabulary (piece_to_id gives unk if absent)."""
        for piece in pieces:
            i = self._sp.piece_to_id(piece)
            if self._sp.id_to_piece(i) == piece:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """sentencepiece's batch encode on ``num_threads`` threads."""
        return self._sp.encode(texts, num_threads=self.num_threads)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; control pieces (eos, pad) decode to nothing."""
        return self._sp.decode(ids)


class _HFBacked(Tokenizer):
    """Shared calls of tokenizers built on the HF ``tokenizers`` library (no specials added)."""

    def __init__(self, tok: object) -> None:
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """HF's batch encode (parallel unless TOKENIZERS_PARALLELISM=false)."""
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included."""
        return self._tok.decode(ids, skip_special_tokens=False)


class WordPieceTokenizer(_HFBacked):
    """BERT WordPiece from ``vocab.txt`` (one token per line, id = line number); EOD is [SEP].

    Normalisation and pre-tokenisation follow the original BERT: clean control characters, space
    out CJK characters, split on whitespace and punctuation, and (``lower_case``) lower-case and
    strip accents. Whole-word masking reads ``is_continuation`` / ``continuation_mask``.
    """

    def __init__(self, vocab_file: str, lower_case: bool) -> None:
        from tokenizers import Tokenizer as HFTokenizerCore
        from tokenizers import decoders, models, normalizers, pre_tokenizers

        path = _require_file("tokenizer.vocab_file", vocab_file, "a BERT vocab.txt")
        with open(path, encoding="utf-8") as f:
            tokens = [line.strip() for line in f]
        self.vocab = {t: i for i, t in enumerate(tokens)}
        for required in ("[UNK]", "[SEP]"):
            if required not in self.vocab:
                raise ConfigError(
                    f"tokenizer.vocab_file={path}: no {required} token; give a BERT vocab.txt"
                )
        tok = HFTokenizerCore(
            models.WordPiece(vocab=self.vocab, unk_token="[UNK]", max_input_chars_per_word=100)
        )
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True,
            handle_chinese_chars=True,
            strip_accents=lower_case,
            lowercase=lower_case,
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        super().__init__(tok)
        self.lower_case = lower_case
        self.vocab_size = len(tokens)
        self.inv_vocab = dict(enumerate(tokens))
        self.eod = self.sep = self.vocab["[SEP]"]
        self.cls = self.vocab.get("[CLS]")
        self.pad = self.vocab.get("[PAD]")
        self.mask = self.vocab.get("[MASK]")
        self.unk = self.vocab["[UNK]"]
        self.continuation_mask = np.array([t.startswith("##") for t in tokens], dtype=bool)

    def id_to_token(self, i: int) -> str:
        """The vocabulary entry of id ``i``."""
        return self.inv_vocab[i]

    def is_continuation(self, i: int) -> bool:
        """Whether id ``i`` continues the previous word (a ``##`` piece)."""
        return bool(self.continuation_mask[i])


# Where tokenizer_config.json names no special tokens, these spellings are looked up in order.
_HF_SPECIALS = {
    "eos_token": ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]"),
    "pad_token": ("<pad>", "[PAD]", "<|padding|>"),
    "cls_token": ("[CLS]", "<cls>"),
    "sep_token": ("[SEP]", "<sep>"),
    "mask_token": ("[MASK]", "<mask>"),
}


class HFTokenizer(_HFBacked):
    """A HF ``tokenizer.json`` (or a directory holding one).

    Special tokens come from ``tokenizer_config.json`` beside it when present, else from the usual
    spellings (``<|endoftext|>``, ``</s>``, ``[SEP]``, ...); EOD is the eos token.
    """

    def __init__(self, model: str) -> None:
        from tokenizers import Tokenizer as HFTokenizerCore

        if model and os.path.isdir(model):
            model = os.path.join(model, "tokenizer.json")
        path = _require_file("tokenizer.model", model, "a HF tokenizer.json")
        try:
            tok = HFTokenizerCore.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise ConfigError(
                f"tokenizer.model={path}: not a HF tokenizer.json ({str(e).strip()}); "
                "save one with tokenizer.save(path)"
            ) from None
        super().__init__(tok)
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        named = _hf_config_specials(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
        found = {}
        for name, spellings in _HF_SPECIALS.items():
            candidates = [named[name]] if name in named else list(spellings)
            found[name] = next((vocab[t] for t in candidates if t in vocab), None)
        if found["eos_token"] is None:
            raise ConfigError(
                f"tokenizer.model={path}: no end-of-document token (looked for "
                f"{', '.join(_HF_SPECIALS['eos_token'])}); name it as eos_token in "
                "tokenizer_config.json beside it"
            )
        self.eod = found["eos_token"]
        self.pad, self.cls = found["pad_token"], found["cls_token"]
        self.sep, self.mask = found["sep_token"], found["mask_token"]


def _hf_config_specials(path: str) -> dict[str, str]:
    """Special-token spellings from a tokenizer_config.json (strings or {"content": ...})."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); fix or remove it") from None
    named = {}
    for name in _HF_SPECIALS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            named[name] = value
    return named


def build_tokenizer(
    type: str,
    model: str | None = None,
    vocab_file: str | None = None,
    merges_file: str | None = None,
    lower_case: bool = False,
    *,
    num_threads: int = 1,
) -> Tokenizer:
    """The tokenizer of config section ``tokenizer``; Megatron's type names are accepted.

    ``num_threads`` bounds the threads of one ``encode_batch`` call (tiktoken, sentencepiece).
    Missing or unreadable files raise ConfigError naming the key and the file.
    """
    kind = TOKENIZER_TYPES.get(type)
    if kind is None:
        raise ConfigError(
            f"tokenizer.type={type} is unknown; use one of sentencepiece, gpt2, wordpiece, hf "
            f"(or Megatron's {', '.join(t for t in TOKENIZER_TYPES if t[0].isupper())})"
        )
    if kind == "gpt2":
        return GPT2BPETokenizer(vocab_file, merges_file, num_threads=num_threads)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(model, num_threads=num_threads)
    if kind == "wordpiece":
        if type in _ALIAS_LOWER_CASE:
            if lower_case and not _ALIAS_LOWER_CASE[type]:
                raise ConfigError(
                    f"{_key('tokenizer.lower_case')}=true contradicts tokenizer.type={type}; "
                    "use BertWordPieceLowerCase or drop lower_case"
                )
            lower_case = _ALIAS_LOWER_CASE[type]
        return WordPieceTokenizer(vocab_file, lower_case)
    return HFTokenizer(model)
