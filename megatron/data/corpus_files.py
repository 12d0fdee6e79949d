"""Input corpus files as chunks of documents: JSONL (plain, gzip, zstd) and Parquet.

``tools/preprocess_data.py`` names its ``--input`` files; this module opens each by its suffix
and yields ``Chunk``s of about ``chunk_bytes`` in file order, the unit of work its encoder pool
takes:

- JSONL, plain, ``.gz`` (gzip) or ``.zst``/``.zstd`` (zstandard, the Pile's format): whole raw
  lines, numbered from 1. A compressed stream cut short or damaged is one ConfigError naming the
  file and its last whole line.
- ``.parquet`` (FineWeb, DCLM, The Stack): the ``--json-keys`` columns, read with pyarrow one row
  group at a time (memory holds one row group of those columns, never the file), rows numbered
  from 0 as pyarrow and pandas count them. Each file's columns are checked before any work
  (``check_inputs``): a missing or non-text column, or an unreadable file, is one ConfigError.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, BinaryIO

import zstandard

from megatron.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow
    import pyarrow.parquet

ZSTD_SUFFIXES = (".zst", ".zstd")


@dataclass
class Chunk:
    """Consecutive documents of one input file: raw JSONL ``lines``, or Parquet ``columns``."""

    path: str
    first: int  # the number of its first record: a JSONL line (from 1) or a Parquet row (from 0)
    lines: list[bytes] | None  # JSONL: the raw lines, newlines included
    columns: list[list] | None  # Parquet: per --json-keys key, its values (str, [str], None)
    bytes: int  # what it covers of the input: the lines' bytes, or the Arrow columns' bytes

    def __len__(self) -> int:
        """The number of records (lines or rows)."""
        return len(self.lines if self.lines is not None else self.columns[0])

    def head(self, n: int) -> Chunk:
        """Its first ``n`` records (Parquet: ``bytes`` in proportion)."""
        if self.lines is not None:
            lines = self.lines[:n]
            return Chunk(self.path, self.first, lines, None, sum(map(len, lines)))
        columns = [column[:n] for column in self.columns]
        return Chunk(self.path, self.first, None, columns, self.bytes * n // max(1, len(self)))


def is_parquet(path: str) -> bool:
    """Whether ``path`` is read as Parquet (its suffix is ``.parquet``)."""
    return path.endswith(".parquet")


def record_name(path: str) -> str:
    """What a record of ``path`` is called in messages: ``row`` (Parquet) or ``line``."""
    return "row" if is_parquet(path) else "line"


def where(path: str, number: int) -> str:
    """A record's place for a message: ``a.jsonl:37`` or ``a.parquet: row 36``."""
    return f"{path}: row {number}" if is_parquet(path) else f"{path}:{number}"


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files named by ``--input``: paths or globs (sorted), in the order given."""
    paths = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [p for p in matches if os.path.exists(p) and not os.path.isdir(p)]
        if not matches:
            raise ConfigError(
                f"--input {pattern}: no such file; give JSONL (plain, .gz, .zst) or .parquet "
                "files, or globs"
            )
        paths.extend(matches)
    return paths


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a zstd file, frame after frame.

    zstandard's own ``stream_reader`` ends a stream cut inside a frame without an error, so a
    truncated download would pass as a shorter corpus; its ``decompressobj`` says whether its
    frame ended (``eof``), which this reader checks at the end of the file.
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "rb")
        self._zstd = zstandard.ZstdDecompressor()
        self._frame = self._zstd.decompressobj()
        self._in_frame = False  # the current frame has begun and not ended
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        while not self._pending:
            data = self._file.read(1 << 20)
            if not data:
                if self._in_frame:
                    raise zstandard.ZstdError("the stream ends inside a frame")
                return 0
            self._pending = memoryview(self._decompress(data))
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _decompress(self, data: bytes) -> bytes:
        """Decompress ``data``, starting a new frame after each one that ends in it."""
        out = []
        while data:
            out.append(self._frame.decompress(data))
            self._in_frame = not self._frame.eof
            if self._in_frame:
                break
            data = self._frame.unused_data
            self._frame = self._zstd.decompressobj()
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_zstd(path: str) -> BinaryIO:
    return io.BufferedReader(_ZstdFrames(path), 1 << 20)


# suffix -> (the format's name, its opener, what reading a stream cut short or damaged raises)
_COMPRESSED: dict[str, tuple[str, Callable[[str], BinaryIO], tuple[type[Exception], ...]]] = {
    ".gz": ("gzip", lambda path: gzip.open(path, "rb"), (EOFError, gzip.BadGzipFile, zlib.error)),
    **{s: ("zstd", _open_zstd, (zstandard.ZstdError,)) for s in ZSTD_SUFFIXES},
}


def _compression(path: str) -> tuple[str, Callable[[str], BinaryIO], tuple] | None:
    return next((c for suffix, c in _COMPRESSED.items() if path.endswith(suffix)), None)


def open_binary(path: str) -> BinaryIO:
    """A binary line reader of a plain, gzip (``.gz``) or zstd (``.zst``, ``.zstd``) file."""
    compression = _compression(path)
    if compression is None:
        return open(path, "rb", buffering=1 << 20)
    return compression[1](path)


def read_lines(f: BinaryIO, path: str, chunk_bytes: int) -> list[bytes]:
    """The next whole lines of ``f`` (the file ``path``), about ``chunk_bytes``; a compressed
    stream cut short or damaged is a ConfigError naming the file and its last whole line."""
    compression = _compression(path)
    damaged = compression[2] if compression else ()
    try:
        # readlines(hint) stops after the line that crosses the hint: one C loop per chunk
        return f.readlines(chunk_bytes)
    except damaged:
        name, opener, _ = compression
        # The chunk's lines read before the damage are lost: count them again, from the start.
        good = 0
        with opener(path) as again, contextlib.suppress(*damaged):
            for _ in again:
                good += 1
        raise ConfigError(
            f"{path}: truncated or corrupt {name} stream after line {good}; re-download or "
            "re-compress it"
        ) from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _line_chunks(path: str, chunk_bytes: int) -> Iterator[Chunk]:
    with open_binary(path) as f:
        first = 1
        while lines := read_lines(f, path, chunk_bytes):
            yield Chunk(path, first, lines, None, sum(map(len, lines)))
            first += len(lines)


# pyarrow is imported only when a Parquet file is given: it takes longer to import than a small
# JSONL run takes, and the workers never need it (chunks carry Python values).
def _parquet() -> ModuleType:
    import pyarrow
    import pyarrow.parquet

    return pyarrow


def _unreadable(path: str, e: BaseException, what: str = "not a readable Parquet file") -> str:
    return f"{path}: {what} ({_first_line(e)}); re-download or re-write it"


def _open_parquet(path: str, stack: contextlib.ExitStack) -> pyarrow.parquet.ParquetFile:
    """The ParquetFile of ``path`` (its footer read), or a ConfigError naming the file."""
    pa = _parquet()
    f = stack.enter_context(open(path, "rb"))  # an input we cannot open stays an OSError
    try:
        return pa.parquet.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:  # truncated: no footer; OSError: corrupt bytes
        raise ConfigError(_unreadable(path, e)) from None


def _is_text(pa: ModuleType, kind: pyarrow.DataType) -> bool:
    """Whether an Arrow type holds documents: strings, or lists of strings (the sentences)."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        kind = kind.value_type
    text = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
    return any(is_text(kind) for is_text in text)


