#!/bin/bash
# The launch shared by pretrain_gpt.sbatch and pretrain_bert.sbatch:
#
#   launch.sh ENTRYPOINT [--dry] CONFIG.yaml [section.key=value ...]
#   launch.sh ENTRYPOINT --help
#
# --dry prints the srun/torchrun command the job would run and runs the preflight for its world
# size, starting nothing; outside a job (no SLURM_JOB_ID) it shows a job of NNODES nodes (default
# 1) with localhost as the first host. Outside a job anything else prints the usage and exits 2.
#
# The sbatch files `exec` it, so it runs as the job's batch shell (the same process) and gets
# the batch signal below. Inside an allocation (salloc) run it directly from the repository
# root: bash scripts/slurm/launch.sh pretrain_gpt.py configs/gpt_345m.yaml
#
# One task per node runs torchrun over that node's GPUs, and the torchrun agents meet by c10d
# rendezvous on the first host of the job's node list. The job runs in $SLURM_SUBMIT_DIR. sbatch
# passes your environment on, so these can be set on its command line (REQUEUE=1 sbatch ...):
#
#   PYTHON            interpreter with the requirements installed (default: the repository's
#                     .venv/bin/python when there is one, else python3)
#   GPUS_PER_NODE     processes per node (default: $SLURM_GPUS_ON_NODE, else 8)
#   MASTER_PORT       rendezvous port on the first host (default: 29500 + job id % 1000)
#   LAUNCHER          torchrun (default) or srun: one task per GPU, see below
#   REQUEUE=1         after the time-limit warning and a new checkpoint, requeue the job
#   SHUTDOWN_TIMEOUT  seconds torchrun waits for the other workers after one fails (default 280)
#   MAX_RESTARTS      times torchrun restarts every node's workers after one fails, inside the
#                     allocation, each attempt resuming from the newest checkpoint (default 3;
#                     torchrun launcher only). Spent, the job fails with the root cause's line;
#                     REQUEUE=1 requeues only after the time-limit save, never a failure
#
# Stopping in time. At the time limit SLURM sends SIGTERM and, KillWait (30 s by default) later,
# SIGKILL: too late to save a large model, and srun turns a SIGTERM it receives into SIGKILL for
# its tasks ("forcing job termination"), so nothing may signal srun. `#SBATCH
# --signal=B:USR1@300` sends SIGUSR1 to the batch shell (this script) alone 300 s before the
# limit; a SIGTERM to it (`scancel --batch --signal=TERM`) is taken the same way. The script
# then sends training.exit_signal (SIGTERM by default) to the job step with `scancel
# --signal=... JOB.STEP`, which signals every process of the step on every node: the workers
# finish the iteration, save on every rank and exit 0. Under torchrun the launcher itself
# ignores that signal (the step starts it with the signal ignored and leaves it out of
# --signals-to-handle): were it to catch it, it would exit 1 with a SignalException after its
# workers had saved. So the step's exit status is the workers' own, with either launcher. A
# preemption (SLURM sends SIGTERM to the job's steps, then GraceTime) takes the same path
# without this script: the workers save and exit 0, and SLURM requeues the job as its
# PreemptMode says. An iteration plus a save must fit in the @300 (or GraceTime).
#
# Before srun, on the batch host, the entrypoint's --preflight checks the config, its files and the
# world size: a mistake is one line and exit 2, and nothing starts. torchrun runs as
# megatron.launch.torchrun, torchrun that exits with the failed worker's own code after its one
# line (2 config, 4 storage, 3 NaN stop, 1 lost peer); srun's status is the highest of its tasks'.
#
# After a stop the script exits with the step's status: 0 when every worker exited 0. With
# REQUEUE=1 it requeues the job after the SIGUSR1 warning if, besides, `latest` under
# checkpoint.save moved after the signal (a checkpoint at the iteration the workers stopped at).
#
# Resume is automatic: the loop loads checkpoint.save when checkpoint.load is null, and when the
# save directory already holds a checkpoint (a requeued or resubmitted job) this script adds
# checkpoint.load=<save dir> checkpoint.finetune=false, so it resumes from its own latest save
# even when checkpoint.load names initial weights.
#
# One task per GPU (no torchrun): LAUNCHER=srun sbatch --ntasks-per-node=8 ... runs
# `srun python ENTRYPOINT` with GPUS_PER_NODE tasks per node; megatron/parallel/state.py takes
# rank, world size and local rank from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID, and
# MASTER_ADDR/MASTER_PORT from this script. The stop signal then reaches the Python processes
# with no launcher in between.
#
# NCCL and debugging (export before sbatch):
#   NCCL_DEBUG=INFO (or WARN)        NCCL's version, topology, rings/trees
#   NCCL_DEBUG_SUBSYS=INIT,NET       narrow NCCL_DEBUG to initialisation and the network
#   NCCL_SOCKET_IFNAME=ib0           interface for NCCL's bootstrap and socket transport
#   NCCL_IB_HCA=mlx5 / NCCL_IB_DISABLE=1   which InfiniBand adapters; 1 forces TCP (to bisect)
#   NCCL_P2P_DISABLE=1               no NVLink/PCIe peer copies (to bisect intra-node hangs)
#   TORCH_NCCL_ASYNC_ERROR_HANDLING, TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_FR_BUFFER_SIZE,
#   TORCH_NCCL_DEBUG_INFO_TEMP_FILE  set below (fail fast, flight recorder); yours take precedence
#   TORCH_DISTRIBUTED_DEBUG=DETAIL   checks that every rank calls the same collectives
#   TORCH_CPP_LOG_LEVEL=INFO LOGLEVEL=INFO   c10d store and torchrun rendezvous messages
#   CUDA_LAUNCH_BLOCKING=1           synchronous kernels: the Python stack of a CUDA error
#   PYTHONFAULTHANDLER=1             Python stacks of every thread on a fatal signal

