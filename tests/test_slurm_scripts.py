"""The launch scripts under a fake SLURM: stub srun/squeue/scancel/scontrol/nvidia-smi on PATH.

The stub srun records its arguments and environment; with STUB_SRUN=run it also runs the
command as one local task of a job step, the way srun does: the step gets the next step id of
the job, squeue lists it under its --job-name, scancel --signal reaches every process of it (the
task and its descendants, as the step's cgroup holds them: torchrun's workers too, though they
run in sessions of their own), and a SIGTERM to srun itself becomes SIGKILL for the step's
processes ("forcing job termination"). The stub scontrol expands any node list to $STUB_HOSTS and
records `requeue`. The scripts' real Python reads the config.
Both sbatch files exec the shared scripts/slurm/launch.sh, so each test of the GPT file covers
the BERT file's launch too; the BERT tests check only what differs (the entrypoint).

Under c10d rendezvous torchrun numbers the nodes itself (it ignores --node-rank, which only the
static backend reads), so the torchrun command is the same on every node and carries no node
rank; the one-task-per-GPU variant's ranks come from SLURM_PROCID/SLURM_LOCALID, checked here
through megatron.parallel.state.launcher_env.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from megatron.checkpoint_reshard import checkpoint_name, read_meta
from megatron.checkpointing import find_latest
from megatron.parallel.state import launcher_env
from tests.distributed import free_port
from tests.gpt_run import read_metrics, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "scripts" / "slurm" / "pretrain_gpt.sbatch"
BERT = ROOT / "scripts" / "slurm" / "pretrain_bert.sbatch"
LAUNCH = ROOT / "scripts" / "slurm" / "launch.sh"
SINGLE = ROOT / "scripts" / "run_single_node.sh"
CONFIG = "configs/gpt_tiny.yaml"
PORT = 29500 + 4242 % 1000  # the scripts' default for job 4242
# The config's own save directory lies in the repository (runs/), where a demo run may have left
# a checkpoint that the scripts would resume from; tests that are not about resume save nowhere.
NO_SAVE = "checkpoint.save=null"

STUBS = {
    "srun": r"""#!/bin/bash
printf '%s\0' "$@" > "$STUB_LOG/srun.args"
env -0 > "$STUB_LOG/srun.env"
[[ ${STUB_SRUN:-record} == run ]] || exit 0
name=
while [[ $1 == --* ]]; do
    if [[ $1 == --job-name=* ]]; then name=${1#--job-name=}; fi
    shift
done
steps=$STUB_LOG/steps
mkdir -p "$steps"
step=$(ls "$steps" | wc -l)  # every step this job ever had, ended ones too
SLURM_STEP_ID=$step SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_NTASKS=1 "$@" &
task=$!
echo "$task ${name:-${1##*/}}" > "$steps/$step"
forced() {
    echo "$1" >> "$STUB_LOG/srun.signals"
    echo "srun: forcing job termination" >&2
    step-pids "$step" | xargs -r kill -KILL 2>/dev/null
}
for sig in TERM INT HUP QUIT; do trap "trapped=1; forced $sig" $sig; done
while :; do
    trapped=
    status=0
    wait $task || status=$?
    if ((status > 128)) && [[ -n $trapped ]]; then continue; fi
    break
done
mv "$steps/$step" "$steps/$step.ended"
exit $status
""",
    "step-pids": r"""#!/bin/bash
# The processes of step $1 of this job, as its cgroup holds them: the task and its descendants.
[[ -f $STUB_LOG/steps/$1 ]] || exit 1
read -r task _ < "$STUB_LOG/steps/$1"
tree() {
    kill -0 "$1" 2>/dev/null && echo "$1"
    local child
    for child in $(ps -o pid= --ppid "$1"); do tree "$child"; done
}
[[ -n $(tree "$task") ]] && tree "$task"
""",
    "squeue": r"""#!/bin/bash
echo "$*" >> "$STUB_LOG/squeue.calls"
[[ "$*" == "--noheader --steps --jobs=$SLURM_JOB_ID --format=%i %j" ]] || exit 1
for file in "$STUB_LOG"/steps/*; do
    [[ -f $file && $file != *.ended ]] || continue
    read -r _ name < "$file"
    echo "$SLURM_JOB_ID.${file##*/} $name"
