"""One tokenizer interface over sentencepiece, GPT-2 byte-level BPE, BERT WordPiece and HF files.

``build_tokenizer`` takes the ``tokenizer`` config section (``type``, ``model``, ``vocab_file``,
``merges_file``, ``lower_case``) and accepts Megatron's type names as aliases, so Megatron scripts
run unchanged. Every tokenizer exposes ``vocab_size`` (before model padding), ``eod`` (the id
appended at document ends) and ``pad``/``cls``/``sep``/``mask`` where the vocabulary has them.

Each implementation follows ``tokenizer_base.Tokenizer``; GPT-2 BPE lives in ``gpt2_bpe``.
"""

from __future__ import annotations

import json
import os

import numpy as np

from megatron.data.gpt2_bpe import GPT2BPETokenizer
from megatron.data.tokenizer_base import Tokenizer, flagged, require_file
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


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``.model``; EOD is its eos piece, like GPTSentencePieceTokenizer's."""

    def __init__(self, model_file: str, num_threads: int = 1) -> None:
        import sentencepiece

        path = require_file("tokenizer.model", model_file, "a sentencepiece .model")
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

        path = require_file("tokenizer.vocab_file", vocab_file, "a BERT vocab.txt")
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
        path = require_file("tokenizer.model", model, "a HF tokenizer.json")
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
                    f"{flagged('tokenizer.lower_case')}=true contradicts tokenizer.type={type}; "
                    "use BertWordPieceLowerCase or drop lower_case"
                )
            lower_case = _ALIAS_LOWER_CASE[type]
        return WordPieceTokenizer(vocab_file, lower_case)
    return HFTokenizer(model)
