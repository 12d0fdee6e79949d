"""A safetensors file written piece by piece straight from its tensors, and hashed as written.

The bytes are exactly ``safetensors.torch.save``'s (the header is the library's own, laid out
for the real shapes), so every reader of the format reads them; but no copy of the whole file is
ever made in memory, and its checksum (``format.CHECKSUM``) is taken by a second thread from the
very pieces written, while they are written: no second pass, no read-back.
"""

from __future__ import annotations

import json
import struct
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from safetensors.torch import save as serialize
from torch import Tensor

from megatron.atomic_file import write_durable
from megatron.checkpoint.format import checksum_text, new_digest

Buffer = bytes | memoryview
# Bytes of a tensor written and hashed at a time: the hashing thread follows each write closely.
_PIECE = 16 << 20
# Pieces the hashing thread may fall behind the writes; each holds its tensor (a device tensor's
# host copy) alive until hashed.
_HASH_LAG = 4


def _pieces(tensors: dict[str, Tensor], header: dict[str, str] | None) -> Iterator[Buffer]:
    """The bytes of ``safetensors.torch.save(tensors, header)``, a piece at a time, straight from
    the tensors: no copy of the file in memory (a device tensor comes to the host one by one)."""
    # The library lays out empty stand-ins: its order, dtype codes and metadata exactly as it
    # writes them; only the shapes and offsets are the real tensors'.
    stub = serialize({k: torch.empty(0, dtype=t.dtype) for k, t in tensors.items()}, header)
    (size,) = struct.unpack("<Q", stub[:8])
    layout = json.loads(stub[8 : 8 + size])
    order = [key for key in layout if key != "__metadata__"]
    offset = 0
    for key in order:
        end = offset + tensors[key].nbytes
        layout[key].update(shape=list(tensors[key].shape), data_offsets=[offset, end])
        offset = end
    text = json.dumps(layout, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the library's padding: data starts 8-byte aligned
    yield struct.pack("<Q", len(text)) + text
    for key in order:
        t = tensors[key].detach().cpu().contiguous()
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(data), _PIECE):
            yield data[start : start + _PIECE]


def write_tensors(
    path: str, tensors: dict[str, Tensor], header: dict[str, str] | None = None
) -> str:
    """Write a safetensors file straight from ``tensors`` and fsync it; its checksum as meta.json
    records it (``xxh3_128:<hex>``), hashed by a second thread from the very pieces written,
    while they are written (no read-back)."""
    digest = new_digest()
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as hasher:

        def hashed() -> Iterator[Buffer]:
            behind: deque[Future[None]] = deque()
            for piece in _pieces(tensors, header):
                behind.append(hasher.submit(digest.update, piece))
                if len(behind) > _HASH_LAG:
                    behind.popleft().result()
                yield piece

        write_durable(path, hashed())
    return checksum_text(digest.hexdigest())
