"""The launch scripts' commands under the fake SLURM of tests/fake_slurm.py: what srun, torchrun
and the one-task-per-GPU launch are given, resume, errors (each one line and exit 2, nothing
started), the sbatch files' --help and --dry outside a job, and the single-node script.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from megatron.launch.preflight import PREFLIGHT_PASSED
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
    TRACE_PYTHON,
    finish_job,
    read_args,
    run_script,
    small_inputs,
    wait_for,
)
from tests.small_disk import SKIP_REASON, run_on_small_disk

BERT_CONFIG = "configs/bert_tiny.yaml"


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
    i = srun_args.index("megatron.launch.torchrun")
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
    inputs = small_inputs(tmp_path)
    result = run_script(GPT, env, tmp_path, CONFIG, *inputs, f"checkpoint.save={save}")
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
        "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", "--shutdown-timeout=280", "--max-restarts=3",
        "pretrain_gpt.py", "--config", CONFIG, *inputs, f"checkpoint.save={save}",
    ]  # fmt: skip
    assert "preflight ok: configs/gpt_tiny.yaml at world size 8" in result.stdout
    parsed = get_args_parser().parse_args(launcher)  # torchrun itself accepts the line
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.rdzv_backend) == ("2", "4", "c10d")
    assert parsed.training_script == "pretrain_gpt.py"
    assert parsed.signals_to_handle == "SIGINT,SIGHUP,SIGQUIT"
    calls = (log / "scontrol.calls").read_text().splitlines()
    assert calls == ["show hostnames node[07-08]", "show node -o node07"]  # its NodeAddr
    for logged in ("torch ", "stub nvidia-smi", "== pip freeze", "SLURM_JOB_ID=4242"):
        assert logged in result.stdout
    assert "resuming" not in result.stdout
    step_env = dict(kv.split("=", 1) for kv in (log / "srun.env").read_text().split("\0") if kv)
    assert step_env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert step_env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert step_env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert step_env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl" / "trace_")
    assert (tmp_path / "nccl").is_dir()  # torch writes the dumps, but not the directory
    assert step_env[PREFLIGHT_PASSED] == "1"  # the workers leave the preflight's warnings out


def test_resume_from_the_save_directory(fake, tmp_path):
    env, log = fake
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest").write_text("iter_0000100\n")
    result = run_script(
        GPT, env, tmp_path, CONFIG, *small_inputs(tmp_path), f"checkpoint.save={save}"
    )
    assert result.returncode == 0, result.stderr
    assert f"== resuming from {save}" in result.stdout
    assert read_args(log / "srun.args")[-2:] == [
        f"checkpoint.load={save}",
        "checkpoint.finetune=false",
    ]


def test_srun_one_task_per_gpu(fake, tmp_path):
    """Also the NCCL defaults: tear down on a failed collective, dumps into the job's logs/; and
    the rendezvous host by its NodeAddr, since a node's name need not resolve (it did not on the
    real cluster of tests/test_slurm_real.py: `slurmd -N n1` with NodeAddr=127.0.0.1)."""
    env, log = fake
    del env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    env.update(LAUNCHER="srun", SLURM_SUBMIT_DIR=str(tmp_path), STUB_ADDRS="node07=10.1.0.7")
    for name in ("megatron", "configs", "scripts", "pretrain_gpt.py"):
        (tmp_path / name).symlink_to(ROOT / name)
    inputs = small_inputs(tmp_path)
    result = run_script(GPT, env, tmp_path, CONFIG, *inputs, NO_SAVE)
    assert result.returncode == 0, result.stderr
    args = read_args(log / "srun.args")
    _step_name(args, "pretrain_gpt.py")
    assert args[1:] == [
        "--nodes=2", "--kill-on-bad-exit=1", "--ntasks=8", "--ntasks-per-node=4",
        "--cpus-per-task=8", sys.executable, "pretrain_gpt.py", "--config", CONFIG, *inputs,
        NO_SAVE,
    ]  # fmt: skip
    step_env = dict(kv.split("=", 1) for kv in (log / "srun.env").read_text().split("\0") if kv)
    assert "RANK" not in step_env and step_env["MASTER_ADDR"] == "10.1.0.7"
    assert step_env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert step_env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/logs/nccl_trace_4242_rank_"
    assert (tmp_path / "logs").is_dir()
    for task in range(8):  # what srun adds for each task, then what the process derives
        task_env = {**step_env, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task % 4),
                    "SLURM_NODEID": str(task // 4), "SLURM_NTASKS": "8"}  # fmt: skip
        assert launcher_env(task_env) == {
            "RANK": str(task), "WORLD_SIZE": "8", "LOCAL_RANK": str(task % 4),
            "MASTER_ADDR": "10.1.0.7", "MASTER_PORT": str(PORT),
        }  # fmt: skip


def test_bert_uses_its_entrypoint(fake, tmp_path):
    env, log = fake
    inputs = small_inputs(tmp_path, "bert")
    result = run_script(BERT, env, tmp_path, BERT_CONFIG, *inputs, NO_SAVE)
    assert result.returncode == 0, result.stderr
    launcher = _torchrun_args(read_args(log / "srun.args"))
    train = ["pretrain_bert.py", "--config", BERT_CONFIG, *inputs, NO_SAVE]
    assert launcher[-len(train) :] == train


def test_spool_copy_finds_the_shared_launch(fake, tmp_path):
    """slurmd runs a copy of the batch script from its spool directory, far from launch.sh."""
    env, log = fake
    spool = tmp_path / "spool"
    spool.mkdir()
    runs = (
        (GPT, "pretrain_gpt.py", CONFIG, "gpt"),
        (BERT, "pretrain_bert.py", BERT_CONFIG, "bert"),
    )
    for script, entrypoint, config, model in runs:
        copy = spool / "slurm_script"
        copy.write_text(script.read_text())
        inputs = small_inputs(tmp_path, model)
        result = run_script(copy, env, tmp_path, config, *inputs, NO_SAVE)
        assert result.returncode == 0, result.stderr
        launcher = _torchrun_args(read_args(log / "srun.args"))
        train = [entrypoint, "--config", config, *inputs, NO_SAVE]
        assert launcher[-len(train) :] == train


def _one_line(result: subprocess.CompletedProcess) -> str:
    """The run's only stderr line, with exit 2."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_errors_stop_before_srun(fake, tmp_path):
    """A mistake in the config (its loader), the world size or the files (the entrypoint's
    preflight, on the batch host) is one line and exit 2; srun is never called."""
    env, log = fake
    result = run_script(GPT, env, tmp_path)
    assert result.returncode == 2 and "usage:" in result.stderr
    assert "unknown key training.bogus" in _one_line(
        run_script(GPT, env, tmp_path, CONFIG, "training.bogus=1")
    )
    assert "LAUNCHER=mpirun is unknown" in _one_line(
        run_script(GPT, {**env, "LAUNCHER": "mpirun"}, tmp_path, CONFIG)
    )
    inputs = small_inputs(tmp_path)
    assert _one_line(run_script(GPT, env, tmp_path, CONFIG, *inputs, "optimizer.lr=-1")) == (
        "error: optimizer.lr=-1.0 must be positive; fix the value"
    )
    missing = run_script(GPT, env, tmp_path, CONFIG, *inputs, "data.paths=[nope/x]")
    assert "nope/x" in _one_line(missing)
    # 2 nodes x 4 GPUs: world 8, which TP=3 does not divide
    assert "tensor_parallel_size=3" in _one_line(
        run_script(GPT, env, tmp_path, CONFIG, *inputs, "parallel.tensor_parallel_size=3")
    )
    assert not (log / "srun.args").exists()


