"""A rank that dies or freezes: its peers exit 1 naming the rank (host, iteration) instead of
waiting forever. Real pretrain_gpt.py processes.

On gloo a dead rank closes its sockets, so the collective fails at once (naming an address); a
frozen one (SIGSTOP: a hung node) makes it time out after ``parallel.timeout_minutes``; either
way the heartbeat then names the rank. Where no collective fails (NCCL hangs until its watchdog
aborts; here: a timeout far beyond the grace period), the heartbeat's own thread names the rank
after ``parallel.heartbeat_grace_s`` and ends the process.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed import free_port
from tests.gpt_run import ROOT, start_torchrun, tiny_overrides
from tests.test_preemption import wait_for_iterations, worker_pids

CONFIG = "configs/gpt_tiny.yaml"
TIMEOUT_MINUTES = 0.1
GRACE_S = 10


def wait_for_loop(metrics, proc: subprocess.Popen) -> None:
    """Until every rank is in its loop and has beaten since (every 1 s at most), so the last
    beat of a rank stopped now names an iteration."""
    wait_for_iterations(metrics, 2, proc)
    time.sleep(2)


def overrides(gpt_data, run_dir, **extra) -> list[str]:
    return tiny_overrides(gpt_data, run_dir, **{
        "parallel.tensor_parallel_size": 2,
        "parallel.timeout_minutes": TIMEOUT_MINUTES,
        "training.train_iters": 1000,
        "training.eval_iters": 0,
        **extra,
    })  # fmt: skip


def launch_ranks(world: int, args: list[str], run_dir) -> tuple[list[subprocess.Popen], list]:
    """``world`` pretrain_gpt.py processes launched like ``srun`` does (no torchrun): rank 0
    hosts the rendezvous store. Their outputs go to run_dir/rank<r>.out."""
    port = free_port()
    cmd = [sys.executable, "pretrain_gpt.py", "--config", CONFIG, *args]
    procs, outputs = [], [run_dir / f"rank{r}.out" for r in range(world)]
    for rank in range(world):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        out = outputs[rank].open("w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs, outputs


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_the_survivor_names_a_dead_or_frozen_rank(gpt_data, tmp_path, how):
    procs, outputs = launch_ranks(2, overrides(gpt_data, tmp_path), tmp_path)
    survivor, victim = procs
    try:
        wait_for_loop(tmp_path / "metrics.jsonl", survivor)
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
    assert re.search(r"rank 1 \(host \S+\) stopped responding at iteration \d+", out), out[-3000:]


@pytest.mark.slow
def test_with_no_collective_failing_the_heartbeat_names_a_frozen_rank(gpt_data, tmp_path):
    """4 ranks (DP 2 x TP 2), rank 2 frozen. The collective timeout (30 min) is far beyond the
    grace period, so only the heartbeat can end the others: each logs the same line and exits 1
    within grace + 10 s. Rank 2's watcher is rank 1; ranks 0 and 3 learn it through the store."""
    args = overrides(gpt_data, tmp_path, **{
        "parallel.timeout_minutes": 30,
        "parallel.heartbeat_grace_s": GRACE_S,
    })  # fmt: skip
    procs, outputs = launch_ranks(4, args, tmp_path)
    victim, survivors = procs[2], [procs[r] for r in (0, 1, 3)]
    try:
        wait_for_loop(tmp_path / "metrics.jsonl", procs[0])
        victim.send_signal(signal.SIGSTOP)
        deadline = time.time() + GRACE_S + 10
        for p in survivors:
            p.wait(timeout=max(deadline - time.time(), 0.1))
    finally:
        victim.send_signal(signal.SIGCONT)
        for p in procs:
            p.kill()
            p.wait()
    line = re.compile(r"lost a peer: rank 2 \(host \S+\) stopped responding at iteration \d+")
    for rank, p in zip((0, 1, 3), survivors):
        out = outputs[rank].read_text()
        assert p.returncode == 1, (rank, out[-3000:])
        assert line.search(out), (rank, out[-3000:])


@pytest.mark.slow
def test_a_frozen_store_host_is_named_though_requests_to_it_never_return(gpt_data, tmp_path):
    """Without torchrun rank 0 hosts the store; frozen, it answers no request (they block for
    good, whatever the client's timeout), yet rank 1 names it and exits 1 within grace + 10 s."""
    args = overrides(gpt_data, tmp_path, **{
        "parallel.timeout_minutes": 30,
        "parallel.heartbeat_grace_s": GRACE_S,
    })  # fmt: skip
    procs, outputs = launch_ranks(2, args, tmp_path)
    victim, survivor = procs
    try:
        wait_for_loop(tmp_path / "metrics.jsonl", victim)
        victim.send_signal(signal.SIGSTOP)
        survivor.wait(timeout=GRACE_S + 10)
    finally:
        victim.send_signal(signal.SIGCONT)
        for p in procs:
            p.kill()
            p.wait()
    out = outputs[1].read_text()
    assert survivor.returncode == 1, out[-3000:]
    assert re.search(
        r"lost a peer: rank 0 \(host 127.0.0.1\) stopped responding at iteration \d+: the "
        r"rendezvous store it hosts at 127.0.0.1:\d+ has not answered",
        out,
    ), out[-3000:]


@pytest.mark.slow
def test_under_torchrun_the_survivor_names_the_dead_rank(gpt_data, tmp_path):
    """torchrun's agent hosts the store, so rank 0 can die too. torchrun then stops the job
    (``--max-restarts 0``); the survivor's own log says which rank was lost."""
    logs = tmp_path / "logs"
    out = tmp_path / "torchrun.out"
    proc = start_torchrun("pretrain_gpt.py", CONFIG, overrides(gpt_data, tmp_path), out, logs)
    try:
        wait_for_loop(tmp_path / "metrics.jsonl", proc)
        os.kill(worker_pids(proc.pid)[0], signal.SIGKILL)
        proc.wait(timeout=60 * TIMEOUT_MINUTES + 60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != 0
    (survivor_log,) = logs.glob("*/attempt_0/1/stderr.log")
    text = survivor_log.read_text()
    assert re.search(r"rank 0 \(host \S+\) stopped responding at iteration \d+", text), (
        text[-3000:],
        out.read_text()[-3000:],
    )
