"""A failed run under torchrun ends in its one line: the entrypoints' --preflight, plain torchrun
(the line in its failure table's root cause, the table being the output's last lines) and
``python -m megatron.launch.torchrun`` (the line alone, and the failed worker's exit code).

The bad inputs are a config value (optimizer.lr=-1) and a file (a data prefix that is not
there), each raised by every rank before any process group. The launcher's exit codes are also
checked with stub workers: a "full disk" (4) on one rank while the other is still running, and
a worker killed by a signal.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_slurm import CONFIG, NO_SAVE, ROOT, small_inputs

BAD = {
    "lr": ("optimizer.lr=-1", "error: optimizer.lr=-1.0 must be positive; fix the value"),
    "data": ("data.paths=[nope/x]", "nope/x"),
}


def _run(cmd: list[str], **launcher: str) -> subprocess.CompletedProcess:
    """``cmd`` in the repository, with no launcher's variables but ``launcher``."""
    outside = ("RANK", "WORLD_SIZE", "TORCHELASTIC_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(outside)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **launcher)
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def _launch(launcher: str, *args: str) -> subprocess.CompletedProcess:
    """``launcher`` (a module) over 2 processes: the tiny GPT with ``args``, or a stub script."""
    cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node=2", *args]
    return _run(cmd)


def _train(tmp_path: Path, bad: str) -> list[str]:
    return ["pretrain_gpt.py", "--config", CONFIG, *small_inputs(tmp_path), NO_SAVE, bad]


def test_preflight_checks_for_the_given_world_size(tmp_path):
    inputs = [*small_inputs(tmp_path), NO_SAVE]
    entry = [sys.executable, "pretrain_gpt.py", "--preflight", "--config", CONFIG, *inputs]
    ok = _run([*entry, "--world-size", "4"])
    assert (ok.returncode, ok.stdout, ok.stderr) == (
        0, "preflight ok: configs/gpt_tiny.yaml at world size 4\n", ""
    )  # fmt: skip
    odd = _run([*entry, "--world-size", "3"])  # TP=2 does not divide 3
    assert odd.returncode == 2 and odd.stdout == ""
    assert odd.stderr.startswith("error: ") and odd.stderr.count("\n") == 1, odd.stderr
    assert "tensor_parallel_size=2" in odd.stderr
    # No --world-size: the launcher's.
    missing = _run([*entry, "data.paths=[nope/x]"], RANK="0", WORLD_SIZE="2")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert "nope/x" in missing.stderr
    ok = _run(entry, RANK="0", WORLD_SIZE="2")
    assert ok.stdout == "preflight ok: configs/gpt_tiny.yaml at world size 2\n", ok.stderr


@pytest.mark.slow
@pytest.mark.parametrize("bad", list(BAD), ids=str)
def test_plain_torchrun_ends_with_the_line(tmp_path, bad):
    """torchrun still prints its own traceback and exits 1, but the table's root cause, at the
    end of the output, carries our line, and no frame of ours is in any traceback."""
    override, line = BAD[bad]
    result = _launch("torch.distributed.run", *_train(tmp_path, override))
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    tail = [text for text in out.splitlines() if text.strip()][-3:]
    assert any(text.startswith("  traceback : ") and line.removeprefix("error: ") in text
               for text in tail), tail  # fmt: skip
    frames = re.findall(r'File "([^"]+)"', out)
    assert frames, out  # torchrun's own traceback
    ours = [f for f in frames if f.startswith(str(ROOT)) and not f.startswith(sys.prefix)]
    assert not ours, out


@pytest.mark.slow
@pytest.mark.parametrize("bad", list(BAD), ids=str)
def test_our_launcher_prints_only_the_line_and_exits_2(tmp_path, bad):
    override, line = BAD[bad]
    result = _launch("megatron.launch.torchrun", *_train(tmp_path, override))
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out and "FAILED" not in out, out
    errors = [text for text in out.splitlines() if "error" in text.lower()]
    assert len(errors) == 1 and line in errors[0], out
    assert result.stderr.splitlines()[-1] == errors[0]


# Every rank hits the full disk; rank 0 leaves its line first but is slow to exit, so torchrun
# stops it (SIGTERM) when rank 1 exits 4 a second later: torchrun's earliest failure is rank 0's,
# killed by a signal, the launcher's is rank 1's exit 4.
LINE = "checkpoint.save: /ckpt has 1.0 MB free and a checkpoint needs 9.0 MB; free space"
FULL_DISK = f"""
import os, sys, time
from megatron.launch.torchrun import report
if os.environ["RANK"] == "0":
    report("{LINE}")
    time.sleep(60)
time.sleep(1.5)
report("{LINE}")
sys.exit(4)
"""


@pytest.mark.slow
def test_our_launcher_exits_with_the_failed_workers_code(tmp_path):
    stub = tmp_path / "full_disk.py"
    stub.write_text(FULL_DISK)
    result = _launch("megatron.launch.torchrun", str(stub))
    assert result.returncode == 4, result.stderr
    assert result.stderr.splitlines()[-1] == f"error: {LINE}"
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_signal_is_named_and_128_plus_n(tmp_path):
    stub = tmp_path / "killed.py"
    stub.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    cmd = [sys.executable, "-m", "megatron.launch.torchrun", "--standalone", str(stub)]
    result = _run(cmd)
    assert result.returncode == 128 + 9, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last == f"error: {stub} rank 0 was killed by SIGKILL", last


@pytest.mark.parametrize(
    ("node", "conf", "expected"),
    [("0", "", "is_host=1"), ("1", "", "is_host=0"), ("1", "timeout=9", "timeout=9,is_host=0"),
     ("1", "is_host=1", "is_host=1"), (None, "", "")],
)  # fmt: skip
def test_under_slurm_the_first_node_hosts_the_rendezvous(monkeypatch, node, conf, expected):
    """SLURM's node 0 hosts the c10d store, whatever the machines' addresses say; a given
    is_host, no SLURM, and --standalone are left alone."""
    from torch.distributed.run import parse_args

    from megatron.launch.torchrun import _first_node_hosts

    if node is None:
        monkeypatch.delenv("SLURM_NODEID", raising=False)
    else:
        monkeypatch.setenv("SLURM_NODEID", node)
    given = ["--rdzv-conf", conf] if conf else []
    args = parse_args(["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1", *given, "x.py"])
    _first_node_hosts(args)
    assert args.rdzv_conf == expected
    alone = parse_args(["--standalone", "x.py"])
    _first_node_hosts(alone)
    assert alone.rdzv_conf == ""
