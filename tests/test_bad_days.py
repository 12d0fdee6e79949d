"""Bad days, tried as a user would (issue 37): an async save onto a full disk, a ``latest`` that
is a directory, a GPT-2 merges file of random bytes, a sampling temperature that is not a
positive number, ``--output`` naming a directory, and preprocessing input with no document.

Each ends in one line naming the file or flag and the fix, a non-zero exit (2: a mistake, 4:
the disk refused a write) and nothing left behind: no partial checkpoint, nothing written into a
directory the user named, no empty dataset. Every command runs as its own process on a real file
system (the full disk is a tmpfs, tests/small_disk.py).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.checkpoint.format import verify_checkpoint
from tests.distributed import free_port
from tests.gpt_run import ROOT, run_pretrain
from tests.test_preprocess_data import GPT2_FLAGS
from tests.test_storage_errors import (
    PRETRAIN,
    _in_namespace,
    _left_behind,
    _overrides,
    _refused,
    needs_small_disk,
)

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
VOCAB, MERGES = GPT2_FLAGS[3], GPT2_FLAGS[5]


def _python(*argv: str) -> subprocess.CompletedProcess:
    """``python argv`` from the repository root, as a user runs a tool."""
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )


def _one_line(done: subprocess.CompletedProcess, line: str, code: int = 2) -> None:
    """``done`` exited ``code`` with ``line`` as the only thing on stderr, no traceback."""
    assert done.returncode == code, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stderr.strip() == line, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr


def _tree(path: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) below ``path``."""
    found: dict[str, bytes | None] = {}
    for root, dirs, files in os.walk(path):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), path)] = None
        for name in files:
            full = os.path.join(root, name)
            found[os.path.relpath(full, path)] = Path(full).read_bytes()
    return found


@pytest.fixture(scope="module")
def saved(gpt_data, tmp_path_factory) -> Path:
    """A save directory of the tiny GPT at TP=1, written by pretrain_gpt.py at iteration 2."""
    run = tmp_path_factory.mktemp("saved")
    run_pretrain(PRETRAIN[1], PRETRAIN[3], _overrides(gpt_data, run, **{"training.train_iters": 2}))
    return run / "ckpt"


# 1. An async save onto a full disk ------------------------------------------------------------


