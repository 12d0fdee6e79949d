"""Tokenizers on the HF ``tokenizers`` library: their shared calls, and a HF ``tokenizer.json`` as
megatron-core loads it."""

from __future__ import annotations

import json
import os

from megatron.data.tokenizers.base import Tokenizer, flagged, require_file
from megatron.errors import ConfigError


class HFBacked(Tokenizer):
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
        return self._tok.encode(text, add_special_tokens=self._add_special).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """HF's batch encode (parallel unless TOKENIZERS_PARALLELISM=false)."""
        encodings = self._tok.encode_batch_fast(texts, add_special_tokens=self._add_special)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included."""
        return self._tok.decode(ids, skip_special_tokens=False)


# Where tokenizer_config.json names no special tokens, these spellings are looked up in order.
_HF_SPECIALS = {
    "eos_token": ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]"),
    "pad_token": ("<pad>", "[PAD]", "<|padding|>"),
    "cls_token": ("[CLS]", "<cls>"),
    "sep_token": ("[SEP]", "<sep>"),
    "mask_token": ("[MASK]", "<mask>"),
}


class HFTokenizer(HFBacked):
    """A HF ``tokenizer.json`` (or a directory holding one), as megatron-core's
    HuggingFaceTokenizer loads it through transformers.

    Special tokens come from ``tokenizer_config.json`` beside it when present (EOD is its eos
    token, else its sep token, as in core), else from the usual spellings (``<|endoftext|>``,
    ``</s>``, ``[SEP]``, ...). ``extra_tokens`` are added as special tokens (new ones take the
    next ids); ``add_special_tokens`` runs the file's post-processor on every text (Megatron's
    --tokenizer-hf-include-special-tokens). ``vocab_size`` (at least the file's ids) adds ids the
    file never produces: a model's embedding rows past its tokenizer's (Qwen2.5: 152064 rows for
    151665 ids), which stay real vocabulary, as in the HF model.
    """

    def __init__(
        self,
        model: str | None,
        extra_tokens: list[str] | tuple = (),
        add_special_tokens: bool = False,
        vocab_size: int | None = None,
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
        if vocab_size is not None:
            if vocab_size < self.vocab_size:
                raise ConfigError(
                    f"{flagged('tokenizer.vocab_size')}={vocab_size} is below the "
                    f"{self.vocab_size} ids of tokenizer.model={path}; give at least that many "
                    "or drop it"
                )
            self.vocab_size = vocab_size
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
