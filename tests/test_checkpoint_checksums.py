"""Checkpoint checksums: new checkpoints record ``xxh3_128:<hex>`` per file; checkpoints saved
before XXH3 (bare sha256 hex) still load and verify, and a flipped byte in one is still found and
the previous checkpoint used; an algorithm this code does not know is refused."""

import json
import os

import pytest

from megatron.checkpoint import load_checkpoint
from megatron.checkpoint.format import (
    CHECKSUM,
    file_checksum,
    parse_checksum,
    read_meta,
    sha256_file,
    shard_file,
    verify_checkpoint,
)
from megatron.checkpoint.train_state import TrainState
from megatron.errors import ConfigError
from megatron.parallel.state import initialize
from tests.distributed import run_distributed
from tests.test_checkpointing import (
    VOCAB,
    _flip_byte,
    build,
    same,
    save_two,
    snapshot,
    tiny_config,
)


def test_parse_checksum_names_the_algorithm_and_reads_bare_hex_as_sha256():
    assert parse_checksum("xxh3_128:00ff") == ("xxh3_128", "00ff")
    assert parse_checksum("ab" * 32) == ("sha256", "ab" * 32)
    assert CHECKSUM == "xxh3_128"


def _rewrite_files(ckpt: str, checksum) -> None:
    """meta.json's ``files`` recomputed by ``checksum`` (path -> the text meta.json records)."""
    meta = read_meta(ckpt)
    meta["files"] = {n: checksum(os.path.join(ckpt, n)) for n in meta["files"]}
    with open(os.path.join(ckpt, "meta.json"), "w") as f:
        json.dump(meta, f)


def _sha256_checkpoints(cfg, save_dir):
    st = initialize(1)
    states = save_two(cfg, st, save_dir)
    ckpts = {it: os.path.join(save_dir, f"iter_{it:07d}") for it in (1, 2)}
    out = {"new": read_meta(ckpts[2])["files"]}
    # Both as checkpoints saved before XXH3 recorded them: bare sha256 hex.
    for ckpt in ckpts.values():
        _rewrite_files(ckpt, sha256_file)
    out["old verify"] = verify_checkpoint(ckpts[2])

    def load() -> int:
        loaded = TrainState(*build(cfg, st, seed=7))
        load_checkpoint(save_dir, loaded, st, VOCAB)
        out[f"same {loaded.progress.iteration}"] = same(snapshot(loaded.model), states[2])
        return loaded.progress.iteration

    out["old loads"] = load()
    _flip_byte(os.path.join(ckpts[2], shard_file(0)))
    out["tampered verify"] = verify_checkpoint(ckpts[2])
    out["tampered loads"] = load()
    # An algorithm this code does not know: refused, never taken as intact.
    _rewrite_files(ckpts[1], lambda p: f"md5:{file_checksum(p).partition(':')[2]}")
    try:
        read_meta(ckpts[1])
    except ConfigError as e:
        out["unknown"] = str(e)
    return out


@pytest.mark.slow
def test_sha256_checkpoint_loads_and_a_flipped_byte_is_found(tmp_path):
    cfg = tiny_config(tmp_path)
    out = run_distributed(_sha256_checkpoints, 1, cfg, str(tmp_path / "ckpt"))[0]
    assert all(parse_checksum(s)[0] == "xxh3_128" for s in out["new"].values()), out["new"]
    assert out["old verify"] is None
    assert out["old loads"] == 2 and out["same 2"]
    assert "does not match its sha256 checksum" in out["tampered verify"]
    assert out["tampered loads"] == 1  # the previous checkpoint, sha256-verified
    assert "'md5:" in out["unknown"] and "does not know" in out["unknown"]
