"""Megatron's MMIDIDX token files: a streaming writer and a memory-mapped reader.

A dataset is two files sharing a prefix. ``{prefix}.bin`` holds the raw tokens of every sequence,
back to back. ``{prefix}.idx`` is, little-endian and without padding::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code (DTYPE_CODES)
    u64       S, the number of sequences
    u64       D, the length of document_indices (documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence pointers, byte offsets into the .bin
    int64[D]  document_indices: document k is sequences [doc[k], doc[k+1]); doc[0] = 0, doc[-1] = S

A document is one or more sequences (one per sentence when sentences are split). The files are
byte-compatible with megatron-core's ``IndexedDataset``, so corpora move both ways unchanged.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import struct
from array import array
from types import TracebackType

import numpy as np

from megatron.atomic_file import fsync_path
from megatron.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
# magic, version, dtype code, sequence count, document-index length
_HEADER = struct.Struct("<9sQBQQ")


def best_dtype(vocab_size: int) -> np.dtype:
    """The narrowest token dtype Megatron uses for a vocabulary: uint16 below 65500, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def data_path(prefix: str) -> str:
    """The ``.bin`` (tokens) path of a dataset prefix."""
    return prefix + ".bin"


def index_path(prefix: str) -> str:
    """The ``.idx`` (index) path of a dataset prefix."""
    return prefix + ".idx"


