"""A rank that dies or freezes: its peer exits 1 within ``parallel.timeout_minutes`` + 30 s,
naming the rank, instead of waiting forever. Real pretrain_gpt.py processes at TP=2.

A dead rank closes its sockets, so gloo fails at once (naming an address); a frozen one
(SIGSTOP: a hung node) makes the collective time out. Either way the heartbeat names the rank.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed import free_port
from tests.gpt_run import ROOT, tiny_overrides
from tests.test_preemption import wait_for_iterations, worker_pids

CONFIG = "configs/gpt_tiny.yaml"
TIMEOUT_MINUTES = 0.1


def overrides(gpt_data, run_dir) -> list[str]:
    return tiny_overrides(gpt_data, run_dir, **{
        "parallel.tensor_parallel_size": 2,
        "parallel.timeout_minutes": TIMEOUT_MINUTES,
        "training.train_iters": 1000,
        "training.eval_iters": 0,
    })  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_the_survivor_names_a_dead_or_frozen_rank(gpt_data, tmp_path, how):
    """Launched like ``srun`` does (no torchrun): rank 0 hosts the rendezvous store."""
    port = free_port()
    cmd = [sys.executable, "pretrain_gpt.py", "--config", CONFIG, *overrides(gpt_data, tmp_path)]
    procs, outputs = [], [tmp_path / f"rank{r}.out" for r in range(2)]
    for rank in range(2):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=outputs[rank].open("w"),
                stderr=subprocess.STDOUT,
            )
        )
    survivor, victim = procs
    try:
        wait_for_iterations(tmp_path / "metrics.jsonl", 2, survivor)
        start = time.time()
        victim.send_signal(getattr(signal, how))
        survivor.wait(timeout=60 * TIMEOUT_MINUTES + 60)
        elapsed = time.time() - start
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = outputs[0].read_text()
    assert survivor.returncode == 1, out[-3000:]
    assert elapsed < 60 * TIMEOUT_MINUTES + 30
    assert "rank 1 stopped responding" in out, out[-3000:]


@pytest.mark.slow
def test_under_torchrun_the_survivor_names_the_dead_rank(gpt_data, tmp_path):
    """torchrun's agent hosts the store, so rank 0 can die too. torchrun then stops the job
    (``--max-restarts 0``); the survivor's own log says which rank was lost."""
    logs = tmp_path / "logs"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        "pretrain_gpt.py",
        "--config",
        CONFIG,
        *overrides(gpt_data, tmp_path),
    ]
    out = tmp_path / "torchrun.out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_for_iterations(tmp_path / "metrics.jsonl", 2, proc)
        os.kill(worker_pids(proc.pid)[0], signal.SIGKILL)
        proc.wait(timeout=60 * TIMEOUT_MINUTES + 60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != 0
    (survivor_log,) = logs.glob("*/attempt_0/1/stderr.log")
    text = survivor_log.read_text()
    assert "rank 0 stopped responding" in text, (text[-3000:], out.read_text()[-3000:])
