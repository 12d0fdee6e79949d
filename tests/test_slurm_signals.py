"""Stopping under the fake SLURM of tests/fake_slurm.py, with real srun semantics (a SIGTERM to
srun kills its tasks): the early warning, preemption and a stop without a checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron.checkpoint import find_latest
from megatron.checkpoint.format import checkpoint_name, read_meta
from tests.fake_slurm import (
    CONFIG,
    PROBE,
    finish_job,
    one_node,
    start_job,
    wait_for,
)
from tests.gpt_run import read_metrics, tiny_overrides


@pytest.mark.slow
def test_early_warning_saves_the_current_iteration_and_requeues(fake, tmp_path, gpt_data):
    """The acceptance test of the time-limit warning, on the real pretrain_gpt.py under torchrun
    (DP=2): SIGUSR1 to the batch shell -> SIGTERM to every process of the job step (torchrun
    ignores it, its workers act on it) -> a checkpoint at the iteration the ranks stopped at,
    every worker exits 0, torchrun and srun with them -> `scontrol requeue`, batch exit 0.

    Before the fix the script sent SIGTERM to srun, which SIGKILLs the tasks: no checkpoint."""
    env, log = fake
    ckpt = tmp_path / "ckpt"
    overrides = tiny_overrides(gpt_data, tmp_path, **{
        "parallel.tensor_parallel_size": 1, "training.train_iters": 1000,
        "training.eval_iters": 0, "checkpoint.save": ckpt, "checkpoint.save_interval": None,
    })  # fmt: skip
    env = one_node(env, tmp_path, "torchrun", 2, REQUEUE="1")
    proc, out = start_job(env, tmp_path, *overrides)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(read_metrics(metrics)) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    text = finish_job(proc, out)
    assert proc.returncode == 0, text[-4000:]
    last = read_metrics(metrics)[-1]["iteration"]
    assert 2 <= last < 1000 and f"exiting at iteration {last} (signal SIGTERM)" in text
    assert find_latest(str(ckpt)) == last
    assert read_meta(str(ckpt / checkpoint_name(last)))["progress"]["iteration"] == last
    assert (log / "scancel.calls").read_text() == "--signal=SIGTERM 4242.0\n"
    assert not (log / "srun.signals").exists()  # nothing signalled srun
    assert "SignalException" not in text  # torchrun never caught the signal
    assert "requeue 4242" in (log / "scontrol.calls").read_text().splitlines()
    assert "SIGUSR1: every rank saves and exits" in text and "requeueing job 4242" in text


@pytest.mark.slow
@pytest.mark.parametrize(
    "sent,requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)], ids=["USR1", "TERM"]
)
def test_one_task_per_gpu_gets_the_configured_exit_signal(fake, tmp_path, sent, requeued):
    """LAUNCHER=srun, training.exit_signal=SIGUSR1: the tasks get SIGUSR1 (not SIGTERM, whose
    default action would kill them); a SIGTERM to the batch shell takes the same path but does
    not requeue (scancel sends it too)."""
    env, log = fake
    probe, save = tmp_path / "probe.py", tmp_path / "ckpt"
    probe.write_text(PROBE)
    env = one_node(env, tmp_path, "srun", 1, ENTRYPOINT=str(probe), PROBE_WAIT="1",
                    PROBE_SIGNAL="SIGUSR1", PROBE_SAVE=str(save), REQUEUE="1")  # fmt: skip
    proc, out = start_job(env, tmp_path, f"checkpoint.save={save}", "training.exit_signal=SIGUSR1")
    wait_for([tmp_path / "rank0.json"], proc)
    proc.send_signal(sent)
    text = finish_job(proc, out)
    assert proc.returncode == 0, text
    assert (log / "scancel.calls").read_text() == "--signal=SIGUSR1 4242.0\n"
    assert (save / "latest").read_text() == "iter_0000007\n"
    assert ("requeue 4242" in (log / "scontrol.calls").read_text()) == requeued
    assert ("requeueing job 4242" in text) == requeued
    assert requeued or f"saved in {save}; resubmit" in text


@pytest.mark.slow
def test_preemption_reaches_torchrun_workers_and_exits_0(fake, tmp_path):
    """A preemption: SLURM itself sends SIGTERM to every process of the step (here through the
    stub scancel), not to the batch shell. torchrun ignores it, so its status is its workers'
    (0), not 1 from a SignalException."""
    env, log = fake
    probe, save = tmp_path / "probe.py", tmp_path / "ckpt"
    probe.write_text(PROBE)
    env = one_node(env, tmp_path, "torchrun", 2, ENTRYPOINT=str(probe), PROBE_WAIT="1",
                    PROBE_SAVE=str(save))  # fmt: skip
    proc, out = start_job(env, tmp_path, f"checkpoint.save={save}")
    wait_for([tmp_path / "rank0.json", tmp_path / "rank1.json"], proc)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, record in enumerate(records):
        assert record["env"]["RANK"] == str(rank) and record["env"]["WORLD_SIZE"] == "2"
        assert record["env"]["LOCAL_RANK"] == str(rank)
        assert record["argv"] == ["--config", CONFIG, f"checkpoint.save={save}"]
    subprocess.run(["scancel", "--signal=TERM", "4242.0"], env=env, check=True)
    text = finish_job(proc, out)
    assert proc.returncode == 0, text
    assert (save / "latest").read_text() == "iter_0000007\n"
    assert "SignalException" not in text and "requeue" not in (log / "scontrol.calls").read_text()


@pytest.mark.slow
def test_srun_stub_kills_its_tasks_on_sigterm(fake, tmp_path):
    """The stub srun, like the real one, answers a SIGTERM with SIGKILL to the step's processes:
    the very thing the launch script must never trigger."""
    env, log = fake
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {**env, "STUB_SRUN": "run", "PROBE_DIR": str(tmp_path), "PROBE_WAIT": "1",
           "PROBE_SAVE": str(tmp_path / "ckpt")}  # fmt: skip
    srun = subprocess.Popen(["srun", "--ntasks=1", sys.executable, str(probe)], env=env)
    wait_for([tmp_path / "rank0.json"], srun)
    srun.send_signal(signal.SIGTERM)
    assert srun.wait(timeout=60) == 128 + signal.SIGKILL
    assert (log / "srun.signals").read_text() == "TERM\n" and not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_stop_without_a_checkpoint_is_not_requeued(fake, tmp_path):
    """The workers exit 0 but nothing newer than the signal was saved: exit 0, no requeue."""
    env, log = fake
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = one_node(env, tmp_path, "srun", 1, ENTRYPOINT=str(probe), PROBE_WAIT="1", REQUEUE="1")
    proc, out = start_job(env, tmp_path, f"checkpoint.save={tmp_path / 'ckpt'}")
    wait_for([tmp_path / "rank0.json"], proc)
    proc.send_signal(signal.SIGUSR1)
    text = finish_job(proc, out)
    assert proc.returncode == 0 and "no checkpoint newer than the signal" in text, text
    assert "requeue" not in (log / "scontrol.calls").read_text()


@pytest.mark.slow
def test_a_step_that_refuses_the_signal_is_not_asked_again(fake, tmp_path):
    """A step SLURM is tearing down is still listed by squeue, but scancel refuses it ("Invalid
    job id specified", seen on the real cluster of tests/test_slurm_real.py when a node was lost):
    the script asks once and waits for the step, where it used to ask again every second."""
    env, log = fake
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = one_node(env, tmp_path, "srun", 1, ENTRYPOINT=str(probe), PROBE_WAIT="1",
                   STUB_SCANCEL_REFUSE="1")  # fmt: skip
    proc, out = start_job(env, tmp_path, "checkpoint.save=null")
    wait_for([tmp_path / "rank0.json"], proc)
    proc.send_signal(signal.SIGUSR1)
    time.sleep(3)
    task = int((log / "steps" / "0").read_text().split()[0])
    os.kill(task, signal.SIGTERM)  # the step ends, as SLURM's teardown would end it
    text = finish_job(proc, out)
    assert proc.returncode == 0, text
    assert (log / "scancel.calls").read_text() == "--signal=SIGTERM 4242.0\n"
    assert "the step is ending; not signalled again" in text