set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd) # before the cd: $0 may be relative
cd "${SLURM_SUBMIT_DIR:-.}"

usage() {
    cat <<'EOF'
usage: sbatch [sbatch options] scripts/slurm/pretrain_{gpt,bert}.sbatch CONFIG.yaml [key=value ...]
       bash scripts/slurm/pretrain_{gpt,bert}.sbatch --dry CONFIG.yaml [key=value ...]
       bash scripts/slurm/pretrain_{gpt,bert}.sbatch --help

Submit from the repository root after `mkdir -p logs` (the job writes logs/<name>-<job id>.out).
--dry, in or outside a job: the srun/torchrun command the job would run, and the preflight of
the config for its world size (nodes x GPUS_PER_NODE); nothing starts. Variables (set them
before sbatch, which passes your environment on):
  PYTHON            interpreter (default: the repository's .venv/bin/python, else python3)
  GPUS_PER_NODE     processes per node (default: $SLURM_GPUS_ON_NODE, else 8)
  NNODES            --dry outside a job: the nodes to show (default 1); a job has its own
  LAUNCHER          torchrun (default), or srun: one task per GPU
  REQUEUE=1         requeue the job after the time-limit warning and a new checkpoint
  MASTER_PORT       rendezvous port on the first host (default: 29500 + job id % 1000)
  SHUTDOWN_TIMEOUT  seconds torchrun waits for the other workers after one fails (default 280)
  MAX_RESTARTS      torchrun's restarts of the workers after a failure, in the job (default 3)
More: the header of scripts/slurm/launch.sh, and docs/slurm.md.
EOF
}

# The pointer is replaced atomically on every save (new inode), so a changed stamp means a new
# checkpoint was completed by every rank.
SAVE_DIR=
save_stamp() { [[ -n $SAVE_DIR ]] && stat -c '%i %Y' "$SAVE_DIR/latest" 2>/dev/null || true; }

# Trapped from the start: an untrapped SIGUSR1 would kill this shell (its default action).
STOPPED_BY=    # the signal this script got
STAMP_AT_STOP= # save_stamp when it came
LAUNCH_PID=    # srun's pid, once started
SIGNALLED=     # the job step that was sent EXIT_SIGNAL
on_stop() {
    if [[ -n $STOPPED_BY ]]; then return; fi
    STOPPED_BY=$1
    STAMP_AT_STOP=$(save_stamp)
    echo "== $(date -Is) $1: every rank saves and exits"
    if [[ -n $LAUNCH_PID ]]; then signal_step; fi
}
TRAPPED=       # set by every trap, so that the wait it cut short is waited again
trap 'TRAPPED=1; on_stop SIGUSR1' USR1
trap 'TRAPPED=1; on_stop SIGTERM' TERM

# EXIT_SIGNAL to every process of this script's job step (never a signal to srun, which would
# SIGKILL the tasks); sets SIGNALLED, or leaves it empty while SLURM does not list the step yet.
# A listed step that scancel refuses is ending (SLURM is tearing it down: "Invalid job id
# specified"): it is not asked again, or a stop during a teardown would print that every second.
signal_step() {
    local step
    step=$(squeue --noheader --steps --jobs="$SLURM_JOB_ID" --format='%i %j' |
        awk -v name="$STEP_NAME" '$2 == name { id = $1 } END { print id }') || true
    if [[ -z $step ]]; then return; fi
    echo "== scancel --signal=$EXIT_SIGNAL $step"
    scancel --signal="$EXIT_SIGNAL" "$step" || echo "== the step is ending; not signalled again"
    SIGNALLED=$step
}

ENTRYPOINT=${1:-} # given by the sbatch file
(($# == 0)) || shift
DRY=
case ${1:-} in
    --help | -h)
        usage
        exit 0
        ;;
    --dry) DRY=1 && shift ;;
esac
if [[ -z $DRY && -z ${SLURM_JOB_ID:-} ]]; then
    echo "error: not inside a SLURM job (no SLURM_JOB_ID): submit it with sbatch, or add --dry" >&2
    usage >&2
    exit 2
fi
if (($# < 1)); then
    usage >&2
    exit 2
fi
CONFIG=$1
shift
OVERRIDES=("$@")
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=$REPO/.venv/bin/python
    if [[ ! -x $PYTHON ]]; then PYTHON=python3; fi
    echo "== PYTHON=$PYTHON (the repository's .venv, else python3; set PYTHON to choose)"
fi
LAUNCHER=${LAUNCHER:-torchrun}
if [[ $LAUNCHER != torchrun && $LAUNCHER != srun ]]; then
    echo "error: LAUNCHER=$LAUNCHER is unknown; use torchrun or srun" >&2
    exit 2
fi
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-${NNODES:-1}}}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-280}
MAX_RESTARTS=${MAX_RESTARTS:-3}
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    JOB_ID=$SLURM_JOB_ID
    NODELIST=$SLURM_JOB_NODELIST
    HOSTS=$(scontrol show hostnames "$NODELIST") # one per line; the first hosts rendezvous
    # Derived from the job id so two jobs sharing a node do not collide; a requeued job reuses it.
    MASTER_PORT=${MASTER_PORT:-$((29500 + JOB_ID % 1000))}