def check_inputs(paths: list[str], keys: list[str]) -> None:
    """Each Parquet file of ``paths`` is readable and has every key as a text column; else one
    ConfigError naming the file and the column. JSONL files are checked as they are read."""
    for path in filter(is_parquet, paths):
        with contextlib.ExitStack() as stack:
            schema = _open_parquet(path, stack).schema_arrow
            for key in keys:
                if key not in schema.names:
                    raise ConfigError(
                        f"{path}: no column {key!r} (--json-keys); its columns: "
                        f"{', '.join(schema.names)}"
                    )
                kind = schema.field(key).type
                if not _is_text(_parquet(), kind):
                    raise ConfigError(
                        f"{path}: column {key!r} is {kind}, not text; give string columns (or "
                        "lists of strings: a document's sentences) in --json-keys"
                    )


def _parquet_chunks(path: str, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
    """Row group by row group; each row group in equal slices of about ``chunk_bytes``."""
    pa = _parquet()
    with contextlib.ExitStack() as stack:
        parquet = _open_parquet(path, stack)
        first = 0
        for group in range(parquet.num_row_groups):
            try:
                table = parquet.read_row_group(group, columns=keys)
            except (pa.ArrowException, OSError) as e:  # OSError: corrupt compressed pages
                raise ConfigError(
                    _unreadable(path, e, f"row group {group} (rows from {first}) is unreadable")
                ) from None
            pieces = max(1, -(-table.nbytes // chunk_bytes))
            rows = max(1, -(-table.num_rows // pieces))
            for start in range(0, table.num_rows, rows):
                part = table.slice(start, rows)
                try:
                    columns = [part.column(key).to_pylist() for key in keys]
                except UnicodeDecodeError as e:  # Arrow does not check strings on reading
                    raise ConfigError(
                        f"{path}: rows {first + start} to {first + start + len(part) - 1} hold "
                        f"a string that is not UTF-8 ({e.reason}); re-write them as UTF-8"
                    ) from None
                yield Chunk(path, first + start, None, columns, part.nbytes)
            first += table.num_rows


def read_chunks(
    paths: list[str], keys: list[str], chunk_bytes: int, max_records: int | None = None
) -> Iterator[Chunk]:
    """The chunks of every file of ``paths`` in order, about ``chunk_bytes`` each (Parquet: the
    ``keys`` columns); ``max_records`` stops after that many lines and rows in all."""
    left = max_records
    for path in paths:
        if is_parquet(path):
            chunks = _parquet_chunks(path, keys, chunk_bytes)
        else:
            chunks = _line_chunks(path, chunk_bytes)
        for chunk in chunks:
            if left is not None:
                chunk = chunk.head(left)
                left -= len(chunk)
            yield chunk
            if left == 0:
                return
