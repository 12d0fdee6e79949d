#!/bin/bash
# The launch shared by pretrain_gpt.sbatch and pretrain_bert.sbatch:
#
#   launch.sh ENTRYPOINT CONFIG.yaml [section.key=value ...]
#
# The sbatch files `exec` it, so it runs as the job's batch shell (the same process) and gets
# the batch signal below. Inside an allocation (salloc) run it directly from the repository
# root: bash scripts/slurm/launch.sh pretrain_gpt.py configs/gpt_345m.yaml
#
# One task per node runs torchrun over that node's GPUs, and the torchrun agents meet by c10d
# rendezvous on the first host of the job's node list. The job runs in $SLURM_SUBMIT_DIR. sbatch
# passes your environment on, so these can be set on its command line (REQUEUE=1 sbatch ...):
#
#   PYTHON            interpreter with the requirements installed (default: python)
#   GPUS_PER_NODE     processes per node (default: $SLURM_GPUS_ON_NODE, else 8)
#   MASTER_PORT       rendezvous port on the first host (default: 29500 + job id % 1000)
#   LAUNCHER          torchrun (default) or srun: one task per GPU, see below
#   REQUEUE=1         after the time-limit warning and a new checkpoint, requeue the job
#   SHUTDOWN_TIMEOUT  seconds torchrun waits for its workers after SIGTERM (default 280)
#
# Stopping in time. At the time limit SLURM sends SIGTERM and, KillWait (30 s by default) later,
# SIGKILL: too late to save a large model. `#SBATCH --signal=B:USR1@300` sends SIGUSR1 to the
# batch shell (this script) 300 s before the limit; it forwards SIGTERM to srun, srun to every
# task, torchrun to its workers, and the training loop (training.exit_signal=SIGTERM, the
# default) finishes the iteration, saves on every rank and exits 0. torchrun gives workers only
# 30 s between SIGTERM and SIGKILL unless told otherwise: `--shutdown-timeout` raises that to
# SHUTDOWN_TIMEOUT; keep it below the @300, and raise both if an iteration plus a save take
# longer. A preemption by SLURM (SIGTERM to everything, then GraceTime) takes the same path.
#
# Resume is automatic: the loop loads checkpoint.save when checkpoint.load is null, and when the
# save directory already holds a checkpoint (a requeued or resubmitted job) this script adds
# checkpoint.load=<save dir> checkpoint.finetune=false, so it resumes from its own latest save
# even when checkpoint.load names initial weights.
#
# One task per GPU (no torchrun): LAUNCHER=srun sbatch --ntasks-per-node=8 ... runs
# `srun python ENTRYPOINT` with GPUS_PER_NODE tasks per node; megatron/parallel/state.py takes
# rank, world size and local rank from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID, and
# MASTER_ADDR/MASTER_PORT from this script. Signals then reach the Python processes directly,
# without torchrun's shutdown timeout.
#
# NCCL and debugging (export before sbatch):
#   NCCL_DEBUG=INFO (or WARN)        NCCL's version, topology, rings/trees
#   NCCL_DEBUG_SUBSYS=INIT,NET       narrow NCCL_DEBUG to initialisation and the network
#   NCCL_SOCKET_IFNAME=ib0           interface for NCCL's bootstrap and socket transport
#   NCCL_IB_HCA=mlx5 / NCCL_IB_DISABLE=1   which InfiniBand adapters; 1 forces TCP (to bisect)
#   NCCL_P2P_DISABLE=1               no NVLink/PCIe peer copies (to bisect intra-node hangs)
#   TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_NCCL_TRACE_BUFFER_SIZE=2000   flight recorder on a hang
#   TORCH_DISTRIBUTED_DEBUG=DETAIL   checks that every rank calls the same collectives
#   TORCH_CPP_LOG_LEVEL=INFO LOGLEVEL=INFO   c10d store and torchrun rendezvous messages
#   CUDA_LAUNCH_BLOCKING=1           synchronous kernels: the Python stack of a CUDA error
#   PYTHONFAULTHANDLER=1             Python stacks of every thread on a fatal signal

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"

# Trapped from the start: an untrapped SIGUSR1 would kill this shell (its default action).
STOPPED_BY=
LAUNCH_PID=
on_stop() {
    STOPPED_BY=$1
    echo "== $(date -Is) $1: every rank saves and exits (SIGTERM to the job step)"
    if [[ -n $LAUNCH_PID ]]; then kill -TERM "$LAUNCH_PID" 2>/dev/null || true; fi
}
trap 'on_stop SIGUSR1' USR1
trap 'on_stop SIGTERM' TERM