else # --dry outside a job: what a job would run, with this host as its first node
    JOB_ID=JOBID
    NODELIST=localhost
    HOSTS=localhost
    MASTER_PORT=${MASTER_PORT:-29500}
fi
FIRST_HOST=${HOSTS%%$'\n'*}
MASTER_ADDR=$FIRST_HOST
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    # The address SLURM itself reaches the first node at (its NodeAddr): a node's name need not
    # resolve on the nodes (NodeName=gpu-a01 NodeAddr=10.1.2.3, or `slurmd -N` test nodes).
    ADDR=$(scontrol show node -o "$FIRST_HOST" | grep -o ' NodeAddr=[^ ]*' | cut -d= -f2) || true
    MASTER_ADDR=${ADDR:-$FIRST_HOST}
fi
export MASTER_ADDR MASTER_PORT
# One CUDA hardware queue per process: kernels then start in the order they are issued, so the
# column-parallel layers' input-gradient all-reduce, issued before their weight-gradient GEMM,
# really runs alongside it (megatron/parallel/layers.py turns that overlap on only with this set).
# srun passes the environment on to every task.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# A collective that fails or times out ends the process (1: abort the NCCL communicators, then
# exit) so that srun's --kill-on-bad-exit ends the job instead of leaving it hung; on a timeout
# every rank first dumps its flight recorder (its last 2000 collectives, with Python stacks) next
# to the job's log in logs/ (node-local /tmp by default, gone with the job). Set any of them
# before sbatch to override.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
TRACE_PREFIX=$PWD/logs/nccl_trace_${JOB_ID}_rank_ # torch appends the rank
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$TRACE_PREFIX}

