"""The launch scripts under a fake SLURM: stub srun/scontrol/nvidia-smi on PATH, SLURM_* set.

The stub srun records its arguments and environment; with STUB_SRUN=run it also runs the
command as one local task, forwarding SIGTERM the way srun does. The stub scontrol expands any
node list to $STUB_HOSTS and records `requeue`. The scripts' real Python reads the config.
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

from megatron.parallel.state import launcher_env
from tests.distributed import free_port

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
while [[ $1 == --* ]]; do shift; done
"$@" &
child=$!
trap 'echo TERM >> "$STUB_LOG/srun.signals"; kill -TERM $child' TERM
while :; do
    status=0
    wait $child || status=$?
    if ((status > 128)) && kill -0 $child 2>/dev/null; then continue; fi
    exit $status
done
""",
    "scontrol": r"""#!/bin/bash
echo "$*" >> "$STUB_LOG/scontrol.calls"
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\n' $STUB_HOSTS; fi
""",
    "nvidia-smi": "#!/bin/bash\necho 'stub nvidia-smi: no GPUs here'\n",
}
# Stands in for python in the single-node script: records the launcher command line.
RECORD_PYTHON = '#!/bin/bash\nprintf \'%s\\0\' "$@" > "$STUB_LOG/python.args"\n'
# An entrypoint that records what torchrun gave it; with PROBE_WAIT it then waits for SIGTERM
# and, with PROBE_SAVE, "saves" (replaces the latest pointer) before exiting 0.
PROBE = """
import json, os, signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
record = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:]}
path = os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
print(f"probe rank {os.environ['RANK']} up", flush=True)
if os.environ.get("PROBE_WAIT"):
    while not stop:
        time.sleep(0.05)
    save = os.environ.get("PROBE_SAVE")
    if save and os.environ["RANK"] == "0":
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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
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


def test_gpt_torchrun_per_node(fake, tmp_path):
    env, log = fake
    save = tmp_path / "ckpt"
    result = _run(GPT, env, tmp_path, CONFIG, "training.train_iters=5", f"checkpoint.save={save}")
    assert result.returncode == 0, result.stderr
    args = _args(log / "srun.args")
    assert args[:5] == [
        "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "--cpus-per-task=32",
    ]  # fmt: skip
    launcher = _torchrun_args(args)
    assert launcher == [
        "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=node07:{PORT}", "--rdzv-id=4242", "--shutdown-timeout=280",
        "pretrain_gpt.py", "--config", CONFIG, "training.train_iters=5", f"checkpoint.save={save}",
    ]  # fmt: skip
    parsed = get_args_parser().parse_args(launcher)  # torchrun itself accepts the line
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.rdzv_backend) == ("2", "4", "c10d")
    assert parsed.training_script == "pretrain_gpt.py"
    assert (log / "scontrol.calls").read_text() == "show hostnames node[07-08]\n"
    for logged in ("torch ", "stub nvidia-smi", "== pip freeze", "SLURM_JOB_ID=4242"):
        assert logged in result.stdout
    assert "resuming" not in result.stdout


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
    env, log = fake
    result = _run(GPT, {**env, "LAUNCHER": "srun"}, tmp_path, CONFIG, NO_SAVE)
    assert result.returncode == 0, result.stderr
    assert _args(log / "srun.args") == [
        "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--kill-on-bad-exit=1",
        "--cpus-per-task=8", sys.executable, "pretrain_gpt.py", "--config", CONFIG, NO_SAVE,
    ]  # fmt: skip
    step_env = dict(kv.split("=", 1) for kv in (log / "srun.env").read_text().split("\0") if kv)
    assert "RANK" not in step_env and step_env["MASTER_ADDR"] == "node07"
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
            out, err = proc.communicate()
            raise AssertionError(f"launch did not come up (rc {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.2)


@pytest.mark.slow
def test_stop_signal_saves_and_requeues_through_real_torchrun(fake, tmp_path):
    """SIGUSR1 to the batch script -> SIGTERM to srun -> torchrun -> workers save; requeue."""
    env, log = fake
    probe, save = tmp_path / "probe.py", tmp_path / "ckpt"
    probe.write_text(PROBE)
    env.update(
        STUB_SRUN="run", STUB_HOSTS="127.0.0.1", SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", GPUS_PER_NODE="2", MASTER_PORT=str(free_port()),
        ENTRYPOINT=str(probe), PROBE_DIR=str(tmp_path), PROBE_WAIT="1", PROBE_SAVE=str(save),
        REQUEUE="1",
    )  # fmt: skip
    proc = subprocess.Popen(
        ["bash", str(GPT), CONFIG, f"checkpoint.save={save}"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_for([tmp_path / "rank0.json", tmp_path / "rank1.json"], proc)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, record in enumerate(records):
        assert record["env"]["RANK"] == str(rank) and record["env"]["WORLD_SIZE"] == "2"
        assert record["env"]["LOCAL_RANK"] == str(rank)
        assert record["argv"] == ["--config", CONFIG, f"checkpoint.save={save}"]
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, out + err
    assert (log / "srun.signals").read_text().split() == ["TERM"]
    assert (save / "latest").read_text() == "iter_0000007\n"
    assert "requeue 4242" in (log / "scontrol.calls").read_text().splitlines()
    assert "SIGUSR1: every rank saves and exits" in out and "requeueing job 4242" in out


@pytest.mark.slow
def test_stop_without_a_checkpoint_is_not_requeued(fake, tmp_path):
    env, log = fake
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env.update(
        STUB_SRUN="run", STUB_HOSTS="127.0.0.1", SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", GPUS_PER_NODE="1", MASTER_PORT=str(free_port()),
        ENTRYPOINT=str(probe), PROBE_DIR=str(tmp_path), PROBE_WAIT="1", REQUEUE="1",
    )  # fmt: skip
    proc = subprocess.Popen(
        ["bash", str(GPT), CONFIG, f"checkpoint.save={tmp_path / 'ckpt'}"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_for([tmp_path / "rank0.json"], proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode != 0 and "without a new checkpoint" in out, out + err
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
        "--log-dir=logs/torchrun", "--tee=3", "--local-ranks-filter=0", "--shutdown-timeout=280",
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
