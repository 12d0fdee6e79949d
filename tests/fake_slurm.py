"""A fake SLURM for the launch scripts' tests: stub srun/squeue/scancel/scontrol/nvidia-smi on PATH.

The stub srun records its arguments and environment; with STUB_SRUN=run it also runs the
command as one local task of a job step, the way srun does: the step gets the next step id of
the job, squeue lists it under its --job-name, scancel --signal reaches every process of it (the
task and its descendants, as the step's cgroup holds them: torchrun's workers too, though they
run in sessions of their own), and a SIGTERM to srun itself becomes SIGKILL for the step's
processes ("forcing job termination"). The stub scontrol expands any node list to $STUB_HOSTS,
shows a node's NodeAddr (its name, or its address in $STUB_ADDRS, as `NodeName=n1
NodeAddr=127.0.0.1`) and records `requeue`. The scripts' real Python reads the config.
Both sbatch files exec the shared scripts/slurm/launch.sh, so each test of the GPT file covers
the BERT file's launch too; the BERT tests check only what differs (the entrypoint).

Under c10d rendezvous torchrun numbers the nodes itself (it ignores --node-rank, which only the
static backend reads), so the torchrun command is the same on every node and carries no node
rank; the one-task-per-GPU variant's ranks come from SLURM_PROCID/SLURM_LOCALID, checked here
through megatron.parallel.launcher.launcher_env.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from megatron.data.indexed_dataset import IndexedDatasetWriter
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
if [[ -n ${STUB_SCANCEL_REFUSE:-} ]]; then  # as for a step SLURM is tearing down
    echo "scancel: error: Kill job error on job step id $2: Invalid job id specified" >&2
    exit 1
fi
pids=$(step-pids "${2#*.}") || { echo "scancel: error: Invalid job id $2" >&2; exit 1; }
kill -s "${1#--signal=}" $pids
""",
    "scontrol": r"""#!/bin/bash
echo "$*" >> "$STUB_LOG/scontrol.calls"
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\n' $STUB_HOSTS; fi
if [[ $1 == show && $2 == node && $3 == -o ]]; then  # NodeAddr from STUB_ADDRS (name=addr ...)
    addr=$4
    for pair in ${STUB_ADDRS:-}; do [[ ${pair%%=*} == "$4" ]] && addr=${pair#*=}; done
    echo "NodeName=$4 Arch=x86_64 CPUTot=32 NodeAddr=$addr NodeHostName=$4 State=ALLOCATED"
fi
""",
    "nvidia-smi": "#!/bin/bash\necho 'stub nvidia-smi: no GPUs here'\n",
}
# Stands in for python in the single-node script: records the launcher command line, and the
# preflight's (a clean one: exit 0) apart.
RECORD_PYTHON = r"""#!/bin/bash
if [[ $2 == --preflight ]]; then printf '%s\0' "$@" > "$STUB_LOG/preflight.args"; exit 0; fi
printf '%s\0' "$@" > "$STUB_LOG/python.args"
"""
# The real python, each command line it is given appended to python.calls first.
TRACE_PYTHON = f'#!/bin/bash\necho "$*" >> "$STUB_LOG/python.calls"\nexec {sys.executable} "$@"\n'
# An entrypoint that records what its launcher gave it; with PROBE_WAIT it then waits for
# PROBE_SIGNAL (default SIGTERM) and, with PROBE_SAVE, "saves" (replaces the latest pointer)
# before exiting 0. Its --preflight passes, as the real one does for a good config.
PROBE = """
import json, os, signal, sys, time
if "--preflight" in sys.argv:
    sys.exit(0)
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


def small_inputs(tmp_path: Path, model: str = "gpt") -> list[str]:
    """Overrides that point CONFIG (or configs/bert_tiny.yaml) at a small real tokenizer and
    dataset, with every output under ``tmp_path``, so that the scripts' preflight passes."""
    prefix = tmp_path / "tokens"
    with IndexedDatasetWriter(str(prefix), np.uint16) as writer:
        writer.add_document([list(range(1, 100))])
    fixtures = ROOT / "tests" / "fixtures" / "tokenizers"
    tokenizer = {"gpt": f"tokenizer.model={fixtures}/sp-bpe.model",
                 "bert": f"tokenizer.vocab_file={fixtures}/bert-vocab.txt"}[model]  # fmt: skip
    return [
        tokenizer, f"data.paths=[{prefix}]", f"data.cache_dir={tmp_path}/cache",
        f"logging.tensorboard_dir={tmp_path}/tb", f"logging.metrics_file={tmp_path}/m.jsonl",
    ]  # fmt: skip


def run_script(script: Path, env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The script as sbatch would run it, from another directory than the repository."""
    return subprocess.run(
        ["bash", str(script), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def read_args(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"launch did not come up (rc {proc.returncode})")
        time.sleep(0.2)


def one_node(env: dict, tmp_path: Path, launcher: str, gpus: int, **extra: str) -> dict:
    """The fake job shrunk to this machine: one node, ``gpus`` processes, steps really run."""
    return {
        **env, "STUB_SRUN": "run", "STUB_HOSTS": "127.0.0.1", "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "GPUS_PER_NODE": str(gpus),
        "LAUNCHER": launcher, "MASTER_PORT": str(free_port()), "PROBE_DIR": str(tmp_path), **extra,
    }  # fmt: skip


def start_job(env: dict, tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """The GPT batch script in the background, its stdout and stderr in one file (a pipe that
    nobody reads would fill up and stop the training)."""
    out = tmp_path / "job.out"
    proc = subprocess.Popen(
        ["bash", str(GPT), CONFIG, *args], env=env, cwd=tmp_path, stdout=out.open("w"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    return proc, out


def finish_job(proc: subprocess.Popen, out: Path, timeout: float = 120) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        proc.kill()
        proc.wait()
    return out.read_text()