# The save directory and the exit signal, read with the run's own config loader (a config error
# stops here, before any GPU work): two lines, the first empty without checkpoint.save.
RUN_INFO=$("$PYTHON" - "$CONFIG" "${OVERRIDES[@]}" <<'EOF'
import sys

from megatron.config.load import load_config
from megatron.errors import ConfigError

try:
    cfg = load_config([sys.argv[1]], sys.argv[2:])
except ConfigError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(err.exit_code)
print(cfg.checkpoint.save or "", cfg.training.exit_signal, sep="\n")
EOF
)
SAVE_DIR=${RUN_INFO%$'\n'*}
EXIT_SIGNAL=${RUN_INFO##*$'\n'}
# The name SLURM lists this script's job step under: unique among the steps of an allocation.
STEP_NAME=${ENTRYPOINT##*/}-$$
echo "== $(date -Is) job $JOB_ID (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0}:" \
    "$NNODES node(s) [$NODELIST] x $GPUS_PER_NODE GPUs, launcher $LAUNCHER${DRY:+ (--dry)}"
echo "== $ENTRYPOINT --config $CONFIG ${OVERRIDES[*]}"

if [[ -n $SAVE_DIR && -e $SAVE_DIR/latest ]]; then
    echo "== resuming from $SAVE_DIR"
    OVERRIDES+=("checkpoint.load=$SAVE_DIR" "checkpoint.finetune=false")
fi
# Every check the workers run before their first collective, here in one process: a mistake is
# one line and exit 2, and no node starts.
"$PYTHON" "$ENTRYPOINT" --preflight --world-size "$((NNODES * GPUS_PER_NODE))" \
    --config "$CONFIG" "${OVERRIDES[@]}"
# Its warnings are shown: the workers (srun passes the environment on) run the same checks and
# leave them out (pretrain.py).
export MEGATRON_PREFLIGHT_PASSED=1
TRAIN=("$ENTRYPOINT" --config "$CONFIG" "${OVERRIDES[@]}")
SRUN=(srun --job-name="$STEP_NAME" --nodes="$NNODES" --kill-on-bad-exit=1)
if [[ $LAUNCHER == torchrun ]]; then
    # torchrun must leave EXIT_SIGNAL to its workers: started with it ignored (inherited across
    # exec) and without it among the signals torchrun catches. Its workers install their own
    # handler for it before any long setup.
    HANDLED=$(echo SIGTERM,SIGINT,SIGHUP,SIGQUIT | tr , '\n' | grep -vx "$EXIT_SIGNAL" |
        paste -sd,)
    CMD=("${SRUN[@]}" --ntasks="$NNODES" --ntasks-per-node=1)
    if [[ -n ${SLURM_CPUS_ON_NODE:-} ]]; then CMD+=(--cpus-per-task="$SLURM_CPUS_ON_NODE"); fi
    CMD+=(bash -c "trap '' $EXIT_SIGNAL; exec \"\$@\"" "ignore-$EXIT_SIGNAL"
        "$PYTHON" -m megatron.launch.torchrun
        --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE"
        --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$JOB_ID"
        --signals-to-handle="$HANDLED" --shutdown-timeout="$SHUTDOWN_TIMEOUT"
        --max-restarts="$MAX_RESTARTS" "${TRAIN[@]}")
else
    CMD=("${SRUN[@]}" --ntasks="$((NNODES * GPUS_PER_NODE))" --ntasks-per-node="$GPUS_PER_NODE")
    if [[ -n ${SLURM_CPUS_ON_NODE:-} ]]; then
        CMD+=(--cpus-per-task="$((SLURM_CPUS_ON_NODE / GPUS_PER_NODE))")
    fi
    CMD+=("$PYTHON" "${TRAIN[@]}")
fi

echo "== ${CMD[*]}"
if [[ -n $DRY ]]; then exit 0; fi

# What ran, for the job's log: the environment, versions, GPUs, commit and packages.
mkdir -p "${TORCH_NCCL_DEBUG_INFO_TEMP_FILE%/*}"
env | grep -E '^(SLURM_|NCCL_|TORCH_|CUDA_|MASTER_|OMP_)' | sort || true
"$PYTHON" -c 'import sys, torch
cuda = torch.cuda.is_available()
nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda},",
      f"cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}, visible GPUs {torch.cuda.device_count()}")' ||
    true
