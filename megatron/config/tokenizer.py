"""The tokenizer section: which tokenizer, its files, and the keys each type reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.config.fields import documented as _doc


@dataclass
class TokenizerConfig:
    """Which tokenizer, and its files."""

    type: Literal[
        "sentencepiece",
        "gpt2",
        "wordpiece",
        "hf",
        "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer",
        "Llama2Tokenizer",
        "GPT2BPETokenizer",
        "BertWordPieceLowerCase",
        "BertWordPieceCase",
        "HuggingFaceTokenizer",
        "TikTokenizer",
        "NullTokenizer",
    ] = _doc("Tokenizer family, or Megatron's type name (the ids megatron-core gives).")
    model: str | None = _doc(
        "sentencepiece .model, hf tokenizer.json (or its directory), tiktoken vocabulary .json.",
        None,
    )
    vocab_file: str | None = _doc("gpt2 vocab.json, or wordpiece vocab.txt.", None)
    merges_file: str | None = _doc("gpt2 merges.txt.", None)
    lower_case: bool = _doc("Lower-case text before wordpiece.", False)
    vocab_extra_ids: int | None = _doc(
        "T5 sentinels <extra_id_0..N-1> added as special tokens (wordpiece, sentencepiece, hf); "
        "null: Megatron's default, 100 for BertWordPieceCase, else 0.",
        None,
    )
    special_tokens: list[str] | None = _doc(
        "Special tokens to add (sentencepiece: with sentencepiece_legacy); TikTokenizer: its "
        "special tokens, which must include <unk> <s> </s> <mask> <pad> <cls> <sep>.",
        None,
    )
    sentencepiece_legacy: bool = _doc(
        "megatron-core's legacy sentencepiece wrapper, which takes special_tokens.", False
    )
    tiktoken_pattern: Literal["v1", "v2"] | None = _doc(
        "TikTokenizer pre-tokenizer pattern; null: v2.", None
    )
    tiktoken_num_special_tokens: int = _doc("TikTokenizer ids before the BPE ranks.", 1000)
    vocab_size: int | None = _doc(
        "NullTokenizer: ids in the data (EOD is one more); TikTokenizer: vocabulary size "
        "(null: 131072); hf: the model's embedding rows when above the file's ids (the rest "
        "are never produced), and the dry run's vocabulary where the file is absent.",
        None,
    )


TOKENIZER_FILES = {
    "sentencepiece": "model",
    "gpt2": "vocab_file merges_file",
    "wordpiece": "vocab_file",
    "hf": "model",
    "SentencePieceTokenizer": "model",
    "GPTSentencePieceTokenizer": "model",
    "Llama2Tokenizer": "model",
    "GPT2BPETokenizer": "vocab_file merges_file",
    "BertWordPieceLowerCase": "vocab_file",
    "BertWordPieceCase": "vocab_file",
    "HuggingFaceTokenizer": "model",
    "TikTokenizer": "model",
    "NullTokenizer": "",
}  # keys each tokenizer type reads