def _outside_slurm(env: dict) -> dict:
    """The fake job's environment without the job: a login node (run from the repository root),
    the stubs still on PATH."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_")}


@pytest.mark.parametrize("script", [GPT, BERT], ids=lambda p: p.name)
def test_outside_slurm_the_sbatch_file_explains_itself(fake, tmp_path, script):
    env, log = fake
    env = _outside_slurm(env)
    result = run_script(script, env, ROOT, CONFIG)
    assert result.returncode == 2, result.stderr
    first, *usage = result.stderr.splitlines()
    assert first == (
        "error: not inside a SLURM job (no SLURM_JOB_ID): submit it with sbatch, or add --dry"
    )
    text = "\n".join(usage)
    assert text.startswith("usage: sbatch") and "--dry" in text and "unbound" not in text
    for variable in ("PYTHON", "GPUS_PER_NODE", "NNODES", "LAUNCHER", "REQUEUE"):
        assert f"  {variable}" in text
    helped = run_script(script, env, tmp_path, "--help")  # anywhere
    assert helped.returncode == 0 and helped.stdout.strip() == text
    assert not (log / "srun.args").exists()


def test_dry_prints_the_command_and_runs_the_preflight(fake, tmp_path):
    """Outside a job: a job of NNODES nodes, localhost the first, the preflight at its world
    size, and nothing started; in a job, the job's own nodes and rendezvous endpoint."""
    env, log = fake
    inputs = small_inputs(tmp_path)
    outside = {**_outside_slurm(env), "NNODES": "2", "GPUS_PER_NODE": "2"}
    result = run_script(GPT, outside, ROOT, "--dry", CONFIG, *inputs, NO_SAVE)
    assert result.returncode == 0, result.stderr
    assert "preflight ok: configs/gpt_tiny.yaml at world size 4" in result.stdout
    line = result.stdout.splitlines()[-1]
    assert line.startswith("== srun --job-name=pretrain_gpt.py-") and "--nodes=2" in line
    assert line.endswith(" ".join(["-m", "megatron.launch.torchrun", "--nnodes=2",
        "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29500",
        "--rdzv-id=JOBID", "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", "--shutdown-timeout=280",
        "--max-restarts=3", "pretrain_gpt.py", "--config", CONFIG, *inputs, NO_SAVE]))  # fmt: skip
    bad = run_script(GPT, outside, ROOT, "--dry", CONFIG, *inputs, "optimizer.lr=-1")
    assert _one_line(bad) == "error: optimizer.lr=-1.0 must be positive; fix the value"
    in_job = run_script(GPT, env, tmp_path, "--dry", CONFIG, *inputs, NO_SAVE)
    assert in_job.returncode == 0, in_job.stderr
    assert "preflight ok: configs/gpt_tiny.yaml at world size 8" in in_job.stdout
    assert f"--rdzv-endpoint=node07:{PORT} --rdzv-id=4242" in in_job.stdout.splitlines()[-1]
    # No step, and not even the job's directory for NCCL dumps.
    assert not (log / "srun.args").exists() and not (tmp_path / "nccl").exists()


