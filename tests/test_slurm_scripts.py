"""The launch scripts' commands under the fake SLURM of tests/fake_slurm.py: what srun, torchrun
and the one-task-per-GPU launch are given, resume, errors, and the single-node script.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from megatron.parallel.launcher import launcher_env
from tests.fake_slurm import (
    BERT,
    CONFIG,
    GPT,
    LAUNCH,
    NO_SAVE,
    PORT,
    PROBE,
    RECORD_PYTHON,
    ROOT,
    SINGLE,
    finish_job,
    read_args,
    run_script,
    wait_for,
)


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
    result = run_script(
        GPT, env, tmp_path, CONFIG, "training.train_iters=5", f"checkpoint.save={save}"
    )
    assert result.returncode == 0, result.stderr
    args = read_args(log / "srun.args")
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
    result = run_script(GPT, env, tmp_path, CONFIG, f"checkpoint.save={save}")
    assert result.returncode == 0, result.stderr
    assert f"== resuming from {save}" in result.stdout
    assert read_args(log / "srun.args")[-2:] == [
        f"checkpoint.load={save}",
        "checkpoint.finetune=false",
    ]


def test_srun_one_task_per_gpu(fake, tmp_path):
    """Also the NCCL defaults: tear down on a failed collective, dumps into the job's logs/."""
    env, log = fake
    del env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    env.update(LAUNCHER="srun", SLURM_SUBMIT_DIR=str(tmp_path))  # where logs/ goes
    for name in ("megatron", "configs", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    result = run_script(GPT, env, tmp_path, CONFIG, NO_SAVE)
    assert result.returncode == 0, result.stderr
    args = read_args(log / "srun.args")
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
    result = run_script(BERT, env, tmp_path, CONFIG, NO_SAVE)
    assert result.returncode == 0, result.stderr
    launcher = _torchrun_args(read_args(log / "srun.args"))
    assert launcher[-4:] == ["pretrain_bert.py", "--config", CONFIG, NO_SAVE]


def test_spool_copy_finds_the_shared_launch(fake, tmp_path):
    """slurmd runs a copy of the batch script from its spool directory, far from launch.sh."""
    env, log = fake
    spool = tmp_path / "spool"
    spool.mkdir()
    for script, entrypoint in ((GPT, "pretrain_gpt.py"), (BERT, "pretrain_bert.py")):
        copy = spool / "slurm_script"
        copy.write_text(script.read_text())
        result = run_script(copy, env, tmp_path, CONFIG, NO_SAVE)
        assert result.returncode == 0, result.stderr
        launcher = _torchrun_args(read_args(log / "srun.args"))
        assert launcher[-4:] == [entrypoint, "--config", CONFIG, NO_SAVE]


def test_errors_stop_before_srun(fake, tmp_path):
    env, log = fake
    result = run_script(GPT, env, tmp_path)
    assert result.returncode == 2 and "usage:" in result.stderr
    result = run_script(GPT, env, tmp_path, CONFIG, "training.bogus=1")
    assert result.returncode != 0 and "unknown key training.bogus" in result.stderr
    result = run_script(GPT, {**env, "LAUNCHER": "mpirun"}, tmp_path, CONFIG)
    assert result.returncode == 2 and "LAUNCHER=mpirun is unknown" in result.stderr
    assert not (log / "srun.args").exists()


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
    assert read_args(log / "python.args") == [
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
    wait_for([tmp_path / "rank0.json", tmp_path / "rank1.json"], proc)
    proc.send_signal(signal.SIGTERM)
    text = finish_job(proc, out)
    assert proc.returncode == 0, text
    assert (save / "latest").read_text() == "iter_0000007\n"
    assert "SIGTERM: every rank saves and exits" in text and "SignalException" not in text
