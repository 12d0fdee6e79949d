"""One tokenizer interface over sentencepiece, GPT-2 BPE, BERT WordPiece, HF, tiktoken and null.

``build_tokenizer`` takes the ``tokenizer`` config section and accepts Megatron's type names, so
Megatron scripts and datasets carry over: every type gives the ids megatron-core (0.16.1) gives
(``tests/test_megatron_tokenizers.py`` compares them). Every tokenizer exposes ``vocab_size``
(before model padding), ``eod`` (the id appended at document ends) and ``pad``/``cls``/``sep``/
``mask`` where the vocabulary has them.

Each implementation follows ``base.Tokenizer`` and has its module in this package: ``gpt2_bpe``,
``sentencepiece``, ``tiktoken``, ``null``, ``wordpiece`` and ``hf`` (the last two on the HF
``tokenizers`` library).
"""

from __future__ import annotations

from megatron.data.tokenizers.base import Tokenizer, flagged
from megatron.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.data.tokenizers.hf import HFTokenizer
from megatron.data.tokenizers.null import NullTokenizer
from megatron.data.tokenizers.sentencepiece import SentencePieceTokenizer
from megatron.data.tokenizers.tiktoken import DEFAULT_NUM_SPECIAL_TOKENS, TikTokenizer
from megatron.data.tokenizers.wordpiece import WordPieceTokenizer
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
    "tokenizer.vocab_size": ("tiktoken", "null", "hf"),
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
    return HFTokenizer(model, extra, hf_include_special_tokens, vocab_size)