if (($# < 2)); then
    echo "usage: sbatch scripts/slurm/pretrain_{gpt,bert}.sbatch CONFIG.yaml [key=value ...]" >&2
    exit 2
fi
ENTRYPOINT=$1
CONFIG=$2
shift 2
OVERRIDES=("$@")
PYTHON=${PYTHON:-python}
LAUNCHER=${LAUNCHER:-torchrun}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-280}
HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST")  # one per line; the first hosts rendezvous
MASTER_ADDR=${HOSTS%%$'\n'*}
# Derived from the job id so two jobs sharing a node do not collide; a requeued job reuses it.
MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
export MASTER_ADDR MASTER_PORT
# One CUDA hardware queue per process: kernels then start in the order they are issued, so the
# column-parallel layers' input-gradient all-reduce, issued before their weight-gradient GEMM,
# really runs alongside it (megatron/parallel/layers.py turns that overlap on only with this set).
# srun passes the environment on to every task.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

if [[ $LAUNCHER != torchrun && $LAUNCHER != srun ]]; then
    echo "LAUNCHER=$LAUNCHER is unknown; use torchrun or srun" >&2
    exit 2
fi
# The save directory, read with the run's own config loader (a config error stops here, before
# any GPU work).
SAVE_DIR=$("$PYTHON" - "$CONFIG" "${OVERRIDES[@]}" <<'EOF'
import sys

from megatron.config_load import load_config
from megatron.errors import ConfigError

try:
    print(load_config([sys.argv[1]], sys.argv[2:]).checkpoint.save or "")
except ConfigError as err:
    sys.exit(f"error: {err}")
EOF
)
echo "== $(date -Is) job $SLURM_JOB_ID (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0}:" \
    "$NNODES node(s) [$SLURM_JOB_NODELIST] x $GPUS_PER_NODE GPUs, launcher $LAUNCHER"
echo "== $ENTRYPOINT --config $CONFIG ${OVERRIDES[*]}"
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

if [[ -n $SAVE_DIR && -e $SAVE_DIR/latest ]]; then
    echo "== resuming from $SAVE_DIR"
    OVERRIDES+=("checkpoint.load=$SAVE_DIR" "checkpoint.finetune=false")
fi
# The pointer is replaced atomically on every save (new inode), so a changed stamp means a new
# checkpoint was completed by every rank.
save_stamp() { [[ -n $SAVE_DIR ]] && stat -c '%i %Y' "$SAVE_DIR/latest" 2>/dev/null || true; }
STAMP_BEFORE=$(save_stamp)

TRAIN=("$ENTRYPOINT" --config "$CONFIG" "${OVERRIDES[@]}")
if [[ $LAUNCHER == torchrun ]]; then
    CMD=(srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1)
    if [[ -n ${SLURM_CPUS_ON_NODE:-} ]]; then CMD+=(--cpus-per-task="$SLURM_CPUS_ON_NODE"); fi
    CMD+=("$PYTHON" -m torch.distributed.run
        --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE"
        --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"
        --shutdown-timeout="$SHUTDOWN_TIMEOUT" "${TRAIN[@]}")
else
    CMD=(srun --nodes="$NNODES" --ntasks="$((NNODES * GPUS_PER_NODE))"
        --ntasks-per-node="$GPUS_PER_NODE" --kill-on-bad-exit=1)
    if [[ -n ${SLURM_CPUS_ON_NODE:-} ]]; then
        CMD+=(--cpus-per-task="$((SLURM_CPUS_ON_NODE / GPUS_PER_NODE))")
    fi
    CMD+=("$PYTHON" "${TRAIN[@]}")
fi

if [[ -n $STOPPED_BY ]]; then
    echo "== stopped before the launch; nothing ran"
    exit 1
fi
echo "== ${CMD[*]}"
"${CMD[@]}" &
LAUNCH_PID=$!
# A signal between the fork and this line found no pid to forward to.
if [[ -n $STOPPED_BY ]]; then kill -TERM "$LAUNCH_PID" 2>/dev/null || true; fi
while :; do
    status=0
    wait "$LAUNCH_PID" || status=$?
    # A trapped signal ends `wait` early (128 + n) while the step still runs: wait again.
    if ((status > 128)) && kill -0 "$LAUNCH_PID" 2>/dev/null; then continue; fi
    break
done

if [[ -z $STOPPED_BY ]]; then
    exit "$status"
fi
if [[ $(save_stamp) == "$STAMP_BEFORE" ]]; then
    echo "== stopped (status $status) without a new checkpoint in '$SAVE_DIR'; not requeued"
    exit "$((status ? status : 1))"
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
