"""The sbatch files on a real SLURM (tests/slurm_cluster.py: slurmctld and two one-CPU slurmd
nodes on this machine): what tests/fake_slurm.py only imitates, here done by the scheduler.

The references each layout is held to are one-node runs: torchrun --standalone for the two-node
layouts, and an unbroken one-node job for the preempted one. Their losses must be equal bit for
bit (the same ranks do the same float operations in the same order, only on other "nodes").
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.checkpoint import find_latest
from tests.distributed import free_port
from tests.fake_slurm import BERT, GPT
from tests.gpt_run import ROOT, read_metrics, run_pretrain, tiny_overrides
from tests.slurm_cluster import Cluster, slurm_fixture  # noqa: F401 (the fixture `slurm`)
from tests.test_pretrain_bert import bert_data, bert_overrides  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow
CONFIG = "configs/gpt_tiny.yaml"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
# The data phase of rank 0 sleeps this long per micro-batch (megatron/training/stragglers.py):
# a run slow enough to be stopped part-way, with the same losses.
SLOW = "0:0.05"


def submit(slurm: Cluster, tmp: Path, script: Path, args: list[str], *opts: str, **env: str):
    """``sbatch`` of ``script`` from the repository root (the job runs there), its log in
    ``tmp``; returns the job id."""
    job_env = {k: v for k, v in slurm.env.items() if not k.startswith(("SLURM_", "MASTER_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "REQUEUE", "LAUNCHER", "ENTRYPOINT"):
        job_env.pop(key, None)
    job_env.update({
        "SLURM_CONF": slurm.env["SLURM_CONF"], "PYTHON": sys.executable, "GPUS_PER_NODE": "1",
        "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp / "nccl" / "trace_"), **env,
    })  # fmt: skip
    out = subprocess.run(
        ["sbatch", "--parsable", "--gpus-per-node=0", f"--output={tmp}/job-%j.out", *opts,
         str(script), *args],
        env=job_env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def wait_job(slurm: Cluster, job: str, timeout: float = 120, until=None) -> dict[str, str]:
    """scontrol's fields of ``job`` once it has ended (or ``until(fields)`` holds)."""
    deadline = time.monotonic() + timeout
    while True:
        fields = slurm.job(job)
        if (until or (lambda f: f["JobState"] in FINAL))(fields):
            return fields
        if time.monotonic() > deadline:
            slurm.run("scancel", job, check=False)
            raise AssertionError(f"job {job} still {fields['JobState']} after {timeout:.0f} s")
        time.sleep(0.5)


def job_log(tmp: Path, job: str) -> str:
    return (tmp / f"job-{job}.out").read_text()


def completions(slurm: Cluster, job: str) -> list[tuple[str, str]]:
    """(State, ExitCode) of each end of ``job`` as ``sacct --completion`` reports it."""
    out = slurm.run("sacct", "--completion", "-n", "-P", "-j", job, "-o", "State,ExitCode")
    return [tuple(line.split("|")) for line in out.splitlines() if line]


def losses(metrics: Path) -> dict[int, float]:
    """lm loss per iteration; an iteration run twice (after a resume) counts its last run."""
    return {e["iteration"]: e["lm_loss"] for e in read_metrics(metrics)}


def gpt_args(gpt_data, run: Path, **extra) -> list[str]:
    keys = {"training.eval_iters": 0, "parallel.tensor_parallel_size": 1, **extra}
    return tiny_overrides(gpt_data, run, **keys)


@pytest.fixture(scope="module")
def references(gpt_data, tmp_path_factory):
    """torchrun --standalone on one node: TP=2 for 8 iterations, and DP=2 for 40 iterations
    saving every 5 (the lost node's layout)."""
    root = tmp_path_factory.mktemp("references")
    runs = {"tp2": {"parallel.tensor_parallel_size": 2, "training.train_iters": 8},
            "dp2": {"training.train_iters": 40}}  # fmt: skip
    for name, keys in runs.items():
        run_pretrain("pretrain_gpt.py", CONFIG, gpt_args(gpt_data, root / name, **keys), nproc=2)
    return {name: losses(root / name / "metrics.jsonl") for name in runs}


