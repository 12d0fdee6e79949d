"""Restarts inside the job: scripts/run_single_node.sh passes MAX_RESTARTS to torchrun, so when a
worker dies the group restarts by itself and resumes from the newest checkpoint. Real processes:
the test SIGKILLs one of two workers from outside, as the kernel or an operator would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.stragglers import DATA_DELAY
from tests.gpt_run import ROOT, read_metrics, tiny_overrides

KEYS = {"parallel.tensor_parallel_size": 2, "training.train_iters": 9, "training.eval_iters": 0,
        "optimizer.lr_warmup_iters": 0, "checkpoint.save_interval": 3}  # fmt: skip


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _launch(
    gpt_data, run: Path, restarts: int, kill_at: str | None, kills: int = 1
) -> tuple[int, str]:
    """run_single_node.sh on the tiny GPT at TP 2; the first ``kills`` times a log line of
    iteration ``kill_at`` appears (one per attempt), its second worker is killed. (exit code,
    output)."""
    overrides = tiny_overrides(gpt_data, run, **KEYS, **{"checkpoint.save": run / "ckpt"})
    env = {**os.environ, "NPROC": "2", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable,
           "LOG_DIR": str(run / "logs"), "SHUTDOWN_TIMEOUT": "20",
           "MAX_RESTARTS": str(restarts),
           # about a second an iteration (rank 0 waits 0.25 s for each of its 4 micro-batches):
           # the kill lands well before the next checkpoint, whatever the pipe's delay
           DATA_DELAY: "0:0.25"}  # fmt: skip
    proc = subprocess.Popen(
        ["bash", "scripts/run_single_node.sh", "configs/gpt_tiny.yaml", *overrides],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if kill_at and f"iteration: {kill_at:>8}/" in line and kills > 0:
                kills -= 1
                agent = _children(proc.pid)  # the script's subshell became torchrun
                workers = sorted(w for a in agent for w in _children(a))
                os.kill(workers[-1], signal.SIGKILL)  # the later-started worker: rank 1
        return proc.wait(timeout=300), "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _losses(run: Path) -> dict[int, float]:
    """Each iteration's last logged loss: a resumed run logs again what it redoes."""
    return {e["iteration"]: e["lm_loss"] for e in read_metrics(run / "metrics.jsonl")}


@pytest.mark.slow
def test_a_killed_worker_restarts_the_group_which_resumes_exactly(gpt_data, tmp_path):
    """Rank 1 killed at iteration 4: torchrun restarts both workers, they resume from iteration
    3's checkpoint, and every iteration's loss equals the unbroken run's, bit for bit."""
    code, _ = _launch(gpt_data, tmp_path / "unbroken", 0, None)
    assert code == 0
    code, output = _launch(gpt_data, tmp_path / "killed", 3, "4")
    assert code == 0, output[-3000:]
    assert "resumed from" in output and "at iteration 3" in output, output[-3000:]
    assert _losses(tmp_path / "killed") == _losses(tmp_path / "unbroken")


@pytest.mark.slow
def test_a_worker_that_dies_at_the_same_iteration_stops_after_the_limit(gpt_data, tmp_path):
    """Rank 1 dies at iteration 4 in every attempt: after MAX_RESTARTS=1 restart the launch stops
    with one line naming the rank, its signal and the restarts spent."""
    code, output = _launch(gpt_data, tmp_path, 1, "4", kills=2)
    assert code == 128 + signal.SIGKILL, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: pretrain_gpt.py rank 1 was killed by SIGKILL"), last
    assert last.endswith(", after 1 restart (--max-restarts)"), last
    assert output.count("resumed from") == 1
