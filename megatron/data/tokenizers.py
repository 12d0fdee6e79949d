"""One tokenizer interface over sentencepiece, GPT-2 BPE, BERT WordPiece, HF, tiktoken and null.

``build_tokenizer`` takes the ``tokenizer`` config section and accepts Megatron's type names, so
Megatron scripts and datasets carry over: every type gives the ids megatron-core (0.16.1) gives
(``tests/test_megatron_tokenizers.py`` compares them). Every tokenizer exposes ``vocab_size``
(before model padding), ``eod`` (the id appended at document ends) and ``pad``/``cls``/``sep``/
``mask`` where the vocabulary has them.

Each implementation follows ``tokenizer_base.Tokenizer``: GPT-2 BPE lives in ``gpt2_bpe``,
sentencepiece in ``sp_tokenizer``, TikTokenizer in ``tiktokenizer``, NullTokenizer in
``null_tokenizer``; WordPiece and HF files (both on the ``tokenizers`` library) here.
"""

from __future__ import annotations

import json
import os

import numpy as np

from megatron.data.gpt2_bpe import GPT2BPETokenizer
from megatron.data.null_tokenizer import NullTokenizer
from megatron.data.sp_tokenizer import SentencePieceTokenizer
from megatron.data.tiktokenizer import DEFAULT_NUM_SPECIAL_TOKENS, TikTokenizer
from megatron.data.tokenizer_base import Tokenizer, flagged, require_file
from megatron.errors import ConfigError

# Every accepted type name -> its family (the implementation). Megatron's three sentencepiece
# names build one and the same wrapper in megatron-core.
TOKENIZER_TYPES: dict[str, str] = {
    "sentencepiece": "sentencepiece",
    "gpt2": "gpt2",
    "wordpiece": "wordpiece",
    "hf": "hf",
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "Llama2Tokenizer": "sentencepiece",
    "GPT2BPETokenizer": "gpt2",
    "BertWordPieceLowerCase": "wordpiece",
    "BertWordPieceCase": "wordpiece",
    "HuggingFaceTokenizer": "hf",
    "TikTokenizer": "tiktoken",
    "NullTokenizer": "null",
}
# Megatron types this project does not build, and why (they are not text-to-ids tokenizers).
UNSUPPORTED_TYPES = {
    "MultimodalTokenizer": "it formats image-text prompts (tools/preprocess_mmdata.py data)",
    "NullMultimodalTokenizer": "it is the multimodal benchmark tokenizer",
    "SFTTokenizer": "it applies chat prompt formats for fine-tuning data",
}
# Megatron's BERT aliases carry the casing in their name.
_ALIAS_LOWER_CASE = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}
# megatron-core's build_tokenizer gives BertWordPieceCase 100 T5 sentinels, and only it.
DEFAULT_EXTRA_IDS = {"BertWordPieceCase": 100}
# Which families take each option; any other family refuses it rather than ignore it.
_OPTION_FAMILIES = {
    "tokenizer.vocab_size": ("tiktoken", "null"),
    "tokenizer.vocab_extra_ids": ("wordpiece", "sentencepiece", "hf"),
    "tokenizer.special_tokens": ("wordpiece", "sentencepiece", "hf", "tiktoken"),
    "tokenizer.sentencepiece_legacy": ("sentencepiece",),
    "tokenizer.tiktoken_pattern": ("tiktoken",),
    "tokenizer.tiktoken_num_special_tokens": ("tiktoken",),
    "tokenizer.lower_case": ("wordpiece",),
}


def extra_id_tokens(n: int) -> list[str]:
    """T5's sentinel tokens ``<extra_id_0>`` .. ``<extra_id_{n-1}>`` (Megatron's extra ids)."""
    return [f"<extra_id_{i}>" for i in range(n)]


