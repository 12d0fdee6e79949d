"""A disk that fills or turns read-only under a save, an offline conversion or preprocessing, and
a damaged ``.gz`` input: one line, the documented exit code, nothing partial left, the previous
checkpoint still loads.

The disks are real tmpfs mounts (tests/small_disk.py) and each command runs inside the mount's
namespace, so what it left there is copied out (``cp -a``) before the mount goes away.
"""

from __future__ import annotations

import gzip
import os
import re
import shlex
import sys
import zlib
from pathlib import Path

import pytest

from megatron.checkpoint.format import verify_checkpoint
from tests.distributed import free_port
from tests.gpt_run import ROOT, run_pretrain, tiny_overrides
from tests.small_disk import SKIP_REASON, run_on_small_disk
from tests.test_preprocess_data import GPT2_FLAGS
from tools.preprocess_data import main as preprocess_main

needs_small_disk = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
PRETRAIN = [sys.executable, "pretrain_gpt.py", "--config", "configs/gpt_tiny.yaml"]


def _overrides(gpt_data: dict, run: Path, **extra: object) -> list[str]:
    """The tiny GPT at TP=1 saving into ``run/ckpt`` at iterations 2 and 4, no evaluation."""
    keys = {
        "parallel.tensor_parallel_size": 1,
        "training.train_iters": 4,
        "optimizer.lr_warmup_iters": 1,
        "training.eval_interval": 1000,
        "checkpoint.save_interval": 2,
        "checkpoint.save": run / "ckpt",
        **extra,
    }
    return tiny_overrides(gpt_data, run, **keys)