def _async_full_disk(gpt_data, tmp_path: Path, saved: Path, tp: int) -> tuple[str, Path]:
    """The tiny GPT for 6 iterations saving asynchronously every 2 onto a disk with room for one
    checkpoint and a half: the save at 2 fits, the one at 4 (training goes on while it writes)
    does not. ``tp`` ranks, each launched as torchrun would (the environment, no agent, so each
    rank's own exit code is seen). Rank 0's output, exit codes and what the disk held."""
    ckpt, copy = tmp_path / "ckpt", tmp_path / "copy"
    keys = {"checkpoint.async_save": True, "training.train_iters": 6}
    overrides = _overrides(gpt_data, tmp_path, **keys, **{"parallel.tensor_parallel_size": tp})
    logs = [shlex.quote(str(tmp_path / f"rank{r}.log")) for r in range(tp)]
    ranks = "".join(f'RANK={r} LOCAL_RANK={r} "$@" >{logs[r]} 2>&1 & p{r}=$!; ' for r in range(tp))
    waits = "".join(f'wait $p{r}; echo "rank {r}: $?"; ' for r in range(tp))
    script = ranks + waits + f"cp -a {shlex.quote(str(ckpt))} {shlex.quote(str(copy))}"
    env = {"WORLD_SIZE": str(tp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    size = sum(p.stat().st_size for p in (saved / "iter_0000002").iterdir()) * 3 // 2
    done = _in_namespace(script, [*PRETRAIN, *overrides], ckpt, size, env=env)
    logs_text = [(tmp_path / f"rank{r}.log").read_text() for r in range(tp)]
    assert done.stdout.split("\n")[:tp] == [f"rank {r}: 4" for r in range(tp)], (
        done.stdout + done.stderr + "".join(t[-3000:] for t in logs_text)
    )
    for text in logs_text[1:]:
        assert "error:" not in text and "Traceback" not in text, text[-3000:]
    return logs_text[0], copy


@needs_small_disk
def test_an_async_save_onto_a_full_disk(gpt_data, tmp_path, saved):
    """Exit 4, one line naming the directory and the fix; no temporary directory, no
    iter_0000004; ``latest`` names 2, intact."""
    text, copy = _async_full_disk(gpt_data, tmp_path, saved, tp=1)
    _refused(text, tmp_path / "ckpt", 4, 2, "no space left on device")
    _left_behind(copy, 2)
    assert not (copy / "iter_0000004").exists()


@needs_small_disk
@pytest.mark.slow
def test_an_async_save_onto_a_full_disk_across_two_ranks(gpt_data, tmp_path, saved):
    """TP=2: both ranks exit 4, rank 0 prints the one line, rank 1 nothing; the checkpoint at 2
    is intact."""
    text, copy = _async_full_disk(gpt_data, tmp_path, saved, tp=2)
    _refused(text, tmp_path / "ckpt", 4, 2, "no space left on device")
    _left_behind(copy, 2)


# 2. `latest` a directory ----------------------------------------------------------------------


@pytest.fixture
def latest_a_directory(saved, tmp_path) -> Path:
    """A copy of ``saved`` whose ``latest`` is a directory (a stray ``mkdir``)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    (ckpt / "latest").unlink()
    (ckpt / "latest").mkdir()
    return ckpt


def _latest_line(ckpt: Path) -> str:
    return (
        f"error: {ckpt}/latest is a directory, not the file naming the latest checkpoint; "
        "remove it to resume from the newest complete iter_* directory"
    )


@pytest.mark.parametrize("key", ["checkpoint.save", "checkpoint.load"])
def test_latest_a_directory_at_training_start(gpt_data, tmp_path, latest_a_directory, key):
    """Resuming (``checkpoint.save``) or loading another run (``checkpoint.load``): exit 2, one
    line naming the path; the save directory is as it was (no new files, no lock)."""
    ckpt = latest_a_directory
    before = _tree(ckpt)
    keys = {"training.train_iters": 4, key: ckpt}
    if key == "checkpoint.load":
        keys["checkpoint.save"] = tmp_path / "new"
    overrides = _overrides(gpt_data, tmp_path / "run", **keys)
    done = _python(PRETRAIN[1], "--config", PRETRAIN[3], *overrides)
    _one_line(done, _latest_line(ckpt))
    assert _tree(ckpt) == before
    assert not (tmp_path / "new").exists()
    assert verify_checkpoint(str(ckpt / "iter_0000002")) is None


def test_latest_a_directory_in_generate(latest_a_directory):
    """tools/generate.py --load on that directory: the same line, exit 2."""
    done = _python("tools/generate.py", "--load", str(latest_a_directory), "--prompt", "x")
    _one_line(done, _latest_line(latest_a_directory))


# 3. A GPT-2 merges file of random bytes --------------------------------------------------------


@pytest.fixture
def random_merges(tmp_path) -> Path:
    path = tmp_path / "merges.txt"
    path.write_bytes(b"\xff\xfe" + os.urandom(4094))  # \xff is never UTF-8
    return path


def _merges_line(path: Path) -> str:
    return f"tokenizer.merges_file={path}: not UTF-8 text (byte 0); give GPT-2's merges.txt"


def test_random_merges_at_training_start(gpt_data, tmp_path, random_merges):
    """tokenizer.type=gpt2 with a merges file of random bytes: exit 2, one line naming the file;
    no run directory is made."""
    keys = {
        "tokenizer.type": "gpt2",
        "tokenizer.model": None,
        "tokenizer.vocab_file": VOCAB,
        "tokenizer.merges_file": random_merges,
    }
    overrides = _overrides(gpt_data, tmp_path / "run", **keys)
    done = _python(PRETRAIN[1], "--config", PRETRAIN[3], *overrides)
    _one_line(done, f"error: {_merges_line(random_merges)}")
    assert not (tmp_path / "run").exists()


def test_random_merges_in_preprocessing(tmp_path, random_merges):
    """tools/preprocess_data.py with --merge-file of random bytes: exit 2, one line, no output."""
    corpus = tmp_path / "in.jsonl"
    corpus.write_text(json.dumps({"text": "hello world"}) + "\n")
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB]
    out = tmp_path / "out" / "data"
    done = _python(
        "tools/preprocess_data.py",
        *["--input", str(corpus), "--output-prefix", str(out)],
        *[*flags, "--merge-file", str(random_merges)],
    )
    _one_line(done, _merges_line(random_merges))
    assert not (tmp_path / "out").exists()


# 4. A temperature that is not a positive number -----------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_generate_refuses_a_bad_temperature(saved, value):
    """--temperature nan, inf, -1 or 0: exit 2, one line naming the flag, before the load."""
    done = _python(
        "tools/generate.py", "--load", str(saved), "--prompt", "x", "--temperature", value
    )
    shown = float(value)
    line = (
        f"error: --temperature {shown}: must be a finite number > 0; leave the sampling flags "
        "out for greedy decoding"
    )
    _one_line(done, line)


# 5. --output naming an existing directory -----------------------------------------------------


def _output_line(directory: Path) -> str:
    return (
        f"error: --output {directory}: a directory; name a file to write, e.g. "
        f"{directory}/out.jsonl"
    )


def test_generate_output_a_directory(saved, tmp_path):
    """tools/generate.py --output DIR: exit 2, one line, nothing written into DIR."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "results"
    prompts.write_text(json.dumps({"prompt": "def"}) + "\n")
    out.mkdir()
    done = _python(
        "tools/generate.py", "--load", str(saved), "--input", str(prompts), "--output", str(out)
    )
    _one_line(done, _output_line(out))
    assert os.listdir(out) == []


def test_evaluate_output_a_directory(saved, tmp_path):
    """tools/evaluate.py --output DIR: exit 2, one line, nothing written into DIR."""
    text, out = tmp_path / "text.txt", tmp_path / "results"
    text.write_text("def main():\n    return 0\n" * 20)
    out.mkdir()
    done = _python(
        "tools/evaluate.py",
        *["--load", str(saved), "--task", "text", "--input", str(text), "--output", str(out)],
    )
    _one_line(done, _output_line(out))
    assert os.listdir(out) == []


# 6. Preprocessing input with no document ------------------------------------------------------


@pytest.mark.parametrize(
    "lines, skipped",
    [([], ""), (['{"text": ""}', '{"text": "  "}'], " (2 bad lines skipped)")],
    ids=["empty", "all-empty-documents"],
)
def test_preprocessing_no_document(tmp_path, lines, skipped):
    """An empty JSONL, or one whose documents are all empty (skipped with --skip-bad-lines):
    exit 2, one line, no dataset and no output directory."""
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "out" / "data"
    done = _python(
        "tools/preprocess_data.py",
        *["--input", str(corpus), "--output-prefix", str(out), *GPT2_FLAGS],
        *["--append-eod", "--skip-bad-lines"],
    )
    line = (
        f"--input {corpus}: no document with text under --json-keys text{skipped}; nothing "
        "written; give input that holds documents"
    )
    _one_line(done, line)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
