"""Streamed checkpoint files: what ``write_tensors`` writes piece by piece is exactly the file
``safetensors.torch.save`` makes, its sum is the file's XXH3-128, the pieces are the tensors' own
memory, and a checkpoint whose files safetensors itself wrote (as every save before streaming
did) still loads."""

import json
import os
import struct

import numpy as np
import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file
from safetensors.torch import save as safetensors_save

from megatron.checkpoint import load_checkpoint, save_checkpoint, streamed_file
from megatron.checkpoint.format import file_checksum, read_meta, sha256_file
from megatron.checkpoint.train_state import Progress, TrainState
from megatron.parallel.state import initialize
from tests.distributed import run_distributed
from tests.test_checkpointing import VOCAB, build, same, snapshot, tiny_config, train


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model/w": torch.randn(5, 7, generator=g),
        "model/h": torch.randn(6, 3, generator=g).half().t(),  # not contiguous
        "optim/b": torch.randn(9, generator=g).bfloat16(),
        "step": torch.tensor(3),  # 0-dim
        "ids": torch.arange(11),
        "mask": torch.rand(4, generator=g) > 0.5,
        "rng": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
        "empty": torch.zeros(0, 2),
        'odd "name"\n\u00e9': torch.randn(2, dtype=torch.float64, generator=g),
    }


def _header(data: bytes) -> dict:
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size])


@pytest.mark.parametrize("metadata", [None, {}, {"python": 'x"\\\n\x01\u00fc'}])
def test_streamed_file_is_byte_identical_to_safetensors_save(tmp_path, monkeypatch, metadata):
    monkeypatch.setattr(streamed_file, "_PIECE", 7)  # pieces that split tensors unevenly
    tensors, path = _tensors(), str(tmp_path / "f.safetensors")
    digest = streamed_file.write_tensors(path, tensors, metadata)
    written = open(path, "rb").read()
    assert written == safetensors_save({k: v.contiguous() for k, v in tensors.items()}, metadata)
    assert digest == f"xxh3_128:{xxhash.xxh3_128(written).hexdigest()}" == file_checksum(path)


def test_several_metadata_keys_lay_out_as_safetensors_does(tmp_path):
    # safetensors orders several metadata keys as its hash map iterates (it varies from run to
    # run): the header matches as JSON, and everything after it byte for byte.
    tensors, path = _tensors(), str(tmp_path / "f.safetensors")
    metadata = {"python": "[1, 2]", "numpy": "[3]", "z": ""}
    streamed_file.write_tensors(path, tensors, metadata)
    written = open(path, "rb").read()
    reference = safetensors_save({k: v.contiguous() for k, v in tensors.items()}, metadata)
    assert len(written) == len(reference) and _header(written) == _header(reference)
    start = 8 + struct.unpack("<Q", reference[:8])[0]
    assert written[start:] == reference[start:]
    assert all(torch.equal(v, tensors[k]) for k, v in load_file(path).items())


def test_pieces_are_the_tensors_own_memory():
    tensors = {"a": torch.randn(1000), "b": torch.randn(10, 10)}
    pieces = list(streamed_file._pieces(tensors, None))[1:]  # after the header
    addresses = [np.frombuffer(p, dtype=np.uint8).ctypes.data for p in pieces]
    assert addresses == [tensors["a"].data_ptr(), tensors["b"].data_ptr()]


def _load_files_safetensors_wrote(cfg, save_dir):
    st = initialize(1)
    model, optimizer, schedule, tracker = build(cfg, st)
    train(model, optimizer, schedule, 2, seed=0)
    saved = snapshot(model)
    save_checkpoint(
        save_dir, TrainState(model, optimizer, schedule, tracker, Progress(2)), cfg, st, VOCAB
    )
    ckpt = os.path.join(save_dir, "iter_0000002")
    meta = read_meta(ckpt)
    for name in meta["files"]:
        path = os.path.join(ckpt, name)
        with open(path, "rb") as f:
            header = _header(f.read()).get("__metadata__")
        save_file(load_file(path), path, header)  # the library's own writer, as before streaming
        meta["files"][name] = sha256_file(path)
    with open(os.path.join(ckpt, "meta.json"), "w") as f:
        json.dump(meta, f)
    probe = TrainState(*build(cfg, st, seed=7))
    load_checkpoint(save_dir, probe, st, VOCAB)
    return same(snapshot(probe.model), saved), probe.progress.iteration


@pytest.mark.slow
def test_a_checkpoint_whose_files_safetensors_wrote_loads(tmp_path):
    cfg = tiny_config(tmp_path)
    loaded, iteration = run_distributed(_load_files_safetensors_wrote, 1, cfg, str(tmp_path / "c"))[
        0
    ]
    assert loaded and iteration == 2