nvidia-smi || echo "nvidia-smi: not available on $(hostname)"
echo "== git $(git rev-parse HEAD 2>/dev/null || echo '(not a git checkout)')"
echo "== pip freeze"
"$PYTHON" -m pip freeze 2>/dev/null || echo "(pip not available)"

if [[ -n $STOPPED_BY ]]; then
    echo "== stopped before the launch; nothing ran"
    exit 1
fi
"${CMD[@]}" &
LAUNCH_PID=$!
while :; do
    # A signal that came before SLURM listed the step (or before LAUNCH_PID was set) is sent
    # once it does; until then, look again every second.
    if [[ -n $STOPPED_BY && -z $SIGNALLED ]]; then
        signal_step
        if [[ -z $SIGNALLED ]] && kill -0 "$LAUNCH_PID" 2>/dev/null; then
            sleep 1
            continue
        fi
    fi
    TRAPPED=
    status=0
    wait "$LAUNCH_PID" || status=$?
    # A trapped signal ends `wait` early (128 + n): wait again, for srun's own status (bash
    # keeps it for a child that ended meanwhile).
    if ((status > 128)) && [[ -n $TRAPPED ]]; then continue; fi
    break
done

if [[ -z $STOPPED_BY ]]; then
    exit "$status"
fi
# The workers' own outcome: srun's status is the highest of its tasks' (torchrun's is its
# workers', since it never saw the signal).
if ((status != 0)); then
    echo "== stopped by $STOPPED_BY, but the job step failed (status $status); not requeued"
    exit "$status"
fi
if [[ $(save_stamp) == "$STAMP_AT_STOP" ]]; then
    echo "== every rank exited 0 after $STOPPED_BY with no checkpoint newer than the signal in" \
        "'$SAVE_DIR' (the run had finished, or checkpoint.save is unset); not requeued"
    exit 0
fi
# Only the early warning requeues: SIGTERM also comes from scancel, and a preempted job is
# requeued by SLURM itself when its PreemptMode says so.
if [[ ${REQUEUE:-0} == 1 && $STOPPED_BY == SIGUSR1 ]]; then
    echo "== $(date -Is) saved; requeueing job $SLURM_JOB_ID (it resumes from $SAVE_DIR)"
    scontrol requeue "$SLURM_JOB_ID"
else
    echo "== saved in $SAVE_DIR; resubmit the same command to continue"
fi
exit 0