done
""",
    "scancel": r"""#!/bin/bash
echo "$*" >> "$STUB_LOG/scancel.calls"
[[ $1 == --signal=* && $2 == "$SLURM_JOB_ID".* ]] || { echo "stub scancel: $*?" >&2; exit 1; }
pids=$(step-pids "${2#*.}") || { echo "scancel: error: Invalid job id $2" >&2; exit 1; }
kill -s "${1#--signal=}" $pids
""",
    "scontrol": r"""#!/bin/bash
echo "$*" >> "$STUB_LOG/scontrol.calls"
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\n' $STUB_HOSTS; fi
""",
    "nvidia-smi": "#!/bin/bash\necho 'stub nvidia-smi: no GPUs here'\n",
}
# Stands in for python in the single-node script: records the launcher command line.
RECORD_PYTHON = '#!/bin/bash\nprintf \'%s\\0\' "$@" > "$STUB_LOG/python.args"\n'
# An entrypoint that records what its launcher gave it; with PROBE_WAIT it then waits for
# PROBE_SIGNAL (default SIGTERM) and, with PROBE_SAVE, "saves" (replaces the latest pointer)
# before exiting 0.
PROBE = """
import json, os, signal, sys, time
stop = []
signal.signal(getattr(signal, os.environ.get("PROBE_SIGNAL", "SIGTERM")), lambda *_: stop.append(1))
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
record = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:]}
rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
path = os.path.join(os.environ["PROBE_DIR"], f"rank{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
print(f"probe rank {rank} up", flush=True)
if os.environ.get("PROBE_WAIT"):
    while not stop:
        time.sleep(0.05)
    save = os.environ.get("PROBE_SAVE")
    if save and rank == "0":
        os.makedirs(save, exist_ok=True)
        with open(os.path.join(save, "latest.tmp"), "w") as f:
            f.write("iter_0000007\\n")
        os.replace(os.path.join(save, "latest.tmp"), os.path.join(save, "latest"))
"""


@pytest.fixture
def fake(tmp_path):
    """(environment of a 2-node job with 4 GPUs per node, the stubs' log directory)."""
    stubs, log = tmp_path / "bin", tmp_path / "log"
    stubs.mkdir()
    log.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "TORCH_NCCL_"))}  # fmt: skip
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "REQUEUE", "LAUNCHER", "ENTRYPOINT"):
        env.pop(key, None)
    env.update(
        PATH=f"{stubs}:{env['PATH']}",
        STUB_LOG=str(log),
        STUB_HOSTS="node07 node08",
        PYTHON=sys.executable,
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="pretrain-gpt",
        SLURM_JOB_NODELIST="node[07-08]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="4",
        SLURM_CPUS_ON_NODE="32",
        SLURM_SUBMIT_DIR=str(ROOT),
        OMP_NUM_THREADS="1",
        # The default lies under the repository's logs/; a user's value is kept.
        TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(tmp_path / "nccl" / "trace_"),
    )
    return env, log


