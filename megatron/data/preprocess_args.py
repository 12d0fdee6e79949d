"""The command line of tools/preprocess_data.py: every flag of Megatron-LM's, each honoured or
refused in one line that says why.

Megatron-LM's ``tools/preprocess_data.py`` (main, and core_v0.16.1's older spellings) takes its
tokenizer flags from Megatron's training arguments, so some of them size the model or pick
library internals. Here each flag either does what it does there, is refused (``REFUSED``: it
cannot apply to writing token ids), or is accepted as unnecessary with a note printed once
(``UNNECESSARY``: the output is the same without it). Nothing is silently ignored.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron.data.tokenizers.factory import TOKENIZER_TYPES, UNSUPPORTED_TYPES
from megatron.errors import ConfigError

# dest -> why the flag cannot apply here.
REFUSED = {
    "padded_vocab_size": "it sizes the model's embedding at training time (here "
    "model.make_vocab_size_divisible_by pads the vocabulary); preprocessing writes token ids only",
    "no_pad_vocab_size": "it sizes the model's embedding at training time; preprocessing writes "
    "token ids only",
    "tokenizer_metadata": "it picks a megatron-core tokenizer class from a metadata JSON; pick the "
    "tokenizer with --tokenizer-type",
    "tokenizer_hf_no_use_fast": "the slow Python tokenizers of transformers are not used here: HF "
    "tokenizers encode with the tokenizers library (the fast ones); drop it",
    "trust_remote_code": "it runs a tokenizer's own Python code from the Hugging Face hub; this "
    "tool reads tokenizer.json files only",
    "chat_template": "it formats conversations for fine-tuning and inference; preprocessing "
    "encodes plain text",
    "legacy_tokenizer": "Megatron-LM removed its legacy tokenizer system; ids here follow "
    "megatron-core's tokenizers",
}
# Flags with two spellings, as errors name them.
_SPELLINGS = {"no_pad_vocab_size": "--no-pad-vocab-size/--disable-pad-vocab-size"}
# dest -> why the flag changes nothing here (printed once when given).
UNNECESSARY = {
    "partitions": "one streaming pool of --workers processes already encodes every input in order, "
    "so the .bin/.idx are those of --partitions 1, under the same {prefix}_{key}_{level} names",
    "keep_sequential_samples": "documents are always written in input order",
    "use_gigatoken": "HF tokenizers already encode in the tokenizers library on every worker",
}
# flag -> (dest, the one family it applies to): flags with no config key (build_tokenizer checks
# the others).
_CLI_FAMILIES = {
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": ("sp_keep_spaces", "sentencepiece"),
    "--tokenizer-hf-include-special-tokens": ("tokenizer_hf_include_special_tokens", "hf"),
    "--null-tokenizer-eod-id": ("null_tokenizer_eod_id", "null"),
    "--null-tokenizer-pad-id": ("null_tokenizer_pad_id", "null"),
}
# The files each family reads: a file flag for another family is refused.
_FILE_FLAGS = {
    "tokenizer_model": "--tokenizer-model",
    "vocab_file": "--vocab-file",
    "merge_file": "--merge-file",
}
_READS = {
    "sentencepiece": ("tokenizer_model",),
    "gpt2": ("vocab_file", "merge_file"),
    "wordpiece": ("vocab_file",),
    "hf": ("tokenizer_model",),
    "tiktoken": ("tokenizer_model",),
    "null": (),
}


def add_megatron_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's preprocess_data.py flags (main and core_v0.16.1), plus ours."""
    g = p.add_argument_group("input and output").add_argument
    g(
        "--input",
        nargs="+",
        required=True,
        help="JSONL (plain, .gz, .zst/.zstd) or .parquet files or globs, mixed freely",
    )
    g(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys (Parquet: columns) to tokenize, one dataset each",
    )
    split_help = (
        "one sequence per sentence. The splitter is a regex on sentence punctuation (. ! ? ... "
        "and CJK stops before a word that is not lower-case, except after abbreviations, "
        "initials and list numbers; blank lines), so it needs no model or download. A list of "
        "strings is taken as sentences."
    )
    g("--split-sentences", action="store_true", help=split_help)
    g(
        "--keep-newlines",
        action="store_true",
        help="with --split-sentences: keep the whitespace (newlines) after each sentence",
    )
    g("--lang", help="english only: the splitter is rule-based (Megatron: the punkt model)")
    g("--append-eod", action="store_true", help="end each document with the EOD id")
    g("--output-prefix", required=True, help="writes {prefix}_{key}_{document|sentence}")
    g(
        "--skip-bad-lines",
        action="store_true",
        help="count and report bad lines instead of stopping at the first with file:line",
    )
    g("--dataset-impl", choices=["mmap"], help="mmap, the only format (older Megatron flag)")

    g = p.add_argument_group("runtime").add_argument
    g("--workers", type=int, default=1, help="encoding processes (1: in this process)")
    g(
        "--log-interval",
        type=int,
        default=1000,
        help="a progress line every this many documents (a bar on a terminal)",
    )
    g(
        "--find-optimal-num-workers",
        action="store_true",
        help="time --max-documents documents at each of --workers-to-check; writes no dataset",
    )
    g("--workers-to-check", nargs="+", type=int, help="worker counts to time (default 16 32 64)")
    g("--max-documents", type=int, help="documents per timing run (default 100000)")
    g("--partitions", type=int, help="accepted; not needed (see the note it prints)")
    g("--use-gigatoken", action="store_true", default=None, help="accepted; not needed")
    g(
        "--keep-sequential-samples",
        action="store_true",
        default=None,
        help="accepted: input order is always kept",
    )

    g = p.add_argument_group("tokenizer").add_argument
    g("--tokenizer-type", required=True, choices=[*TOKENIZER_TYPES, *UNSUPPORTED_TYPES])
    g(
        "--tokenizer-model",
        help="sentencepiece .model, HF tokenizer.json or its directory, tiktoken vocabulary .json",
    )
    g("--vocab-file", help="GPT-2 vocab.json or BERT vocab.txt")
    g("--merge-file", help="GPT-2 merges.txt")
    g("--lower-case", action="store_true", help="lower-case WordPiece input")
    g("--vocab-size", type=int, help="NullTokenizer: ids in the data; TikTokenizer: vocabulary")
    g("--vocab-extra-ids", type=int, help="append <extra_id_0..N-1> special tokens (T5 sentinels)")
    g("--tokenizer-special-tokens", nargs="+", help="special tokens (sentencepiece: with legacy)")
    g("--tiktoken-special-tokens", nargs="+", help="older name of --tokenizer-special-tokens")
    g("--tiktoken-pattern", choices=["v1", "v2"], help="TikTokenizer split pattern (default v2)")
    g("--tiktoken-num-special-tokens", type=int, help="TikTokenizer special ids (default 1000)")
    g(
        "--tokenizer-sentencepiece-legacy",
        action="store_true",
        help="megatron-core's legacy sentencepiece wrapper (takes special tokens)",
    )
    g(
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
        dest="sp_keep_spaces",
        action="store_true",
        help="keep runs of spaces a sentencepiece model would collapse",
    )
    g(
        "--tokenizer-hf-include-special-tokens",
        action="store_true",
        help="HF: add the post-processor's special tokens (BOS ...) to every text",
    )
    g(
        "--tokenizer-hf-no-include-special-tokens",
        action="store_true",
        help="HF: add none (the default here and in megatron-core 0.16.1)",
    )
    g("--tokenizer-hf-use-fast", action="store_true", help="HF: the fast tokenizer (always here)")
    g("--null-tokenizer-eod-id", type=int, help="NullTokenizer EOD id (default --vocab-size)")
    g("--null-tokenizer-pad-id", type=int, help="NullTokenizer pad id (-1: none)")

    g = p.add_argument_group("refused here: they cannot apply to writing token ids").add_argument
    g("--padded-vocab-size", type=int, help="refused: sizes the model")
    g(
        "--no-pad-vocab-size",
        "--disable-pad-vocab-size",
        dest="no_pad_vocab_size",
        action="store_true",
        default=None,
        help="refused: sizes the model",
    )
    g("--tokenizer-metadata", help="refused: pick the tokenizer with --tokenizer-type")
    g("--chat-template", help="refused: formats conversations, not plain text")
    g("--tokenizer-hf-no-use-fast", action="store_true", default=None, help="refused: slow HF")
    g("--trust-remote-code", action="store_true", default=None, help="refused: remote code")
    g("--legacy-tokenizer", action="store_true", default=None, help="refused: removed in Megatron")


