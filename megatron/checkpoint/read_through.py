"""Reading one tensor file in a single pass: its bytes go straight into the tensors that need
them, and through the checksum on the way, so verifying a file a rank reads costs no pass of its
own and no second copy.

A safetensors file is a little-endian u64 header size, a JSON header (per key: dtype, shape and
``data_offsets`` from the end of the header), then the data. It is read in file order: each
wanted tensor's bytes land in its tensor (``readinto`` from the page cache: the one copy), and
the header, the tensors nobody wants and any gap pass through a small scratch buffer only to be
hashed, so the digest covers every byte, as meta.json's checksum does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from threading import Event
from typing import BinaryIO

import torch
from torch import Tensor

from megatron.checkpoint.format import new_digest, parse_checksum
from megatron.errors import ConfigError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Bytes read and hashed at a time: small enough that the hash reads them from cache.
_CHUNK = 8 << 20


class DamagedFile(ConfigError):
    """A checkpoint file that is not what meta.json recorded: the checkpoint is not intact."""


class FileClaims:
    """Which of a checkpoint's files this rank verifies while reading them (``claim``), so its
    hashing thread, which waits for ``planned``, hashes only the rest of its share."""

    def __init__(self) -> None:
        self.planned = Event()
        self._taken: set[str] = set()

    def claim(self, name: str) -> bool:
        """Whether the caller now owns ``name``'s verification (False: someone else does)."""
        if name in self._taken:
            return False
        self._taken.add(name)
        return True


class _Malformed(Exception):
    """The bytes are not a safetensors file (or end early); the message says how."""


def _fill(f: BinaryIO, view: memoryview, digest) -> None:
    """Read exactly ``len(view)`` bytes into ``view``, hashing each chunk as it lands."""
    done = 0
    while done < len(view):
        part = view[done : done + _CHUNK]
        got = f.readinto(part)
        if not got:
            raise _Malformed("it ends early")
        if digest is not None:
            digest.update(part[:got])
        done += got


def _bytes_of(t: Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _Pass:
    """One pass over an open file: reads into tensors, or through scratch to hash only."""

    def __init__(self, f: BinaryIO, digest) -> None:
        self.f, self.digest = f, digest
        self.scratch = torch.empty(_CHUNK, dtype=torch.uint8)

    def into(self, t: Tensor) -> None:
        _fill(self.f, _bytes_of(t), self.digest)

    def skip(self, n: int) -> None:
        while n > 0:
            step = min(n, _CHUNK)
            _fill(self.f, _bytes_of(self.scratch[:step]), self.digest)
            n -= step


def _tensors(read: _Pass, size: int, wanted: Mapping[str, Tensor | None]) -> dict[str, Tensor]:
    """The wanted tensors, read in file order; every byte up to the data's end passes ``read``."""
    head = torch.empty(8, dtype=torch.uint8)
    read.into(head)
    n = int.from_bytes(head.numpy().tobytes(), "little")
    if n > size - 8:
        raise _Malformed(f"a header of {n} bytes in {size}")
    text = torch.empty(n, dtype=torch.uint8)
    read.into(text)
    try:
        header = json.loads(text.numpy().tobytes())
        header.pop("__metadata__", None)
        entries = sorted((tuple(v["data_offsets"]), k, v) for k, v in header.items())
    except (ValueError, TypeError, KeyError, AttributeError):
        raise _Malformed("its header is not safetensors JSON") from None
    out: dict[str, Tensor] = {}
    pos = 0
    for (start, end), key, info in entries:
        if start < pos or end < start:
            raise _Malformed(f"{key} overlaps another tensor")
        read.skip(start - pos)
        if key in wanted and info.get("dtype") in _DTYPES:
            t = wanted[key]
            if t is None:
                try:
                    t = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
                except (RuntimeError, TypeError, KeyError):
                    raise _Malformed(f"{key}'s shape {info.get('shape')!r}") from None
            if t.numel() * t.element_size() != end - start:
                raise _Malformed(f"{key}'s bytes disagree with its shape")
            read.into(t)
            out[key] = t
        else:
            read.skip(end - start)
        pos = end
    return out


def read_file(
    path: str, recorded: str | None, wanted: Mapping[str, Tensor | None]
) -> dict[str, Tensor]:
    """The ``wanted`` keys' tensors of the safetensors file ``path``, read in one pass: into the
    tensor given for a key (CPU, contiguous, the saved shape and dtype), else into a new one.
    ``recorded``: meta.json's checksum of the file, checked over every byte as they arrive
    (None: not checked); keys the file lacks are absent from the result.

    Raises DamagedFile (the checkpoint is not intact: load falls back to an older one) when the
    file does not match ``recorded``, and ConfigError when it does (or is not checked) but is not
    a safetensors file: one line each.
    """
    digest = None
    if recorded is not None:
        algorithm, expected = parse_checksum(recorded)
        digest = new_digest(algorithm)
    malformed = None
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        read = _Pass(f, digest)
        try:
            out = _tensors(read, size, wanted)
        except _Malformed as e:
            malformed = str(e)
        # The rest of the file too: a torn or tampered file then fails its checksum.
        read.skip(size - f.tell())
    if digest is not None and digest.hexdigest() != expected:
        raise DamagedFile(f"{path} does not match its {algorithm} checksum in meta.json")
    if malformed is not None:
        raise ConfigError(
            f"{path}: not a valid safetensors file ({malformed}); refusing to load it "
            "(checkpoints are never unpickled); restore the file or load another checkpoint"
        )
    return out