def _fake_python(tmp_path, name: str, script: str) -> str:
    """An executable ``script`` in the fake tools' bin directory, given as run_single_node.sh's
    PYTHON."""
    python = tmp_path / "bin" / name
    python.write_text(script)
    python.chmod(0o755)
    return str(python)


def test_single_node_command(fake, tmp_path):
    env, log = fake
    env = {**env, "PYTHON": _fake_python(tmp_path, "python-record", RECORD_PYTHON), "NPROC": "2"}
    result = subprocess.run(
        ["bash", str(SINGLE), CONFIG, "training.train_iters=5"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert read_args(log / "preflight.args") == [
        "pretrain_gpt.py", "--preflight", "--world-size", "2", "--config", CONFIG,
        "training.train_iters=5",
    ]  # fmt: skip
    assert read_args(log / "python.args") == [
        "-m", "megatron.launch.torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2",
        "--log-dir=logs/torchrun", "--tee=3", "--local-ranks-filter=0",
        "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", "--shutdown-timeout=280", "--max-restarts=3",
        "pretrain_gpt.py", "--config", CONFIG, "training.train_iters=5",
    ]  # fmt: skip
    result = subprocess.run(["bash", str(SINGLE)], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_single_node_mistake_is_one_line_before_torchrun(fake, tmp_path):
    env, log = fake
    env = {**env, "PYTHON": _fake_python(tmp_path, "python-trace", TRACE_PYTHON), "NPROC": "2"}
    inputs = small_inputs(tmp_path)
    for bad, says in (("optimizer.lr=-1", "optimizer.lr=-1.0"), ("data.paths=[nope/x]", "nope/x")):
        result = subprocess.run(
            ["bash", str(SINGLE), CONFIG, *inputs, bad],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert says in _one_line(result)
    calls = (log / "python.calls").read_text().splitlines()
    assert len(calls) == 2 and all(" --preflight " in call for call in calls), calls


# pretrain_gpt.py whose workers stop where pretrain() builds the process groups, right after
# validate and its warnings: the part of a launch that prints them, without the training.
STOP_AFTER_WARNINGS = """
import runpy, sys

from megatron.parallel import state


def stop(*args, **kwargs):
    print("worker validated", flush=True)
    sys.exit(0)


state.initialize = stop
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
def test_single_node_warns_once_per_launch(fake, tmp_path):
    """checkpoint.save on a 2.5 MiB disk, short of room for two checkpoints of CONFIG (40 MiB
    each): the preflight prints the warning and passes, rank 0's validate (the real one) then
    leaves it out, so the launch shows it once."""
    env, _ = fake
    entry = tmp_path / "entry.py"
    entry.write_text(STOP_AFTER_WARNINGS)
    env.update(NPROC="1", ENTRYPOINT=str(entry), PYTHONPATH=str(ROOT),
               LOG_DIR=str(tmp_path / "logs"))  # fmt: skip
    disk = tmp_path / "disk"
    argv = ["bash", str(SINGLE), CONFIG, *small_inputs(tmp_path)]
    argv += ["parallel.tensor_parallel_size=1", f"checkpoint.save={disk / 'ckpt'}"]
    done = run_on_small_disk(argv, str(disk), 5 << 19, env=env, cwd=str(ROOT), timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "preflight ok: configs/gpt_tiny.yaml at world size 1" in text
    assert "worker validated" in text
    assert text.count("and a save needs room for two") == 1, text[-3000:]


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
