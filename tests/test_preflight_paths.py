"""What preflight refuses before any model or process group, run as a user runs it (plain
``python pretrain_gpt.py``): a key or section given twice, a number that is not finite, an
output path of the wrong kind, and outputs on storage that cannot be written (a real read-only
tmpfs, tests/small_disk.py). Each is one ``error:`` line naming the culprit, no traceback, exit 2.
And the warning when ``checkpoint.save``'s disk has no room for two checkpoints.

``BAD_INPUTS`` is meant for reuse (e.g. under torchrun): format each with ``argv_of``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.gpt_run import ROOT, tiny_overrides
from tests.small_disk import SKIP_REASON, run_on_small_disk


@dataclass(frozen=True)
class BadInput:
    """One mistake. In ``overrides`` and ``expected``: ``{tmp}`` is a writable directory holding
    a file ``file``; ``{ro}`` a read-only disk holding a copy of the data (``{ro}/corpus``)."""

    name: str
    expected: str  # in the error line
    overrides: tuple[str, ...] = ()
    yaml: str = ""  # a config file layered over configs/gpt_tiny.yaml

    @property
    def read_only(self) -> bool:
        return "{ro}" in "".join(self.overrides)


BAD_INPUTS = [
    BadInput(
        "duplicate section",
        "{tmp}/extra.yaml:5: duplicate key training (first at line 1); merge the two",
        yaml="training:\n  seed: 1\nmodel:\n  num_layers: 2\ntraining:\n  seed: 2\n",
    ),
    BadInput(
        "duplicate key",
        "{tmp}/extra.yaml:3: duplicate key model.num_layers (first at line 2); merge the two",
        yaml="model:\n  num_layers: 2\n  num_layers: 3\n",
    ),
    BadInput(
        "lr=inf",
        "override 'optimizer.lr=inf': optimizer.lr=inf is not a finite number; give a finite value",
        ("optimizer.lr=inf",),
    ),
    BadInput(
        "nan in YAML",
        "{tmp}/extra.yaml:2: optimizer.weight_decay=nan is not a finite number; give a finite "
        "value",
        yaml="optimizer:\n  weight_decay: .nan\n",
    ),
    BadInput(
        "directory as metrics_file",
        "logging.metrics_file: {tmp} is a directory; give the path of a file",
        ("logging.metrics_file={tmp}",),
    ),
    BadInput(
        "file as tensorboard_dir",
        "logging.tensorboard_dir: {tmp}/file is a file; give the path of a directory",
        ("logging.tensorboard_dir={tmp}/file",),
    ),
    BadInput(
        "file as cache_dir",
        "data.cache_dir: {tmp}/file is a file; give the path of a directory",
        ("data.cache_dir={tmp}/file",),
    ),
    BadInput(
        "file above checkpoint.save",
        "checkpoint.save: cannot create {tmp}/file/ckpt: {tmp}/file is a file; fix the path",
        ("checkpoint.save={tmp}/file/ckpt",),
    ),
    BadInput(
        "read-only data, default cache dir",
        "data.cache_dir: cannot write {ro}/index-cache ({ro} is on a read-only file system); "
        "set data.cache_dir to a writable directory",
        ("data.paths=[{ro}/corpus]", "data.cache_dir=null"),
    ),
    BadInput(
        "read-only checkpoint.save",
        "checkpoint.save: cannot write {ro}/ckpt ({ro} is on a read-only file system); "
        "set checkpoint.save to a writable directory",
        ("checkpoint.save={ro}/ckpt",),
    ),
]


def one_step(data: dict[str, str], tmp: Path, *args: str) -> list[str]:
    """``pretrain_gpt.py`` on one process for one step of the tiny GPT, its outputs under
    ``tmp``, then ``args`` (later overrides win)."""
    keys = {"parallel.tensor_parallel_size": 1, "training.train_iters": 1}
    keys.update({"training.eval_iters": 0, "optimizer.lr_warmup_iters": 0})
    config = ["--config", "configs/gpt_tiny.yaml"]
    return [sys.executable, "pretrain_gpt.py", *config, *tiny_overrides(data, tmp, **keys), *args]


def argv_of(bad: BadInput, data: dict[str, str], tmp: Path, ro: Path) -> list[str]:
    """``one_step`` with the mistake ``bad`` (its ``extra.yaml`` and ``{tmp}/file`` written)."""
    (tmp / "file").touch()
    configs = []
    if bad.yaml:
        (tmp / "extra.yaml").write_text(bad.yaml)
        configs = ["--config", str(tmp / "extra.yaml")]
    return one_step(data, tmp, *configs, *(o.format(tmp=tmp, ro=ro) for o in bad.overrides))


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _on_read_only_disk(
    data: dict[str, str], ro: Path, *commands: list[str]
) -> subprocess.CompletedProcess:
    """``commands`` in turn (while each succeeds) with a fresh tmpfs at ``ro`` holding a copy of
    the data as ``{ro}/corpus``, remounted read-only before the last command."""
    prefix = shlex.quote(data["data"])
    steps = [f"for e in bin idx json; do cp {prefix}.$e {ro}/corpus.$e; done"]
    steps += [shlex.join(c) for c in commands[:-1]]
    steps += [f"mount -o remount,ro {ro}", f"exec {shlex.join(commands[-1])}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_on_small_disk(["sh", "-c", " && ".join(steps)], str(ro), 16 << 20, env=env, cwd=ROOT)


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=[b.name for b in BAD_INPUTS])
def test_a_bad_input_is_one_error_line(bad, gpt_data, tmp_path):
    if bad.read_only and SKIP_REASON:
        pytest.skip(SKIP_REASON)
    tmp, ro = tmp_path / "run", tmp_path / "ro"
    tmp.mkdir()
    command = argv_of(bad, gpt_data, tmp, ro)
    out = _on_read_only_disk(gpt_data, ro, command) if bad.read_only else _run(command)
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"error: {bad.expected.format(tmp=tmp, ro=ro)}"], out.stderr
    assert "Traceback" not in out.stderr + out.stdout and "iteration" not in out.stdout


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
def test_a_prebuilt_read_only_cache_is_read(gpt_data, tmp_path):
    """A complete index cache is read without writing: on read-only data storage the default
    cache, built by a first run, serves a second."""
    ro = tmp_path / "ro"
    command = one_step(gpt_data, tmp_path, f"data.paths=[{ro}/corpus]", "data.cache_dir=null")
    out = _on_read_only_disk(gpt_data, ro, command, ["echo", "second run"], command)
    assert out.returncode == 0, out.stdout + out.stderr
    first, second = out.stdout.split("second run\n")
    assert "built gpt indices" in first and f"{ro}/index-cache/" in first
    assert "iteration:        1/       1" in second and "built " not in second


SMALL_DISK = 5 << 19  # 2.5 MiB: room for one checkpoint of the tiny GPT (1.6 MiB), not two


def _warning(save: Path) -> str:
    return (
        f"WARNING: checkpoint.save: {save} has 2.5 MiB free; one checkpoint is about 1.5 MiB "
        "and a save needs room for two; free space or point checkpoint.save elsewhere"
    )


def _save_on_small_disk(data: dict[str, str], tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """``one_step`` with checkpoint.save on a SMALL_DISK tmpfs, ``tmp/disk/ckpt``."""
    command = one_step(data, tmp, f"checkpoint.save={tmp / 'disk' / 'ckpt'}", *args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_on_small_disk(command, str(tmp / "disk"), SMALL_DISK, env=env, cwd=ROOT)


@pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
def test_the_dry_run_warns_when_checkpoint_save_lacks_room_for_two(gpt_data, tmp_path):
    out = _save_on_small_disk(gpt_data, tmp_path, "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "checkpoint: about 1.5 MiB per save (weights and optimizer state of every rank)" in lines
    assert _warning(tmp_path / "disk" / "ckpt") in lines
    roomy = _run(one_step(gpt_data, tmp_path, f"checkpoint.save={tmp_path / 'ckpt'}", "--dry-run"))
    assert roomy.returncode == 0 and "WARNING" not in roomy.stdout, roomy.stdout + roomy.stderr


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
def test_a_run_warns_before_its_first_step(gpt_data, tmp_path):
    """The acceptance run: rank 0 prints the warning once, before the first iteration's line."""
    lines = _save_on_small_disk(gpt_data, tmp_path).stdout.splitlines()
    warning = _warning(tmp_path / "disk" / "ckpt")
    assert lines.count(warning) == 1, "\n".join(lines)
    first_step = next(i for i, line in enumerate(lines) if line.startswith("iteration:"))
    assert lines.index(warning) < first_step