class IndexedDatasetWriter:
    """Streams sequences into ``{prefix}.bin``/``.idx`` under temporary names.

    Nothing appears under the final names until ``finalize``, which renames the ``.bin`` first and
    the ``.idx`` last, so a reader that finds the ``.idx`` always finds a complete ``.bin``. Used as
    a context manager it finalizes on success and aborts (removes the temporary files) on error.
    """

    def __init__(self, prefix: str, dtype: np.dtype | type) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ConfigError(
                f"{index_path(prefix)}: token dtype {self.dtype} is not one of the MMIDIDX dtypes "
                f"({', '.join(str(np.dtype(t)) for t in DTYPE_CODES.values())}); pick one of those"
            )
        suffix = f".tmp{os.getpid()}"
        self._bin_tmp = data_path(prefix) + suffix
        self._idx_tmp = index_path(prefix) + suffix
        self._bin = open(self._bin_tmp, "wb")  # closed by finalize/abort
        # array('i'/'q') keeps millions of entries compact (4/8 bytes each, not a Python int)
        self._lengths = array("i")
        self._document_indices = array("q", [0])
        self._closed = False

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.finalize()
        except BaseException:
            self.abort()
            raise

    def _tokens(self, tokens: np.ndarray | list[int]) -> np.ndarray:
        """``tokens`` as a 1-D array of this dataset's dtype; an id that does not fit raises."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if arr.size and self.dtype.kind in "iu":
                info = np.iinfo(self.dtype)
                lo, hi = int(arr.min()), int(arr.max())
                if lo < info.min or hi > info.max:
                    raise ConfigError(
                        f"{data_path(self.prefix)}: token id {hi if hi > info.max else lo} does "
                        f"not fit {self.dtype}; write with int32 (best_dtype(vocab_size))"
                    )
            arr = arr.astype(self.dtype)
        return arr

    def add_sequence(self, tokens: np.ndarray | list[int]) -> None:
        """Append one sequence (a sentence, or a whole document) to the current document."""
        arr = self._tokens(tokens)
        self._bin.write(arr.tobytes())
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form one document."""
        self._document_indices.append(len(self._lengths))

    def add_document(self, sequences: list) -> None:
        """Append one document made of ``sequences`` (each a token array or list)."""
        for seq in sequences:
            self.add_sequence(seq)
        self.end_document()

    def add_documents(
        self, tokens: np.ndarray, sequence_lengths: np.ndarray, document_sizes: np.ndarray
    ) -> None:
        """Append whole documents at once: one write for many sequences.

        ``tokens`` holds every sequence back to back, ``sequence_lengths`` the length of each and
        ``document_sizes`` how many sequences each document has; the files are the same as from
        ``add_sequence`` and ``end_document`` called for each.
        """
        arr = self._tokens(tokens)
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        sizes = np.asarray(document_sizes, dtype=np.int64)
        if lengths.ndim != 1 or sizes.ndim != 1:
            raise ValueError("sequence_lengths and document_sizes must be 1-D")
        if lengths.sum() != arr.size or sizes.sum() != lengths.size:
            raise ValueError(
                f"{lengths.size} sequences of {lengths.sum()} tokens in {sizes.sum()} document "
                f"slots do not match {arr.size} tokens"
            )
        if (lengths.size and lengths.min() < 0) or (sizes.size and sizes.min() < 0):
            raise ValueError("sequence lengths and document sizes must be non-negative")
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a sequence is longer than the int32 length field allows")
        if self._document_indices[-1] != len(self._lengths):
            raise ValueError("end_document() the open document before adding whole documents")
        base = len(self._lengths)
        self._bin.write(arr.tobytes())
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self._document_indices.frombytes((np.cumsum(sizes) + base).tobytes())

    def add_dataset(self, prefix: str) -> None:
        """Append every document of the dataset at ``prefix`` (merging); copies the .bin bytes."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ConfigError(
                f"{index_path(prefix)}: tokens are {other.dtype} but this dataset writes "
                f"{self.dtype}; merge only datasets made with the same tokenizer"
            )
        if self._document_indices[-1] != len(self._lengths):
            raise ValueError("end_document() the open document before merging another dataset")
        base = len(self._lengths)
        self._lengths.frombytes(other.sequence_lengths.tobytes())
        self._document_indices.frombytes((other.document_indices[1:] + base).tobytes())
        self._bin.flush()
        with open(data_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._bin, 16 << 20)

    def finalize(self) -> None:
        """Write the .idx, fsync both files, then move .bin and .idx (in that order) into place."""
        if self._document_indices[-1] != len(self._lengths):
            raise ValueError(
                f"{self.prefix}: {len(self._lengths) - self._document_indices[-1]} sequences "
                "after the last end_document(); close the document first"
            )
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(self._idx_tmp, "wb") as f:
            f.write(
                _HEADER.pack(
                    MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(self._document_indices)
                )
            )
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.frombuffer(self._document_indices, dtype=np.int64).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, data_path(self.prefix))
        os.replace(self._idx_tmp, index_path(self.prefix))
        fsync_path(os.path.dirname(os.path.abspath(self.prefix)))
        self._closed = True

    def abort(self) -> None:
        """Discard everything written: close and remove the temporary files."""
        if self._closed:
            return
        # Closing flushes what is buffered, which fails again on a full disk: the file is closed
        # all the same, and removed below.
        with contextlib.suppress(OSError):
            self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)
        self._closed = True


def _map(path: str) -> mmap.mmap | bytes:
    """Read-only map of a whole file (mmap refuses empty files, which are valid here)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class IndexedDataset:
    """Memory-mapped reader of ``{prefix}.bin``/``.idx``; every array is a zero-copy view.

    Opening validates the header, the array sizes and the ``.bin`` size, and raises ConfigError
    naming the file and what is wrong. Pickles by prefix, so DataLoader workers re-map the files.
    """

    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray
    num_tokens: int

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx, bin_ = index_path(prefix), data_path(prefix)
        for path in (idx, bin_):
            if not os.path.isfile(path):
                raise ConfigError(
                    f"{path}: file not found; data paths are prefixes without .bin/.idx "
                    "(make them with tools/preprocess_data.py)"
                )
        self._idx_buf = _map(idx)
        self._parse_index(idx)
        bin_size = os.path.getsize(bin_)
        expected = self._expected_bin_size()
        if bin_size != expected:
            raise ConfigError(
                f"{bin_}: {bin_size} bytes but {idx} describes {expected} bytes of "
                f"{self.dtype} tokens; the .bin is truncated or belongs to another .idx, "
                "re-run preprocessing"
            )
        self._bin_buf = _map(bin_)
        self.num_tokens = bin_size // self.dtype.itemsize

    def _parse_index(self, idx: str) -> None:
        buf = self._idx_buf
        if len(buf) < _HEADER.size:
            raise ConfigError(
                f"{idx}: truncated ({len(buf)} bytes, header needs {_HEADER.size}); "
                "re-run preprocessing"
            )
        magic, version, code, count, doc_count = _HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise ConfigError(
                f"{idx}: not a Megatron MMIDIDX index (magic {magic!r}); "
                "make it with tools/preprocess_data.py"
            )
        if version != VERSION:
            raise ConfigError(f"{idx}: index version {version} is unsupported; only 1 is known")
        if code not in DTYPE_CODES:
            raise ConfigError(
                f"{idx}: unknown dtype code {code} (known: 1-8); the file is corrupted, "
                "re-run preprocessing"
            )
        expected = _HEADER.size + count * 4 + count * 8 + doc_count * 8
        if len(buf) != expected:
            raise ConfigError(
                f"{idx}: {len(buf)} bytes but its header ({count} sequences, {doc_count} "
                f"document indices) needs {expected}; the file is truncated or corrupted, "
                "re-run preprocessing"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(buf, np.int32, count, offset)
        offset += count * 4
        self.sequence_pointers = np.frombuffer(buf, np.int64, count, offset)
        offset += count * 8
        self.document_indices = np.frombuffer(buf, np.int64, doc_count, offset)
        docs = self.document_indices
        if doc_count == 0 or docs[0] != 0 or docs[-1] != count:
            raise ConfigError(
                f"{idx}: document indices must start at 0 and end at the sequence count "
                f"{count}; the file is corrupted, re-run preprocessing"
            )

    def _expected_bin_size(self) -> int:
        if len(self.sequence_lengths) == 0:
            return 0
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        if self.sequence_pointers[0] != 0 or self.sequence_lengths.min() < 0:
            raise ConfigError(
                f"{index_path(self.prefix)}: sequence pointers/lengths are inconsistent; "
                "the file is corrupted, re-run preprocessing"
            )
        return end

    def __len__(self) -> int:
        """The number of sequences."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """The number of documents."""
        return len(self.document_indices) - 1

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end if length is None).

        The result is a read-only view into the mapped ``.bin``: copy it before writing.
        """
        n = len(self.sequence_lengths)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {n} sequences in {self.prefix}")
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                f"of length {size} in {self.prefix}"
            )
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_buf, self.dtype, length, start)

    def __getitem__(self, idx: int) -> np.ndarray:
        """The whole sequence ``idx`` (a read-only view)."""
        return self.get(idx)

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])
