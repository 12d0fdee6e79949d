"""checkpoint.save's lock: a live holder refuses a second run and is named; a gone one (dead pid
on this host, or not refreshed for the stale period on any host) is taken over with a warning;
the holder keeps it fresh and releases it. Real files and real holder processes."""

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron.checkpoint import find_latest, iterations
from megatron.errors import ConfigError
from megatron.launch.run_lock import LOCK_NAME, RunLock
from megatron.logging import log
from tests.gpt_run import ROOT

HOLD = """
import sys, time
from megatron.launch.run_lock import RunLock
RunLock(sys.argv[1], 60.0)
print("held", flush=True)
time.sleep(60)
"""


def write_lock(path, host: str, pid: int, age_s: float = 0.0) -> None:
    """A lock file as another run would have left it, last refreshed ``age_s`` ago."""
    path.write_text(json.dumps({"job": "4242", "host": host, "pid": pid}))
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_a_live_holder_in_another_process_refuses_and_is_named(tmp_path):
    path = tmp_path / LOCK_NAME
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError) as err:
            RunLock(str(path), 60.0)
        message = str(err.value)
        assert "\n" not in message
        assert f"checkpoint.save={tmp_path} is in use by another run" in message
        assert f"host {socket.gethostname()}, pid {holder.pid}" in message
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_pid_on_this_host_is_taken_over_with_a_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(log, "propagate", True)  # to caplog, whatever an earlier test set up
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / LOCK_NAME
    write_lock(path, socket.gethostname(), dead.pid)  # fresh, but its process is gone
    with caplog.at_level(logging.WARNING, logger=log.name):
        lock = RunLock(str(path), 60.0)
    assert f"job 4242, host {socket.gethostname()}, pid {dead.pid}" in caplog.text
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not path.exists()


def test_another_host_counts_as_live_until_its_lock_goes_stale(tmp_path):
    path = tmp_path / LOCK_NAME
    write_lock(path, "elsewhere", 1, age_s=5.0)
    with pytest.raises(
        ConfigError, match="job 4242, host elsewhere, pid 1; run.lock refreshed 5 s"
    ):
        RunLock(str(path), 60.0)
    write_lock(path, "elsewhere", 1, age_s=61.0)
    lock = RunLock(str(path), 60.0)
    assert json.loads(path.read_text())["host"] == socket.gethostname()
    lock.release()


def test_the_holder_keeps_it_fresh_and_checkpoint_listing_ignores_it(tmp_path):
    """Stale after 0.4 s: refreshed every 0.1 s, so it never looks older than that."""
    path = tmp_path / LOCK_NAME
    lock = RunLock(str(path), 0.4)
    try:
        first = path.stat().st_mtime
        time.sleep(1.0)
        assert path.stat().st_mtime > first
        with pytest.raises(ConfigError, match="in use by another run"):
            RunLock(str(path), 0.4)  # same host, live pid: ours
        assert iterations(str(tmp_path)) == [] and find_latest(str(tmp_path)) is None
    finally:
        lock.release()
    lock.release()  # twice is harmless
    assert os.listdir(tmp_path) == []


def test_an_earlier_attempt_of_this_slurm_job_is_taken_over(tmp_path, monkeypatch):
    """A requeued job finds its own first attempt's lock, fresh and from another host."""
    path = tmp_path / LOCK_NAME
    write_lock(path, "elsewhere", 1)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock = RunLock(str(path), 60.0)
    assert json.loads(path.read_text()) == {
        "job": "4242",
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    lock.release()
