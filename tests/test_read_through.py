"""One pass per file: a rank's own checkpoint file goes straight into its parameters and through
its checksum on the way (megatron/checkpoint/read_through.py), and every byte still counts."""

import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

from megatron.checkpoint import load, load_checkpoint
from megatron.checkpoint.format import file_checksum, sha256_file, shard_file
from megatron.checkpoint.read_through import DamagedFile, read_file
from megatron.checkpoint.train_state import TrainState
from megatron.errors import ConfigError
from megatron.parallel.state import initialize
from tests.distributed import run_distributed
from tests.test_checkpointing import VOCAB, build, same, save_two, snapshot, tiny_config


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(64, 48, generator=g).bfloat16(),
        "b": torch.randn(1000, generator=g),
        "c": torch.randn(7, 3, generator=g).double(),
        "step": torch.tensor(12, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
    }


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("checksum", [file_checksum, sha256_file])
def test_wanted_tensors_land_in_the_given_ones_and_the_rest_is_only_hashed(tmp_path, checksum):
    path = str(tmp_path / "t.safetensors")
    saved = _tensors()
    save_file(saved, path)
    into = torch.empty(64, 48, dtype=torch.bfloat16)
    out = read_file(path, checksum(path), {"a": into, "b": None, "step": None, "mask": None})
    assert out["a"] is into and "c" not in out
    assert all(torch.equal(out[k], saved[k]) for k in out)


def test_a_flipped_bit_anywhere_is_found(tmp_path):
    path = str(tmp_path / "t.safetensors")
    save_file(_tensors(), path)
    recorded, size = file_checksum(path), os.path.getsize(path)
    # The header's size field, the header, a wanted tensor, a tensor nobody wants, the last byte.
    for offset in (0, 20, size // 3, size // 2, size - 1):
        _flip(path, offset)
        with pytest.raises(DamagedFile, match="does not match its xxh3_128 checksum"):
            read_file(path, recorded, {"a": None})
        _flip(path, offset)
    assert set(read_file(path, recorded, {"a": None})) == {"a"}
    _flip(path, size - 1)
    assert set(read_file(path, None, {"a": None})) == {"a"}  # unchecked: nothing to compare


def test_a_truncated_file_is_damaged_and_a_pickle_is_refused_as_such(tmp_path):
    path = str(tmp_path / "t.safetensors")
    save_file(_tensors(), path)
    recorded = file_checksum(path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(DamagedFile):
        read_file(path, recorded, {"a": None})
    # A header whose shape no tensor can have, summed as it is: refused in one line.
    header = b'{"a":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}}'
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(ConfigError, match="not a valid safetensors file"):
        read_file(path, file_checksum(path), {"a": None})
    # Bytes whose checksum matches but are no safetensors file: refused, never unpickled.
    with open(path, "wb") as f:
        f.write(pickle.dumps({"weights": [1, 2, 3]}))
    with pytest.raises(ConfigError) as err:
        read_file(path, file_checksum(path), {"a": None})
    assert not isinstance(err.value, DamagedFile)
    assert "not a valid safetensors file" in str(err.value) and "never unpickled" in str(err.value)


def _resume(cfg, save_dir):
    st = initialize(1)
    states = save_two(cfg, st, save_dir)
    hashed: list[str] = []
    check = load.check_files

    def spy(path, meta, names, hashes=True):
        hashed.extend(names if hashes else [])
        return check(path, meta, names, hashes)

    load.check_files = spy
    loaded = TrainState(*build(cfg, st, seed=7))
    live = {k: t.data_ptr() for k, t in loaded.model.state_dict().items()}
    given: dict[str, int] = {}
    # load_state_dict only records what it is given: the weights must already be in place.
    loaded.model.load_state_dict = lambda w: given.update((k, t.data_ptr()) for k, t in w.items())
    targets = {}
    allocate = loaded.optimizer.load_targets
    loaded.optimizer.load_targets = lambda names: targets.update(allocate(names)) or targets
    load_checkpoint(save_dir, loaded, st, VOCAB)
    out = {"same": same(snapshot(loaded.model), states[2]), "given": given == live}
    kept = loaded.optimizer.state_dict()["params"]
    out["moments kept"] = bool(targets) and all(
        kept[n][f] is t for n, fields in targets.items() for f, t in fields.items()
    )
    out["hashed"] = hashed
    # A flipped byte in the file read straight into the parameters: the previous checkpoint.
    path = os.path.join(save_dir, "iter_0000002", shard_file(0))
    _flip(path, os.path.getsize(path) // 2)
    hashed.clear()
    loaded = TrainState(*build(cfg, st, seed=7))
    load_checkpoint(save_dir, loaded, st, VOCAB)
    out["fallback"] = (loaded.progress.iteration, same(snapshot(loaded.model), states[1]))
    return out


@pytest.mark.slow
def test_a_resume_reads_its_file_once_into_the_parameters(tmp_path):
    cfg = tiny_config(tmp_path)
    out = run_distributed(_resume, 1, cfg, str(tmp_path / "ckpt"))[0]
    # Every weight was read into its parameter's own memory: loading it is a copy onto itself.
    assert out["same"] and out["given"]
    # A fresh optimizer's Adam moments were allocated once and read into: no second copy.
    assert out["moments kept"]
    # The model file was checked as it was read; the hashing thread took only the rest.
    assert shard_file(0) not in out["hashed"] and "rng_rank00000.safetensors" in out["hashed"]
    assert out["fallback"] == (1, True)