@pytest.fixture(scope="module")
def unbroken(slurm, gpt_data, tmp_path_factory):
    """A one-node GPT job of 300 iterations, never stopped: (its job id, losses, log, tmp)."""
    tmp = tmp_path_factory.mktemp("unbroken")
    args = gpt_args(gpt_data, tmp, **{"training.train_iters": 300, "checkpoint.save": tmp / "ck"})
    job = submit(slurm, tmp, GPT, [CONFIG, *args])
    fields = wait_job(slurm, job)
    return job, fields, losses(tmp / "metrics.jsonl"), tmp


def test_one_node_job_trains_and_saves(slurm, unbroken):
    job, fields, run, tmp = unbroken
    text = job_log(tmp, job)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-3000:]
    assert completions(slurm, job) == [("COMPLETED", "0:0")]
    assert sorted(run) == list(range(1, 301))
    assert "saved checkpoint" in text and find_latest(str(tmp / "ck")) == 300
    assert f"job {job} (pretrain-gpt) restart 0: 1 node(s) [n1]" in text


def test_time_limit_warning_saves_requeues_and_resumes(slurm, gpt_data, unbroken, tmp_path):
    """--time=1 --signal=B:USR1@15: SLURM itself warns the batch shell (its time-limit check
    runs every 30 s and warns up to 30 s early, so 15-45 s after the start). Every rank saves
    and exits 0, the script requeues the job (REQUEUE=1), SLURM starts it again and it resumes
    from that checkpoint; its losses are the unbroken job's, bit for bit.

    Only the first start is slowed (PYTHON sets the delay while SLURM_RESTART_COUNT is unset),
    so it is still training when the warning comes and the second finishes fast; the second
    gets a 5-minute limit once requeued, or it might be warned in turn."""
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/bash\n[[ -z ${SLURM_RESTART_COUNT:-} ]] && "
        f"export MEGATRON_TEST_DATA_DELAY={SLOW}\nexec {sys.executable} \"$@\"\n"
    )  # fmt: skip
    python.chmod(0o755)
    args = gpt_args(gpt_data, tmp_path, **{"training.train_iters": 300,
                                           "checkpoint.save": tmp_path / "ck"})  # fmt: skip
    job = submit(slurm, tmp_path, GPT, [CONFIG, *args], "--time=1", "--signal=B:USR1@15",
                 PYTHON=str(python), REQUEUE="1")  # fmt: skip
    fields = wait_job(
        slurm, job, 120, until=lambda f: f["Restarts"] == "1" or f["JobState"] in FINAL
    )
    if fields["JobState"] not in FINAL:  # else TIMEOUT: the warning did not stop it
        slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=5")
    fields = wait_job(slurm, job, 120)
    text = job_log(tmp_path, job)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-4000:]
    assert fields["Restarts"] == "1"
    stopped = [line for line in text.splitlines() if "exiting at iteration" in line]
    assert len(stopped) == 1 and "(signal SIGTERM)" in stopped[0], text[-4000:]
    at = int(stopped[0].split("exiting at iteration ")[1].split()[0])
    assert 1 <= at < 300
    assert text.count("SIGUSR1: every rank saves and exits") == 1
    assert f"saved; requeueing job {job}" in text
    assert f"resumed from {tmp_path / 'ck'} at iteration {at}" in text
    assert losses(tmp_path / "metrics.jsonl") == unbroken[2]


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_two_node_tp_equals_one_node(slurm, gpt_data, references, tmp_path, launcher):
    """TP=2 with one rank on each node (rendezvous at the first node's NodeAddr, since `n1`
    resolves nowhere), by torchrun per node or one srun task per rank."""
    args = gpt_args(gpt_data, tmp_path, **{"parallel.tensor_parallel_size": 2,
                                           "training.train_iters": 8})  # fmt: skip
    job = submit(slurm, tmp_path, GPT, [CONFIG, *args], "--nodes=2", LAUNCHER=launcher)
    fields = wait_job(slurm, job)
    text = job_log(tmp_path, job)
    assert fields["JobState"] == "COMPLETED", text[-4000:]
    assert "2 node(s) [n[1-2]]" in text
    assert losses(tmp_path / "metrics.jsonl") == references["tp2"]


