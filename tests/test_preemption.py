"""The exit signal through the real entrypoint: delivered to one rank, every rank saves the same
iteration and the job exits 0; a signal that comes during an evaluation or a save is not lost."""

import os
import signal
import subprocess
import time

import pytest

from megatron.checkpoint import find_latest
from megatron.checkpoint.format import checkpoint_name, read_meta
from megatron.config.schema import TrainingConfig
from megatron.training.exit import ExitPolicy, ExitSignal
from tests.distributed import run_distributed
from tests.gpt_run import read_metrics, start_torchrun, tiny_overrides

CONFIG = "configs/gpt_tiny.yaml"


def test_policy_reasons():
    """The signal wins over the clock, the clock over the interval; '' means go on."""
    cfg = TrainingConfig(
        micro_batch_size=1,
        global_batch_size=1,
        exit_interval=5,
        exit_duration_in_mins=1.0,
        exit_signal="SIGUSR2",
    )
    sig = ExitSignal(cfg.exit_signal)
    try:
        policy = ExitPolicy(cfg, sig, start_time=time.time())
        assert policy.local_flags() == [0.0, 0.0]
        assert policy.reason(4, [0.0, 0.0]) == ""
        assert policy.reason(5, [0.0, 0.0]) == "training.exit_interval=5"
        assert policy.reason(4, [0.0, 2.0]) == "training.exit_duration_in_mins=1.0"
        os.kill(os.getpid(), signal.SIGUSR2)
        assert sig.received and policy.local_flags() == [1.0, 0.0]
        assert policy.reason(4, [1.0, 2.0]) == "signal SIGUSR2"
        policy.start_time -= 61
        assert policy.local_flags() == [1.0, 1.0]
    finally:
        sig.restore()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the launcher's child processes (read from /proc)."""
    pids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ") as f:
                env = dict(kv.split("=", 1) for kv in f.read().split("\0") if "=" in kv)
        except OSError:  # the process ended meanwhile
            continue
        if "RANK" in env:
            pids[int(env["RANK"])] = int(entry)
    return pids


def wait_for_iterations(metrics, n: int, proc: subprocess.Popen) -> None:
    """Until ``metrics`` has ``n`` training lines (the run is in its loop)."""
    deadline = time.time() + 240
    while not (metrics.exists() and len(read_metrics(metrics)) >= n):
        assert proc.poll() is None and time.time() < deadline, "the run did not get going"
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_to_one_worker_saves_the_current_iteration_and_exits_0(gpt_data, tmp_path):
    """torchrun, DP=2; SIGTERM to the rank-1 worker alone (not to torchrun, which would forward
    it to every worker)."""
    ckpt = tmp_path / "ckpt"
    overrides = tiny_overrides(gpt_data, tmp_path, **{
        "parallel.tensor_parallel_size": 1,
        "training.train_iters": 1000,
        "training.eval_iters": 0,
        "checkpoint.save": ckpt,
        "checkpoint.save_interval": None,
    })  # fmt: skip
    log = tmp_path / "torchrun.out"
    proc = start_torchrun("pretrain_gpt.py", CONFIG, overrides, log)
    try:
        wait_for_iterations(tmp_path / "metrics.jsonl", 2, proc)
        os.kill(worker_pids(proc.pid)[1], signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]["iteration"]
    assert 2 <= last < 1000 and "(signal SIGTERM)" in out
    assert find_latest(str(ckpt)) == last
    assert read_meta(str(ckpt / checkpoint_name(last)))["progress"]["iteration"] == last


def _train_signalled(overrides: list[str], during: str) -> int:
    """pretrain_gpt's main in this (spawned) rank; rank 1 sends itself SIGUSR1 once, inside its
    first evaluation or inside its first checkpoint write."""
    import pretrain_gpt
    from megatron.checkpoint import save as checkpointing
    from megatron.training.pretrain import main

    sent = {"done": int(os.environ["RANK"]) != 1}

    def send():
        if not sent["done"]:
            sent["done"] = True
            os.kill(os.getpid(), signal.SIGUSR1)

    def forward_step(model, batch):
        if during == "evaluation" and not model.training:
            send()
        return pretrain_gpt.forward_step(model, batch)

    write_tensors = checkpointing.write_tensors

    def write_while_signalled(*args, **kwargs):
        if during == "save":
            send()
        return write_tensors(*args, **kwargs)

    checkpointing.write_tensors = write_while_signalled
    argv = ["--config", CONFIG, *overrides]
    return main(argv, "", pretrain_gpt.datasets_provider, forward_step)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("during", "stop_at"),
    [("evaluation", 3), ("save", 3)],  # evaluation at 3; a save at 2, so the exit at the next
)
def test_a_signal_during_evaluation_or_a_save_is_not_lost(gpt_data, tmp_path, during, stop_at):
    """Two ranks; ``training.exit_signal=SIGUSR1`` reaches rank 1 alone, in the middle of an
    evaluation (agreed right after it) or of a save (agreed at the next iteration)."""
    ckpt = tmp_path / "ckpt"
    overrides = tiny_overrides(gpt_data, tmp_path, **{
        "parallel.tensor_parallel_size": 1,
        "training.train_iters": 40,
        "training.eval_interval": 3,
        "training.exit_signal": "SIGUSR1",
        "checkpoint.save": ckpt,
        "checkpoint.save_interval": 2 if during == "save" else None,
    })  # fmt: skip
    assert run_distributed(_train_signalled, 2, overrides, during) == [0, 0]
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["iteration"] == stop_at
    assert find_latest(str(ckpt)) == stop_at
