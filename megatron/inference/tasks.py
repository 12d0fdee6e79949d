"""Evaluation inputs: a text file as one token stream, LAMBADA examples, one split of indexed data.

Every reader raises ConfigError with one line naming the file (and the line of a JSONL file), so
a bad input stops the run before the model is loaded.
"""

from __future__ import annotations

import os
import re

import numpy as np

from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.splits import SPLIT_NAMES, split_ranges
from megatron.data.tokenizers.base import Tokenizer
from megatron.errors import ConfigError
from megatron.inference.jsonl import read_records

# The last word and what comes before it, both without their edge whitespace.
_LAST_WORD = re.compile(r"\s*(.*\S)\s+(\S+)\s*", re.DOTALL)


def read_text(path: str) -> str:
    """The whole file as UTF-8 text; a missing file or one without text is a ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"--input {path}: no such file; give the evaluation text file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"--input {path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise ConfigError(f"--input {path}: holds no text; give a file with text to score")
    return text


def word_count(text: str) -> int:
    """Whitespace-separated words: the denominator of WikiText's word-level perplexity."""
    return len(text.split())


def token_stream(text: str, tokenizer: Tokenizer, path: str) -> np.ndarray:
    """The ids of ``text`` tokenized in one piece (int64), at least two so one can be scored."""
    ids = tokenizer.encode_np(text)
    if len(ids) < 2:
        raise ConfigError(f"--input {path}: {len(ids)} token(s); scoring needs at least 2")
    return ids


def read_lambada(path: str) -> list[str]:
    """The ``text`` of every line of a LAMBADA JSONL file (blank lines skipped).

    Each text needs two words at least: a context and the last word to predict.
    """
    texts = []
    for number, record in read_records(path, "text", '{"text": "context ... last_word"}'):
        if _LAST_WORD.fullmatch(record["text"]) is None:
            raise ConfigError(
                f"--input {path}:{number}: under two words; an example needs a context "
                "and a last word"
            )
        texts.append(record["text"])
    if not texts:
        raise ConfigError(f"--input {path}: holds no examples; give JSONL lines with a text")
    return texts


def last_word_ids(context: str, last: str, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """(context ids, last-word ids): the ids of ``context + " " + last`` after the context's.

    With GPT-2's byte-level BPE this is Megatron-LM's strict LAMBADA (the context and
    ``" " + last`` tokenized apart) because its pre-tokenizer cuts before every space. A
    sentencepiece model turns a leading space into a piece of its own, so tokenizing
    ``" " + last`` apart would ask for a token the text never has; the continuation of the whole
    text is what the model saw in training. Should the whole text not start with the context's
    ids (a merge across the space), the last word is tokenized apart, as Megatron-LM does.
    """
    context_ids = tokenizer.encode(context)
    whole = tokenizer.encode(f"{context} {last}")
    if whole[: len(context_ids)] == context_ids:
        return context_ids, whole[len(context_ids) :]
    return context_ids, tokenizer.encode(" " + last)


def lambada_examples(
    texts: list[str], tokenizer: Tokenizer, seq_length: int, path: str
) -> list[tuple[list[int], list[int]]]:
    """(context ids, last-word ids) of every example (strict LAMBADA).

    The last word is the text after its last whitespace; the context is what comes before,
    stripped (``last_word_ids`` tokenizes them). The last word must fit in a window of
    ``seq_length`` inputs; a longer context is cut on the left when scored.
    """
    examples = []
    for number, text in enumerate(texts, 1):
        context, last = _LAST_WORD.fullmatch(text).groups()
        ids = last_word_ids(context, last, tokenizer)
        if not ids[0] or not ids[1]:
            raise ConfigError(f"--input {path}:{number}: the context or last word has no tokens")
        if len(ids[1]) > seq_length:
            raise ConfigError(
                f"--input {path}:{number}: the last word is {len(ids[1])} tokens, more than "
                f"--seq-length {seq_length}"
            )
        examples.append(ids)
    return examples


def split_stream(prefix: str, split: str, name: str) -> np.ndarray:
    """The tokens of split ``name`` of an indexed dataset, its sequences back to back (int64).

    The split is training's (``megatron.data.splits.split_ranges`` over the sequences, in file
    order), so "test" holds exactly the sequences the trainer held out.
    """
    indexed = IndexedDataset(prefix)
    elements = split_ranges(split, len(indexed))[SPLIT_NAMES.index(name)]
    begin, end = elements or (0, 0)
    parts = [indexed.get(i) for i in range(begin, end)]
    tokens = np.concatenate(parts, dtype=np.int64) if parts else np.zeros(0, np.int64)
    if len(tokens) < 2:
        raise ConfigError(
            f'--split {name} of {prefix} with weights "{split}": {len(tokens)} token(s) '
            f"({end - begin} of {len(indexed)} sequences); give {name} a larger share "
            "(--split-weights) or more data"
        )
    return tokens