def _given(value: object) -> bool:
    """Whether a flag was given (flags whose absence matters default to None)."""
    return value is not None and value is not False


def check_megatron_flags(args: argparse.Namespace) -> list[str]:
    """Refuse what cannot apply (ConfigError, one line); the notes to print once."""
    for dest, why in REFUSED.items():
        if _given(getattr(args, dest)):
            flag = _SPELLINGS.get(dest, f"--{dest.replace('_', '-')}")
            raise ConfigError(f"{flag}: not supported here: {why}")
    if args.tokenizer_type in UNSUPPORTED_TYPES:
        raise ConfigError(
            f"--tokenizer-type {args.tokenizer_type}: not supported here: "
            f"{UNSUPPORTED_TYPES[args.tokenizer_type]}"
        )
    kind = TOKENIZER_TYPES[args.tokenizer_type]
    for flag, (dest, applies_to) in _CLI_FAMILIES.items():
        if _given(getattr(args, dest)) and kind != applies_to:
            raise ConfigError(
                f"{flag} does not apply to --tokenizer-type {args.tokenizer_type} (only to "
                f"{applies_to} tokenizers); drop it"
            )
    for dest, flag in _FILE_FLAGS.items():
        if getattr(args, dest) and dest not in _READS[kind]:
            reads = " and ".join(_FILE_FLAGS[d] for d in _READS[kind]) or "no file"
            raise ConfigError(
                f"{flag}: --tokenizer-type {args.tokenizer_type} does not read it (it reads "
                f"{reads}); drop it"
            )
    if args.split_sentences and args.lang not in (None, "english"):
        raise ConfigError(
            f"--lang {args.lang}: the sentence splitter here is rule-based with English "
            "abbreviations (no punkt models); drop --lang to split with it, or give each "
            "document as a JSON list of its sentences"
        )
    if args.tokenizer_hf_include_special_tokens and args.tokenizer_hf_no_include_special_tokens:
        raise ConfigError(
            "--tokenizer-hf-include-special-tokens and --tokenizer-hf-no-include-special-tokens "
            "contradict each other; give one"
        )
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: must be at least 1")
    if args.partitions is not None and args.partitions < 1:
        raise ConfigError(f"--partitions {args.partitions}: must be at least 1")
    if args.log_interval < 1:
        raise ConfigError(f"--log-interval {args.log_interval}: must be at least 1")
    given = {
        "partitions": (args.partitions or 1) > 1,
        "keep_sequential_samples": bool(args.keep_sequential_samples),
        "use_gigatoken": bool(args.use_gigatoken),
    }
    notes = [
        f"note: --{dest.replace('_', '-')} is not needed here: {why}"
        for dest, why in UNNECESSARY.items()
        if given[dest]
    ]
    unused = {
        "--keep-newlines": args.keep_newlines and not args.split_sentences,
        "--lang": args.lang is not None and not args.split_sentences,
        "--workers-to-check": args.workers_to_check is not None
        and not args.find_optimal_num_workers,
        "--max-documents": args.max_documents is not None and not args.find_optimal_num_workers,
    }
    needs = {"--keep-newlines": "--split-sentences", "--lang": "--split-sentences"}
    notes += [
        f"note: {flag} changes nothing without {needs.get(flag, '--find-optimal-num-workers')}"
        for flag, is_unused in unused.items()
        if is_unused
    ]
    if kind == "wordpiece" and not args.split_sentences:
        notes.append("note: BERT data is usually split into sentences (--split-sentences)")
    return notes


def tokenizer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``build_tokenizer`` that the command line asks for."""
    options: dict[str, Any] = {
        "type": args.tokenizer_type,
        "model": args.tokenizer_model,
        "vocab_file": args.vocab_file,
        "merges_file": args.merge_file,
        "lower_case": args.lower_case,
        "vocab_extra_ids": args.vocab_extra_ids,
        "special_tokens": args.tokenizer_special_tokens or args.tiktoken_special_tokens,
        "sentencepiece_legacy": args.tokenizer_sentencepiece_legacy,
        "tiktoken_pattern": args.tiktoken_pattern,
        "vocab_size": args.vocab_size,
        "sentencepiece_ignore_extra_whitespaces": not args.sp_keep_spaces,
        "hf_include_special_tokens": args.tokenizer_hf_include_special_tokens,
        "null_eod_id": args.null_tokenizer_eod_id,
    }
    if args.tiktoken_num_special_tokens is not None:
        options["tiktoken_num_special_tokens"] = args.tiktoken_num_special_tokens
    if args.null_tokenizer_pad_id is not None:
        options["null_pad_id"] = args.null_tokenizer_pad_id
    return options