def _in_namespace(script: str, argv: list[str], mount: Path, size: int, **kw):
    """``sh -c script`` with ``argv`` as its "$@", a ``size``-byte tmpfs at ``mount``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **kw.pop("env", {})}
    command = ["sh", "-c", script, "sh", *argv]
    return run_on_small_disk(command, str(mount), size, env=env, cwd=str(ROOT), **kw)


@pytest.fixture(scope="module")
def measured(gpt_data, tmp_path_factory) -> Path:
    """The save directory of a real run of the tiny GPT that saved at iteration 2 and stopped."""
    run = tmp_path_factory.mktemp("measure")
    run_pretrain(PRETRAIN[1], PRETRAIN[3], _overrides(gpt_data, run, **{"training.train_iters": 2}))
    return run / "ckpt"


@pytest.fixture(scope="module")
def checkpoint_bytes(measured) -> int:
    """The bytes of one checkpoint of the tiny GPT."""
    return sum(p.stat().st_size for p in (measured / "iter_0000002").iterdir())


def _pages(files) -> int:
    """The 4 KiB pages a tmpfs takes to hold ``files``."""
    return sum(-(-p.stat().st_size // 4096) for p in files if p.is_file())


def _refused(text: str, ckpt: Path, iteration: int, kept: int, reason: str) -> tuple[float, float]:
    """Asserts ``text`` holds rank 0's one line for a refused save and no traceback; the MiB it
    says the checkpoint needs and the MiB free."""
    fix = "free space" if reason == "no space left on device" else "make it writable"
    line = re.escape(
        f"error: checkpoint.save: cannot write {ckpt}/iter_{iteration:07d} ({reason}: needs about "
    )
    line += r"([\d.]+) MiB, ([\d.]+) MiB free\); "
    line += re.escape(
        f"iter_{kept:07d} is still the latest; {fix} or set checkpoint.save elsewhere"
    )
    found = re.findall(f"^{line}$", text, re.MULTILINE)
    assert len(found) == 1 and text.count("error:") == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    return float(found[0][0]), float(found[0][1])


def _left_behind(copy: Path, kept: int) -> None:
    """Asserts the save directory holds no temporary directory and ``latest`` names ``kept``,
    intact (meta.json and every file's sha256)."""
    assert not [n for n in os.listdir(copy) if ".tmp-" in n], os.listdir(copy)
    assert (copy / "latest").read_text() == f"{kept}\n"
    assert verify_checkpoint(str(copy / f"iter_{kept:07d}")) is None


def _refusal(read_only: bool) -> tuple[str, str]:
    """The reason a full (or read-only) disk gives, and the fix its line suggests."""
    if read_only:
        return "read-only file system", "make it writable"
    return "no space left on device", "free space"


@needs_small_disk
# The synchronous case also resumes from what the failed run left: two runs, >10 s.
@pytest.mark.parametrize(
    "async_save",
    [pytest.param(False, marks=pytest.mark.slow, id="sync"), pytest.param(True, id="async")],
)
def test_a_full_disk_at_a_save_is_one_line_and_the_last_checkpoint_stays(
    gpt_data, tmp_path, checkpoint_bytes, async_save
):
    """The disk holds one checkpoint and a half: the save at 2 fits, the save at 4 does not.
    Exit 4, one line, no temporary directory; ``latest`` names 2, intact, and (sync) a run on a
    disk with room resumes it."""
    ckpt, copy = tmp_path / "ckpt", tmp_path / "copy"
    overrides = _overrides(gpt_data, tmp_path, **{"checkpoint.async_save": async_save})
    script = f'"$@"; rc=$?; cp -a {shlex.quote(str(ckpt))} {shlex.quote(str(copy))}; exit $rc'
    done = _in_namespace(script, [*PRETRAIN, *overrides], ckpt, checkpoint_bytes * 3 // 2)
    assert done.returncode == 4, done.stderr[-3000:]
    needed, free = _refused(done.stdout + done.stderr, ckpt, 4, 2, "no space left on device")
    assert free < needed and abs(needed * 2**20 - checkpoint_bytes) < 0.1 * checkpoint_bytes
    _left_behind(copy, 2)
    if not async_save:  # the same checkpoint, now on a disk with room, resumes
        resumed = run_pretrain(
            PRETRAIN[1],
            PRETRAIN[3],
            _overrides(gpt_data, tmp_path, **{"checkpoint.save": copy, "training.train_iters": 3}),
        )
        assert f"resumed from {copy} at iteration 2" in resumed.stdout + resumed.stderr


@needs_small_disk
def test_a_disk_that_fills_at_latest_takes_the_save_back(gpt_data, tmp_path, measured):
    """One page short of the second save: its files and meta.json fit and it is renamed into
    place, but ``latest``'s new copy (written beside the old one) does not. The directory is
    taken back out: exit 4, one line, no iter_0000004, ``latest`` names 2."""
    ckpt, copy = tmp_path / "ckpt", tmp_path / "copy"
    # What the first run left (the checkpoint at 2, latest, the resolved config), the second
    # checkpoint, run.lock and latest's new copy; less one page.
    pages = _pages(measured.iterdir()) + _pages((measured / "iter_0000002").iterdir()) * 2 + 1
    script = f'"$@"; rc=$?; cp -a {shlex.quote(str(ckpt))} {shlex.quote(str(copy))}; exit $rc'
    done = _in_namespace(script, [*PRETRAIN, *_overrides(gpt_data, tmp_path)], ckpt, pages << 12)
    assert done.returncode == 4, done.stderr[-3000:]
    _refused(done.stdout + done.stderr, ckpt, 4, 2, "no space left on device")
    _left_behind(copy, 2)
    assert not (copy / "iter_0000004").exists()


@needs_small_disk
@pytest.mark.slow
def test_a_disk_turned_read_only_before_a_save(gpt_data, tmp_path):
    """The disk is remounted read-only once the save at 30 is published, 30 iterations before
    the next (the save at 60): exit 4, one line, ``latest`` still names 30."""
    ckpt, copy = tmp_path / "ckpt", tmp_path / "copy"
    at = {"training.train_iters": 60, "checkpoint.save_interval": 30, "logging.log_interval": 30}
    ck, out = shlex.quote(str(ckpt)), shlex.quote(str(copy))
    script = (
        f'"$@" & pid=$!; until [ -e {ck}/latest ] || ! kill -0 $pid 2>/dev/null; do sleep 0.05; '
        f"done; mount -o remount,ro {ck}; wait $pid; rc=$?; cp -a {ck} {out}; exit $rc"
    )
    done = _in_namespace(script, [*PRETRAIN, *_overrides(gpt_data, tmp_path, **at)], ckpt, 50 << 20)
    assert done.returncode == 4, done.stderr[-3000:]
    _refused(done.stdout + done.stderr, ckpt, 60, 30, "read-only file system")
    _left_behind(copy, 30)


@needs_small_disk
@pytest.mark.slow
def test_a_full_disk_at_a_save_across_two_ranks(gpt_data, tmp_path, checkpoint_bytes):
    """TP=2, each rank writing its half into the same full disk, launched as torchrun would (the
    environment, no agent, so each rank's own exit code is seen): both exit 4, rank 0 prints the
    one line, rank 1 nothing, and the checkpoint at 2 is intact."""
    ckpt, copy = tmp_path / "ckpt", tmp_path / "copy"
    overrides = _overrides(gpt_data, tmp_path, **{"parallel.tensor_parallel_size": 2})
    logs = [shlex.quote(str(tmp_path / f"rank{r}.log")) for r in (0, 1)]
    script = (
        f'RANK=0 LOCAL_RANK=0 "$@" >{logs[0]} 2>&1 & a=$!; '
        f'RANK=1 LOCAL_RANK=1 "$@" >{logs[1]} 2>&1 & b=$!; '
        'wait $a; echo "rank 0: $?"; wait $b; echo "rank 1: $?"; '
        f"cp -a {shlex.quote(str(ckpt))} {shlex.quote(str(copy))}"
    )
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    size = checkpoint_bytes * 3 // 2
    done = _in_namespace(script, [*PRETRAIN, *overrides], ckpt, size, env=env)
    assert done.stdout.split("\n")[:2] == ["rank 0: 4", "rank 1: 4"], done.stdout + done.stderr
    rank0, rank1 = ((tmp_path / f"rank{r}.log").read_text() for r in (0, 1))
    _refused(rank0, ckpt, 4, 2, "no space left on device")
    assert "error:" not in rank1 and "Traceback" not in rank1, rank1[-3000:]
    _left_behind(copy, 2)


@needs_small_disk
@pytest.mark.parametrize("read_only", [False, True], ids=["full", "read-only"])
def test_preprocessing_onto_a_full_or_read_only_disk(gpt_data, tmp_path, read_only):
    """0.5 MB of JSONL makes ~0.6 MB of tokens: onto 0.4 MB the second chunk does not fit, and a
    read-only disk takes nothing. Exit 4, one line naming the output prefix, nothing left there."""
    corpus = str(Path(gpt_data["data"]).parent / "corpus.jsonl")
    out = tmp_path / "out"
    tool = [sys.executable, "tools/preprocess_data.py", "--input", corpus, *GPT2_FLAGS]
    # No progress lines: stderr is the error alone.
    tool += ["--output-prefix", str(out / "corpus"), "--workers", "2", "--log-interval", "10000"]
    script = f'"$@"; rc=$?; ls -A {shlex.quote(str(out))}; exit $rc'
    done = _in_namespace(script, tool, out, 400_000, read_only=read_only)
    assert done.returncode == 4, done.stderr[-3000:]
    reason, fix = _refusal(read_only)
    line = re.escape(f"--output-prefix {out}/corpus: cannot write there ({reason}: ")
    line += r"([\d.]+) MiB written, [\d.]+ MiB free\); "
    line += re.escape(f"no partial output is left; {fix} or give another --output-prefix")
    found = re.fullmatch(line, done.stderr.strip())
    assert found, done.stderr[-3000:]
    assert (float(found[1]) == 0) == read_only  # a full disk took the first chunk
    assert done.stdout == ""  # ls: no .bin, .idx, sidecar or temporary file


@needs_small_disk
@pytest.mark.parametrize("read_only", [False, True], ids=["full", "read-only"])
def test_a_conversion_onto_a_full_or_read_only_disk(
    measured, checkpoint_bytes, tmp_path, read_only
):
    """tools/checkpoint_util.py --merge (megatron.checkpoint.save_offline, the HF import's save
    too) onto a disk of half a checkpoint, or a read-only one: exit 4, one line naming the
    checkpoint, the bytes it needs and those free; no file or temporary directory left."""
    disk = tmp_path / "disk"
    tool = [sys.executable, "tools/checkpoint_util.py", "--input", str(measured), "--merge"]
    tool += ["--output", str(disk / "merged")]
    script = f'"$@"; rc=$?; ls -A {shlex.quote(str(disk / "merged"))} 2>/dev/null; exit $rc'
    done = _in_namespace(script, tool, disk, checkpoint_bytes // 2, read_only=read_only)
    assert done.returncode == 4, done.stderr[-3000:]
    reason, fix = _refusal(read_only)
    line = re.escape(f"error: cannot write {disk}/merged/iter_0000002 ({reason}: needs about ")
    line += r"([\d.]+) MiB, ([\d.]+) MiB free\); "
    line += re.escape(f"nothing of it is left; {fix} or write it elsewhere")
    found = re.fullmatch(line, done.stderr.strip())
    assert found, done.stderr[-3000:]
    needed, free = float(found[1]), float(found[2])
    assert abs(needed * 2**20 - checkpoint_bytes) < 0.1 * checkpoint_bytes
    assert read_only or free < needed
    assert done.stdout == ""  # ls: no temporary directory, no iter_*, no latest


@pytest.mark.parametrize(
    "damage,workers", [("truncated", "1"), ("truncated", "2"), ("corrupt", "1")]
)
def test_a_truncated_or_corrupt_gz_input(gpt_data, tmp_path, capsys, damage, workers):
    """A .jsonl.gz cut in half, or whose CRC does not match (a flipped byte of its trailer): exit
    2, one line naming the file and the last line read whole (every complete line zlib recovers),
    nothing written."""
    text = (Path(gpt_data["data"]).parent / "corpus.jsonl").read_bytes()
    data = gzip.compress(text)
    if damage == "truncated":
        data = data[: len(data) // 2]
        text = zlib.decompressobj(wbits=31).decompress(data)
    else:  # the trailer: CRC32, then the size, 4 bytes each
        data = data[:-8] + bytes([data[-8] ^ 0xFF]) + data[-7:]
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(data)
    prefix = tmp_path / "out" / "corpus"
    argv = ["--input", str(path), "--output-prefix", str(prefix), *GPT2_FLAGS, "--workers", workers]
    assert preprocess_main([*argv, "--log-interval", "10000"]) == 2
    err = capsys.readouterr().err.strip()
    line = r"after line (\d+); re-download or re-compress it"
    found = re.fullmatch(re.escape(f"{path}: truncated or corrupt gzip stream ") + line, err)
    assert found, err
    assert int(found[1]) == text.count(b"\n") > 0
    assert not (tmp_path / "out").exists()  # the directory it made for the output is gone too
