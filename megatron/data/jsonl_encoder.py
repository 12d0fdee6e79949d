"""JSONL lines and Parquet rows to token arrays: parsing, the checks that name a bad record,
batched encoding.

``tools/preprocess_data.py`` reads the input in chunks (``megatron.data.corpus_files.Chunk``: raw
JSONL lines, or the values of Parquet columns) and hands each chunk to
``JsonlEncoder.encode_chunk`` (in worker processes), then writes the results in input order.
A chunk is parsed record by record, then each key's texts are encoded in one call
(``Tokenizer.encode_packed``: the library's batch encode where it has one): per-text overhead is
a large share of encoding short documents.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from megatron.data.corpus_files import Chunk
from megatron.data.indexed_dataset import best_dtype
from megatron.data.sentences import split_sentences
from megatron.data.tokenizers.base import Tokenizer


class BadLine(Exception):
    """One input line (or Parquet row) that cannot become a document; the message is the
    reason."""


_JSON = json.JSONDecoder()
_JSON_SPACE = " \t\n\r"


def _parse_json(text: str) -> object:
    """``json.loads(text)``, or BadLine with json's reason.

    ``raw_decode`` skips loads' wrapper (about 40% of its time on short lines); anything it does
    not accept as one whole value goes through ``json.loads`` for the exact outcome.
    """
    try:
        value, end = _JSON.raw_decode(text)
        if end == len(text) or not text[end:].strip(_JSON_SPACE):
            return value
    except json.JSONDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        if not text.strip():
            raise BadLine("blank line (expected a JSON object)") from None
        raise BadLine(f"malformed JSON ({e.msg} at column {e.colno})") from None


@dataclass
class ChunkResult:
    """Encoded documents of one chunk, per JSON key, plus what was wrong with the bad lines."""

    path: str
    tokens: dict[str, np.ndarray]  # all sequences back to back
    sequence_lengths: dict[str, np.ndarray]
    document_sizes: dict[str, np.ndarray]  # sequences per document
    bad: list[tuple[int, str]] = field(default_factory=list)  # (line or row number, reason)
    documents: int = 0
    bytes: int = 0


def keep_whitespace(text: str, sentences: list[str]) -> list[str]:
    """``sentences`` (stripped pieces of ``text``, in order) each with the whitespace after it.

    Megatron's --keep-newlines: its punkt variant (CustomLanguageVars) ends a sentence after the
    whitespace that follows it, so newlines between sentences stay in the data; the document's
    last sentence ends at its last non-space character.
    """
    starts, pos = [], 0
    for sentence in sentences:
        pos = text.find(sentence, pos)  # the first match from here is this piece: it is stripped
        starts.append(pos)
        pos += len(sentence)
    ends = [*starts[1:], len(text.rstrip())]
    return [text[a:b] for a, b in zip(starts, ends)]


class JsonlEncoder:
    """Turns chunks of raw JSONL lines or Parquet rows into token sequences, one dataset per JSON
    key (Parquet: column).

    Each key's value is a document: a string (split into sentences with ``split_sentences``,
    keeping the whitespace between them with ``keep_newlines``) or a list of strings taken as
    its sentences. Tokens are in ``best_dtype`` of the vocabulary.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        keys: list[str],
        split_sentences: bool = False,
        append_eod: bool = False,
        skip_bad_lines: bool = False,
        keep_newlines: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.dtype = best_dtype(tokenizer.vocab_size)
        self.keys, self.split, self.keep_newlines = keys, split_sentences, keep_newlines
        self.append_eod, self.skip_bad_lines = append_eod, skip_bad_lines
        # Only tokenizers that can refuse a text (NullTokenizer) pay for a check per piece.
        self._checks_text = type(tokenizer).bad_text is not Tokenizer.bad_text

    def parse_line(self, raw: bytes) -> list[list[str]]:
        """The texts of each key's sequences (one, or its sentences), or BadLine."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadLine(f"invalid UTF-8 (byte {e.start})") from None
        record = _parse_json(text)
        if not isinstance(record, dict):
            raise BadLine(f"not a JSON object (a {type(record).__name__})")
        documents = []
        for key in self.keys:
            if key not in record:
                raise BadLine(f"missing key {key!r}")
            documents.append(self._pieces(record[key], "key", key))
        return documents

    def parse_row(self, values: tuple) -> list[list[str]]:
        """``parse_line`` of one Parquet row: the value of each key's column, or BadLine.

        A null is a bad row, as a JSON null or a missing key is a bad line: a hole in a text
        column is likelier a join or an export gone wrong than a document meant to be empty, so
        it stops the run, or with --skip-bad-lines is counted and reported, never dropped unseen.
        """
        documents = []
        for key, value in zip(self.keys, values):
            if value is None:
                raise BadLine(f"null in column {key!r}")
            documents.append(self._pieces(value, "column", key))
        return documents

    def _pieces(self, value: object, kind: str, key: str) -> list[str]:
        """The texts of one document, the value of ``kind`` (key or column) ``key``, or BadLine
        (naming them, formatted only then: this runs for every document)."""
        if isinstance(value, str):
            if not value or value.isspace():  # isspace stops at the first other character
                raise BadLine(f"empty document in {kind} {key!r}")
            pieces = [value]
            if self.split:
                pieces = split_sentences(value)
                if self.keep_newlines:
                    pieces = keep_whitespace(value, pieces)
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            pieces = value  # already split into sentences, as Megatron accepts
        else:
            raise BadLine(f"not a string in {kind} {key!r} (a {type(value).__name__})")
        for piece in pieces:
            if not piece.isascii():  # O(1): CPython keeps an ASCII flag
                try:
                    piece.encode("utf-8")
                except UnicodeEncodeError:
                    # a \ud800-style escape without its pair: no tokenizer takes it
                    raise BadLine(f"unpaired surrogate escape in {kind} {key!r}") from None
            if self._checks_text and (why := self.tokenizer.bad_text(piece)):
                raise BadLine(f"{why} in {kind} {key!r}")
        return pieces

    def encode_chunk(self, chunk: Chunk) -> ChunkResult:
        """Parse every record of a chunk, then encode each key's texts in one batch.

        Without --skip-bad-lines parsing stops at the first bad record. A document whose texts
        all encode to no tokens makes its record bad too (found after parsing, so a line with
        such a key and a later malformed key reports the latter).
        """
        if chunk.lines is not None:
            records, parse, kind = chunk.lines, self.parse_line, "key"
        else:
            records, parse, kind = zip(*chunk.columns), self.parse_row, "column"
        texts: list[list[str]] = [[] for _ in self.keys]  # per key, every sequence in order
        counts: list[list[int]] = [[] for _ in self.keys]  # per key: sequences per document
        line_numbers, bad = [], []
        for offset, record in enumerate(records):
            try:
                documents = parse(record)
            except BadLine as e:
                bad.append((chunk.first + offset, str(e)))
                if self.skip_bad_lines:
                    continue
                break
            line_numbers.append(chunk.first + offset)
            for k, pieces in enumerate(documents):
                texts[k] += pieces
                counts[k].append(len(pieces))
        encoded = [self.tokenizer.encode_packed(key_texts) for key_texts in texts]
        keep = np.ones(len(line_numbers), dtype=bool)
        for key, (_, lengths), key_counts in zip(self.keys, encoded, counts):
            ends = np.concatenate(([0], np.cumsum(lengths)))[np.cumsum([0, *key_counts])]
            empty = np.diff(ends) == 0
            for d in np.flatnonzero(empty & keep).tolist():
                bad.append((line_numbers[d], f"empty document in {kind} {key!r} (no tokens)"))
            keep &= ~empty
        bad.sort()
        result = ChunkResult(chunk.path, {}, {}, {}, bad, int(keep.sum()), chunk.bytes)
        for key, (tokens, lengths), key_counts in zip(self.keys, encoded, counts):
            self._pack(result, key, tokens, lengths, np.asarray(key_counts, dtype=np.int64), keep)
        return result

    def _pack(
        self,
        result: ChunkResult,
        key: str,
        tokens: np.ndarray,
        lengths: np.ndarray,
        counts: np.ndarray,
        keep: np.ndarray,
    ) -> None:
        """One key's kept documents without empty sequences; EOD after each document's last."""
        document = np.repeat(np.arange(len(counts)), counts)  # of each sequence
        kept = keep[document] & (lengths > 0)
        if not kept.all():
            tokens = tokens[np.repeat(kept, lengths)]
            lengths = lengths[kept]
        sizes = np.bincount(document[kept], minlength=len(counts))[keep]
        tokens = tokens.astype(self.dtype, copy=False)
        if self.append_eod:
            last = np.cumsum(sizes) - 1
            tokens = np.insert(tokens, np.cumsum(lengths)[last], self.tokenizer.eod)
            lengths[last] += 1
        result.tokens[key] = tokens
        result.sequence_lengths[key] = lengths
        result.document_sizes[key] = sizes
