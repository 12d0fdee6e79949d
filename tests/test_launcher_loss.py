"""Orphaned workers stop themselves, and a run's checkpoint.save is its own while it lives.

torchrun runs its workers in their own session, so SIGKILL to torchrun reaches none of them;
before the heartbeat watched the launcher they went on for minutes. Real torchrun, real
pretrain_gpt.py processes."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron.launch.run_lock import LOCK_NAME
from tests.gpt_run import ROOT, start_torchrun, tiny_overrides
from tests.test_preemption import wait_for_iterations, worker_pids

CONFIG = "configs/gpt_tiny.yaml"
GRACE_S = 10


def exited(pid: int) -> bool:
    """Gone, or a zombie: orphans are reaped by whoever adopted them, if anyone does."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_a_second_run_is_refused_and_killed_torchrun_workers_stop(gpt_data, tmp_path):
    """While a 2-worker torchrun job lives, a second run on its checkpoint.save exits 2 naming
    the holder (rank 0's pid). Then torchrun is SIGKILLed: both workers exit within grace + 10 s
    with one line each, and the lock is gone with them."""
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    args = tiny_overrides(gpt_data, tmp_path, **{
        "parallel.tensor_parallel_size": 1,  # DP 2 under torchrun; the second run is a world of 1
        "parallel.timeout_minutes": 30,
        "parallel.heartbeat_grace_s": GRACE_S,
        "training.train_iters": 1000,
        "training.eval_iters": 0,
        "checkpoint.save": ckpt,
    })  # fmt: skip
    out = tmp_path / "torchrun.out"
    proc = start_torchrun("pretrain_gpt.py", CONFIG, args, out, logs)
    workers = {}
    try:
        wait_for_iterations(tmp_path / "metrics.jsonl", 2, proc)
        workers = worker_pids(proc.pid)
        second = subprocess.run(
            [sys.executable, "pretrain_gpt.py", "--config", CONFIG, *args],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert second.returncode == 2, second.stderr[-3000:]
        (line,) = [x for x in second.stderr.splitlines() if x.startswith("error:")]
        assert f"checkpoint.save={ckpt} is in use by another run" in line, line
        assert f"pid {workers[0]}" in line, line

        proc.kill()
        deadline = time.time() + GRACE_S + 10
        while not all(exited(pid) for pid in workers.values()) and time.time() < deadline:
            time.sleep(0.2)
        assert all(exited(pid) for pid in workers.values()), out.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
        for pid in workers.values():
            if not exited(pid):
                os.kill(pid, signal.SIGKILL)
    assert not (ckpt / LOCK_NAME).exists()
    for rank in (0, 1):
        (folder,) = logs.glob(f"*/attempt_0/{rank}")
        text = (folder / "stdout.log").read_text() + (folder / "stderr.log").read_text()
        assert "the launcher is gone: torchrun" in text, text[-3000:]