def _run(script: Path, env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The script as sbatch would run it, from another directory than the repository."""
    return subprocess.run(
        ["bash", str(script), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _args(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def _sbatch_options(script: Path) -> dict[str, str]:
    lines = [line.split(None, 1)[1] for line in script.read_text().splitlines()
             if line.startswith("#SBATCH")]  # fmt: skip
    return dict(opt.partition("=")[::2] for opt in lines)


@pytest.mark.parametrize("script", [GPT, BERT, LAUNCH, SINGLE], ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script,name", [(GPT, "pretrain-gpt"), (BERT, "pretrain-bert")])
def test_sbatch_options(script, name):
    opts = _sbatch_options(script)
    assert opts["--job-name"] == name and opts["--output"] == "logs/%x-%j.out"
    assert opts["--ntasks-per-node"] == "1" and opts["--gpus-per-node"] == "8"
    assert "--exclusive" in opts and "--requeue" in opts and opts["--open-mode"] == "append"
    assert opts["--nodes"] and opts["--signal"] == "B:USR1@300"


def _torchrun_args(srun_args: list[str]) -> list[str]:
    i = srun_args.index("torch.distributed.run")
    assert srun_args[i - 2 : i] == [sys.executable, "-m"]
    return srun_args[i + 1 :]


def _step_name(srun_args: list[str], entrypoint: str) -> str:
    """The step's --job-name: the entrypoint's file name and the batch shell's pid."""
    name = srun_args[0].removeprefix("--job-name=")
    assert name.startswith(f"{entrypoint}-") and name.split("-")[-1].isdigit(), srun_args
    return name


def test_gpt_torchrun_per_node(fake, tmp_path):
    env, log = fake
    save = tmp_path / "ckpt"
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"  # the user's choice wins
    result = _run(GPT, env, tmp_path, CONFIG, "training.train_iters=5", f"checkpoint.save={save}")
    assert result.returncode == 0, result.stderr
    args = _args(log / "srun.args")
    _step_name(args, "pretrain_gpt.py")
    assert args[1:6] == [
        "--nodes=2", "--kill-on-bad-exit=1", "--ntasks=2", "--ntasks-per-node=1",
        "--cpus-per-task=32",
    ]  # fmt: skip
    # torchrun starts with the exit signal ignored and leaves it to its workers.
    assert args[6:10] == ["bash", "-c", "trap '' SIGTERM; exec \"$@\"", "ignore-SIGTERM"]
    launcher = _torchrun_args(args)
    assert launcher == [
        "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=node07:{PORT}", "--rdzv-id=4242",
        "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", "--shutdown-timeout=280",
        "pretrain_gpt.py", "--config", CONFIG, "training.train_iters=5", f"checkpoint.save={save}",
    ]  # fmt: skip
    parsed = get_args_parser().parse_args(launcher)  # torchrun itself accepts the line
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.rdzv_backend) == ("2", "4", "c10d")
    assert parsed.training_script == "pretrain_gpt.py"
    assert parsed.signals_to_handle == "SIGINT,SIGHUP,SIGQUIT"
    assert (log / "scontrol.calls").read_text() == "show hostnames node[07-08]\n"
    for logged in ("torch ", "stub nvidia-smi", "== pip freeze", "SLURM_JOB_ID=4242"):
        assert logged in result.stdout
    assert "resuming" not in result.stdout
    step_env = dict(kv.split("=", 1) for kv in (log / "srun.env").read_text().split("\0") if kv)
    assert step_env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert step_env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert step_env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert step_env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl" / "trace_")
    assert (tmp_path / "nccl").is_dir()  # torch writes the dumps, but not the directory


def test_resume_from_the_save_directory(fake, tmp_path):
    env, log = fake
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest").write_text("iter_0000100\n")
    result = _run(GPT, env, tmp_path, CONFIG, f"checkpoint.save={save}")
    assert result.returncode == 0, result.stderr
    assert f"== resuming from {save}" in result.stdout
    assert _args(log / "srun.args")[-2:] == [f"checkpoint.load={save}", "checkpoint.finetune=false"]