def test_two_node_dp_equals_one_node(slurm, gpt_data, references, tmp_path):
    args = gpt_args(gpt_data, tmp_path, **{"training.train_iters": 40})
    job = submit(slurm, tmp_path, GPT, [CONFIG, *args], "--nodes=2")
    fields = wait_job(slurm, job)
    assert fields["JobState"] == "COMPLETED", job_log(tmp_path, job)[-4000:]
    assert losses(tmp_path / "metrics.jsonl") == references["dp2"]


def test_lost_node_requeues_and_resumes(slurm, gpt_data, references, tmp_path):
    """DP=2 over two nodes, saving every 5 iterations, no torchrun restarts; node n2 crashes
    (its slurmd, slurmstepd and processes SIGKILLed). The rank on n1 names the other and exits
    1; SLURM marks n2 DOWN (SlurmdTimeout) and, as the sbatch file's --requeue asks, ends the job
    NODE_FAIL and requeues it. Once n2 is back the job resumes from the last checkpoint and
    ends with the reference's losses."""
    save = tmp_path / "ck"
    # A short heartbeat grace: the rank on n1 names what it lost well before SLURM marks n2
    # down, wherever it waits (torch's rendezvous puts rank 0 on either node).
    args = [CONFIG, *gpt_args(gpt_data, tmp_path, **{"training.train_iters": 40,
                                                    "checkpoint.save": save,
                                                    "checkpoint.save_interval": 5,
                                                    "parallel.heartbeat_grace_s": 10})]  # fmt: skip
    job = submit(slurm, tmp_path, GPT, args, "--nodes=2", MAX_RESTARTS="0",
                 MEGATRON_TEST_DATA_DELAY=SLOW)  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.exists() and max(losses(metrics), default=0) >= 12):
        assert time.monotonic() < deadline and slurm.job(job)["JobState"] not in FINAL
        time.sleep(0.2)
    try:
        slurm.lose_node("n2")
        wait_job(slurm, job, 90, until=lambda f: f["Restarts"] == "1")  # requeued by SLURM
    finally:
        slurm.start_node("n2")
    fields = wait_job(slurm, job)
    text = job_log(tmp_path, job)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-4000:]
    # Rank 1 on n2: named by rank. Rank 0 on n2: its node's agent hosts the workers' store,
    # and the heartbeat names that store as what stopped answering.
    lost = r"lost a peer, exiting: (rank [01] \(host|the torchrun agent)|the launcher is gone: "
    assert re.search(lost, text), text[-4000:]
    assert "srun: error: n1: task 0: Exited with exit code 1" in text
    assert [state for state, _ in completions(slurm, job)] == ["NODE_FAIL", "COMPLETED"]
    saved = [line for line in text.splitlines() if line.startswith("resumed from")]
    assert len(saved) == 1 and f"resumed from {save} at iteration " in saved[0]
    assert int(saved[0].split("at iteration ")[1].split()[0]) in (10, 15), saved
    assert losses(metrics) == references["dp2"]
    slurm.wait_idle()


def test_config_mistake_is_one_line_and_not_requeued(slurm, bert_data, tmp_path):  # noqa: F811
    """The BERT file with a bad learning rate and REQUEUE=1: one line, exit 2, no requeue."""
    args = bert_overrides(bert_data, tmp_path, **{"optimizer.lr": -1.0})
    job = submit(slurm, tmp_path, BERT, ["configs/bert_tiny.yaml", *args], REQUEUE="1")
    fields = wait_job(slurm, job)
    text = job_log(tmp_path, job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "2:0", "0")
    assert completions(slurm, job) == [("FAILED", "2:0")]
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    assert errors == ["error: optimizer.lr=-1.0 must be positive; fix the value"], text


def test_bert_one_node_job_trains_and_saves(slurm, bert_data, tmp_path):  # noqa: F811
    args = bert_overrides(bert_data, tmp_path, **{"training.train_iters": 4,
                                                   "parallel.tensor_parallel_size": 1,
                                                   "checkpoint.save": tmp_path / "ck"})  # fmt: skip
    job = submit(slurm, tmp_path, BERT, ["configs/bert_tiny.yaml", *args])
    fields = wait_job(slurm, job)
    assert fields["JobState"] == "COMPLETED", job_log(tmp_path, job)[-4000:]
    assert sorted(losses(tmp_path / "metrics.jsonl")) == [1, 2, 3, 4]
    assert find_latest(str(tmp_path / "ck")) == 4