class _HFBacked(Tokenizer):
    """Shared calls of tokenizers built on the HF ``tokenizers`` library.

    Special tokens spelled in the text encode as their ids (as in transformers); the
    post-processor's (BOS, [CLS] ...) are added only with ``add_special_tokens``.
    """

    def __init__(self, tok: object, add_special_tokens: bool = False) -> None:
        self._tok = tok
        self._add_special = add_special_tokens

    def _add_specials(self, tokens: list[str]) -> None:
        """Make ``tokens`` special (matched in raw text); new ones get the next ids, in order."""
        from tokenizers import AddedToken

        self._tok.add_special_tokens([AddedToken(t, special=True) for t in tokens])

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        return self._tok.encode(text, add_special_tokens=self._add_special).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """HF's batch encode (parallel unless TOKENIZERS_PARALLELISM=false)."""
        encodings = self._tok.encode_batch_fast(texts, add_special_tokens=self._add_special)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included."""
        return self._tok.decode(ids, skip_special_tokens=False)


class WordPieceTokenizer(_HFBacked):
    """BERT WordPiece from ``vocab.txt`` (one token per line, id = line number); EOD is [SEP].

    Normalisation and pre-tokenisation follow the original BERT: clean control characters, space
    out CJK characters, split on whitespace and punctuation, and (``lower_case``) lower-case and
    strip accents. Whole-word masking reads ``is_continuation`` / ``continuation_mask``.
    ``extra_tokens`` become special tokens as transformers adds them in megatron-core: those not
    in the file get the ids after its last line, in order.
    """

    def __init__(
        self, vocab_file: str | None, lower_case: bool, extra_tokens: list[str] | tuple = ()
    ) -> None:
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
        # Ids picked here, not by the tokenizers library: it would count a file's duplicate
        # lines once and hand out ids that the file's last lines already hold.
        for token in extra_tokens:
            if token not in self.vocab:
                self.vocab[token] = len(tokens)
                tokens.append(token)
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
        if extra_tokens:
            self._add_specials(list(extra_tokens))
        self.files = (path,)
        self.options = {"lower_case": lower_case}
        if extra_tokens:
            self.options["special_tokens"] = list(extra_tokens)
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
    """A HF ``tokenizer.json`` (or a directory holding one), as megatron-core's
    HuggingFaceTokenizer loads it through transformers.

    Special tokens come from ``tokenizer_config.json`` beside it when present (EOD is its eos
    token, else its sep token, as in core), else from the usual spellings (``<|endoftext|>``,
    ``</s>``, ``[SEP]``, ...). ``extra_tokens`` are added as special tokens (new ones take the
    next ids); ``add_special_tokens`` runs the file's post-processor on every text (Megatron's
    --tokenizer-hf-include-special-tokens).
    """

    def __init__(
        self,
        model: str | None,
        extra_tokens: list[str] | tuple = (),
        add_special_tokens: bool = False,
    ) -> None:
        from tokenizers import Tokenizer as HFTokenizerCore

        if model and os.path.isdir(model):
            model = os.path.join(model, "tokenizer.json")
        path = require_file("tokenizer.model", model, "a HF tokenizer.json or its directory")
        try:
            tok = HFTokenizerCore.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise ConfigError(
                f"tokenizer.model={path}: not a HF tokenizer.json ({str(e).strip()}); "
                "save one with tokenizer.save(path)"
            ) from None
        super().__init__(tok, add_special_tokens)
        if extra_tokens:
            self._add_specials(list(extra_tokens))
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        self.files = (path, config) if os.path.isfile(config) else (path,)
        self.options = {}
        if extra_tokens:
            self.options["special_tokens"] = list(extra_tokens)
        if add_special_tokens:
            self.options["hf_include_special_tokens"] = True
        named = _hf_config_specials(config)
        if "eos_token" not in named and "sep_token" in named:
            named["eos_token"] = named["sep_token"]
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


def family(type: str) -> str:
    """The implementation a type name builds (``GPT2BPETokenizer`` -> ``gpt2``), or ConfigError."""
    if type in UNSUPPORTED_TYPES:
        raise ConfigError(
            f"{flagged('tokenizer.type')}={type} is not supported here: {UNSUPPORTED_TYPES[type]}"
        )
    if type not in TOKENIZER_TYPES:
        raise ConfigError(
            f"tokenizer.type={type} is unknown; use one of sentencepiece, gpt2, wordpiece, hf "
            f"(or Megatron's {', '.join(t for t in TOKENIZER_TYPES if t[0].isupper())})"
        )
    return TOKENIZER_TYPES[type]


def _check_options(type: str, kind: str, given: dict[str, bool]) -> None:
    """Refuse each option set for a family that does not read it (rather than ignore it)."""
    for key, is_set in given.items():
        if is_set and kind not in _OPTION_FAMILIES[key]:
            raise ConfigError(
                f"{flagged(key)} does not apply to tokenizer.type={type}; it applies to the "
                f"{', '.join(_OPTION_FAMILIES[key])} tokenizers; drop it"
            )


def build_tokenizer(
    type: str,
    model: str | None = None,
    vocab_file: str | None = None,
    merges_file: str | None = None,
    lower_case: bool = False,
    vocab_extra_ids: int | None = None,
    special_tokens: list[str] | None = None,
    sentencepiece_legacy: bool = False,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
    vocab_size: int | None = None,
    *,
    num_threads: int = 1,
    sentencepiece_ignore_extra_whitespaces: bool = True,
    hf_include_special_tokens: bool = False,
    null_eod_id: int | None = None,
    null_pad_id: int = -1,
) -> Tokenizer:
    """The tokenizer of config section ``tokenizer``; Megatron's type names are accepted.

    The positional keys are the config section's (``build_tokenizer(**asdict(cfg.tokenizer))``);
    the keyword-only ones are preprocess_data.py's Megatron flags that have no config key.
    ``vocab_extra_ids`` appends ``<extra_id_0..N-1>`` after ``special_tokens`` (null: Megatron's
    default for the type, 100 for BertWordPieceCase, else none). ``num_threads`` bounds the
    threads of one ``encode_batch`` call. Missing or unreadable files, and options the type does
    not read, raise ConfigError naming the key.
    """
    kind = family(type)
    _check_options(
        type,
        kind,
        {
            "tokenizer.vocab_size": vocab_size is not None,
            "tokenizer.vocab_extra_ids": bool(vocab_extra_ids),
            "tokenizer.special_tokens": bool(special_tokens),
            "tokenizer.sentencepiece_legacy": sentencepiece_legacy,
            "tokenizer.tiktoken_pattern": tiktoken_pattern is not None,
            "tokenizer.tiktoken_num_special_tokens": (
                tiktoken_num_special_tokens != DEFAULT_NUM_SPECIAL_TOKENS
            ),
            "tokenizer.lower_case": lower_case and type != "BertWordPieceCase",
        },
    )
    if type == "BertWordPieceCase" and special_tokens:
        raise ConfigError(
            f"{flagged('tokenizer.special_tokens')} with tokenizer.type=BertWordPieceCase: "
            "megatron-core drops them for this type (it adds <extra_id_0..99>); use "
            "BertWordPieceLowerCase or wordpiece (lower_case: false) to add special tokens"
        )
    if vocab_extra_ids is None:
        vocab_extra_ids = DEFAULT_EXTRA_IDS.get(type, 0)
    extra = [*(special_tokens or []), *extra_id_tokens(vocab_extra_ids)]
    if kind == "gpt2":
        return GPT2BPETokenizer(vocab_file, merges_file, num_threads=num_threads)
    if kind == "sentencepiece":
        # Megatron's extra ids were special tokens of its legacy wrapper: they imply it.
        return SentencePieceTokenizer(
            model,
            num_threads=num_threads,
            special_tokens=extra,
            legacy=sentencepiece_legacy or bool(vocab_extra_ids),
            ignore_extra_whitespaces=sentencepiece_ignore_extra_whitespaces,
        )
    if kind == "wordpiece":
        if type in _ALIAS_LOWER_CASE:
            if lower_case and not _ALIAS_LOWER_CASE[type]:
                raise ConfigError(
                    f"{flagged('tokenizer.lower_case')}=true contradicts tokenizer.type={type}; "
                    "use BertWordPieceLowerCase or drop lower_case"
                )
            lower_case = _ALIAS_LOWER_CASE[type]
        return WordPieceTokenizer(vocab_file, lower_case, extra)
    if kind == "tiktoken":
        return TikTokenizer(
            model,
            tiktoken_pattern,
            vocab_size,
            tiktoken_num_special_tokens,
            special_tokens,
            num_threads=num_threads,
        )
    if kind == "null":
        return NullTokenizer(vocab_size, null_eod_id, null_pad_id)
    return HFTokenizer(model, extra, hf_include_special_tokens)