def test_srun_one_task_per_gpu(fake, tmp_path):
    """Also the NCCL defaults: tear down on a failed collective, dumps into the job's logs/."""
    env, log = fake
    del env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    env.update(LAUNCHER="srun", SLURM_SUBMIT_DIR=str(tmp_path))  # where logs/ goes
    for name in ("megatron", "configs", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    result = _run(GPT, env, tmp_path, CONFIG, NO_SAVE)
    assert result.returncode == 0, result.stderr
    args = _args(log / "srun.args")
    _step_name(args, "pretrain_gpt.py")
    assert args[1:] == [
        "--nodes=2", "--kill-on-bad-exit=1", "--ntasks=8", "--ntasks-per-node=4",
        "--cpus-per-task=8", sys.executable, "pretrain_gpt.py", "--config", CONFIG, NO_SAVE,
    ]  # fmt: skip
    step_env = dict(kv.split("=", 1) for kv in (log / "srun.env").read_text().split("\0") if kv)
    assert "RANK" not in step_env and step_env["MASTER_ADDR"] == "node07"
    assert step_env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert step_env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/logs/nccl_trace_4242_rank_"
    assert (tmp_path / "logs").is_dir()
    for task in range(8):  # what srun adds for each task, then what the process derives
        task_env = {**step_env, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task % 4),
                    "SLURM_NODEID": str(task // 4), "SLURM_NTASKS": "8"}  # fmt: skip
        assert launcher_env(task_env) == {
            "RANK": str(task), "WORLD_SIZE": "8", "LOCAL_RANK": str(task % 4),
            "MASTER_ADDR": "node07", "MASTER_PORT": str(PORT),
        }  # fmt: skip


def test_bert_uses_its_entrypoint(fake, tmp_path):
    env, log = fake
    result = _run(BERT, env, tmp_path, CONFIG, NO_SAVE)
    assert result.returncode == 0, result.stderr
    launcher = _torchrun_args(_args(log / "srun.args"))
    assert launcher[-4:] == ["pretrain_bert.py", "--config", CONFIG, NO_SAVE]


def test_spool_copy_finds_the_shared_launch(fake, tmp_path):
    """slurmd runs a copy of the batch script from its spool directory, far from launch.sh."""
    env, log = fake
    spool = tmp_path / "spool"
    spool.mkdir()
    for script, entrypoint in ((GPT, "pretrain_gpt.py"), (BERT, "pretrain_bert.py")):
        copy = spool / "slurm_script"
        copy.write_text(script.read_text())
        result = _run(copy, env, tmp_path, CONFIG, NO_SAVE)
        assert result.returncode == 0, result.stderr
        launcher = _torchrun_args(_args(log / "srun.args"))
        assert launcher[-4:] == [entrypoint, "--config", CONFIG, NO_SAVE]


def test_errors_stop_before_srun(fake, tmp_path):
    env, log = fake
    result = _run(GPT, env, tmp_path)
    assert result.returncode == 2 and "usage:" in result.stderr
    result = _run(GPT, env, tmp_path, CONFIG, "training.bogus=1")
    assert result.returncode != 0 and "unknown key training.bogus" in result.stderr
    result = _run(GPT, {**env, "LAUNCHER": "mpirun"}, tmp_path, CONFIG)
    assert result.returncode == 2 and "LAUNCHER=mpirun is unknown" in result.stderr
    assert not (log / "srun.args").exists()


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"launch did not come up (rc {proc.returncode})")
        time.sleep(0.2)


def _one_node(env: dict, tmp_path: Path, launcher: str, gpus: int, **extra: str) -> dict:
    """The fake job shrunk to this machine: one node, ``gpus`` processes, steps really run."""
    return {
        **env, "STUB_SRUN": "run", "STUB_HOSTS": "127.0.0.1", "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "GPUS_PER_NODE": str(gpus),
        "LAUNCHER": launcher, "MASTER_PORT": str(free_port()), "PROBE_DIR": str(tmp_path), **extra,
    }  # fmt: skip


def _start(env: dict, tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """The GPT batch script in the background, its stdout and stderr in one file (a pipe that
    nobody reads would fill up and stop the training)."""
    out = tmp_path / "job.out"
    proc = subprocess.Popen(
        ["bash", str(GPT), CONFIG, *args], env=env, cwd=tmp_path, stdout=out.open("w"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    return proc, out


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 120) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        proc.kill()
        proc.wait()
    return out.read_text()


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
    env = _one_node(env, tmp_path, "torchrun", 2, REQUEUE="1")
    proc, out = _start(env, tmp_path, *overrides)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(read_metrics(metrics)) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    text = _finish(proc, out)
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
    env = _one_node(env, tmp_path, "srun", 1, ENTRYPOINT=str(probe), PROBE_WAIT="1",
                    PROBE_SIGNAL="SIGUSR1", PROBE_SAVE=str(save), REQUEUE="1")  # fmt: skip
    proc, out = _start(env, tmp_path, f"checkpoint.save={save}", "training.exit_signal=SIGUSR1")
    _wait_for([tmp_path / "rank0.json"], proc)
    proc.send_signal(sent)
    text = _finish(proc, out)
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
    env = _one_node(env, tmp_path, "torchrun", 2, ENTRYPOINT=str(probe), PROBE_WAIT="1",
                    PROBE_SAVE=str(save))  # fmt: skip
    proc, out = _start(env, tmp_path, f"checkpoint.save={save}")
    _wait_for([tmp_path / "rank0.json", tmp_path / "rank1.json"], proc)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, record in enumerate(records):
        assert record["env"]["RANK"] == str(rank) and record["env"]["WORLD_SIZE"] == "2"
        assert record["env"]["LOCAL_RANK"] == str(rank)
        assert record["argv"] == ["--config", CONFIG, f"checkpoint.save={save}"]
    subprocess.run(["scancel", "--signal=TERM", "4242.0"], env=env, check=True)
    text = _finish(proc, out)
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
    _wait_for([tmp_path / "rank0.json"], srun)
    srun.send_signal(signal.SIGTERM)
    assert srun.wait(timeout=60) == 128 + signal.SIGKILL
    assert (log / "srun.signals").read_text() == "TERM\n" and not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_stop_without_a_checkpoint_is_not_requeued(fake, tmp_path):
    """The workers exit 0 but nothing newer than the signal was saved: exit 0, no requeue."""
    env, log = fake
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = _one_node(env, tmp_path, "srun", 1, ENTRYPOINT=str(probe), PROBE_WAIT="1", REQUEUE="1")
    proc, out = _start(env, tmp_path, f"checkpoint.save={tmp_path / 'ckpt'}")
    _wait_for([tmp_path / "rank0.json"], proc)
    proc.send_signal(signal.SIGUSR1)
    text = _finish(proc, out)
    assert proc.returncode == 0 and "no checkpoint newer than the signal" in text, text
    assert "requeue" not in (log / "scontrol.calls").read_text()


def test_single_node_command(fake, tmp_path):
    env, log = fake
    python = tmp_path / "bin" / "python-record"
    python.write_text(RECORD_PYTHON)
    python.chmod(0o755)
    env = {**env, "PYTHON": str(python), "NPROC": "2"}
    result = subprocess.run(
        ["bash", str(SINGLE), CONFIG, "training.train_iters=5"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _args(log / "python.args") == [
        "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
        "--log-dir=logs/torchrun", "--tee=3", "--local-ranks-filter=0",
        "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", "--shutdown-timeout=280",
        "pretrain_gpt.py", "--config", CONFIG, "training.train_iters=5",
    ]  # fmt: skip
    result = subprocess.run(["bash", str(SINGLE)], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "usage:" in result.stderr


@pytest.mark.slow
def test_single_node_shows_rank_zero_only(fake, tmp_path):
    env, _ = fake
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env.update(NPROC="2", ENTRYPOINT=str(probe), PROBE_DIR=str(tmp_path),
               LOG_DIR=str(tmp_path / "logs"))  # fmt: skip
    result = subprocess.run(
        ["bash", str(SINGLE), CONFIG], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "probe rank 0 up" in result.stdout and "probe rank 1 up" not in result.stdout
    teed = "".join(p.read_text() for p in (tmp_path / "logs").rglob("stdout.log"))
    assert "probe rank 0 up" in teed and "probe rank 1 up" in teed


@pytest.mark.slow
def test_single_node_stop_saves_and_exits_0(fake, tmp_path):
    """SIGTERM to run_single_node.sh (as a scheduler sends it): the ranks get the exit signal
    and save; torchrun, which never caught it, exits 0 with them (not 1, a SignalException)."""
    env, _ = fake
    probe, save = tmp_path / "probe.py", tmp_path / "ckpt"
    probe.write_text(PROBE)
    env.update(NPROC="2", ENTRYPOINT=str(probe), PROBE_DIR=str(tmp_path), PROBE_WAIT="1",
               PROBE_SAVE=str(save), LOG_DIR=str(tmp_path / "logs"))  # fmt: skip
    out = tmp_path / "run.out"
    proc = subprocess.Popen(
        ["bash", str(SINGLE), CONFIG], env=env, cwd=ROOT, stdout=out.open("w"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    _wait_for([tmp_path / "rank0.json", tmp_path / "rank1.json"], proc)
    proc.send_signal(signal.SIGTERM)
    text = _finish(proc, out)
    assert proc.returncode == 0, text
    assert (save / "latest").read_text() == "iter_0000007\n"
    assert "SIGTERM: every rank saves and exits" in text and "SignalException" not in text
