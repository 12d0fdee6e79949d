#!/bin/bash
# Pretrain on one machine: torchrun --standalone over its local GPUs, showing rank 0's output
# (every rank's full output goes to $LOG_DIR).
#
#   scripts/run_single_node.sh configs/gpt_345m.yaml [section.key=value ...]
#   NPROC=4 scripts/run_single_node.sh configs/gpt_345m.yaml parallel.tensor_parallel_size=2
#   NPROC=2 scripts/run_single_node.sh configs/gpt_tiny.yaml        # CPU: two gloo processes
#   ENTRYPOINT=pretrain_bert.py scripts/run_single_node.sh configs/bert_336m.yaml
#
#   NPROC       processes (default: one per visible GPU, from CUDA_VISIBLE_DEVICES or
#               nvidia-smi -L; without GPUs, gloo processes on the CPU: the largest power of two
#               up to the CPU count and 8, since the shipped TP and batch sizes are powers of two)
#   ENTRYPOINT  pretrain_gpt.py (default) or pretrain_bert.py
#   LOG_DIR     where torchrun tees every rank's stdout/stderr (default: logs/torchrun)
#   PYTHON      interpreter with the requirements installed (default: the repository's
#               .venv/bin/python when there is one, else python3)
#   SHUTDOWN_TIMEOUT  seconds torchrun waits for the other ranks after one fails (default 280)
#   MAX_RESTARTS  times torchrun restarts the workers after one fails (default 3): each attempt
#               resumes from the newest checkpoint in checkpoint.save; 0: never
#
# Run from the repository root. The entrypoint's --preflight runs first (config, files, world
# size): a mistake is one line and exit 2, and torchrun never starts. torchrun runs as
# megatron.launch.torchrun: torchrun whose failure is the failed worker's one line and exit code
# (2 config, 4 storage, 3 NaN stop, 1 lost peer), not a traceback and 1.
#
# SIGTERM (what a scheduler or `kill` sends), SIGUSR1 or SIGUSR2 to this script makes every rank
# save and exit 0: the script sends training.exit_signal to the ranks themselves (torchrun's
# children), and torchrun, started with these three ignored and without them in
# --signals-to-handle, does not act on them. Were torchrun to catch one, it would pass it on and
# then exit 1 (a SignalException) even after every rank saved; this way the script's exit status
# is torchrun's, which is the ranks' own (a signal that comes before the ranks have started
# reaches none of them). A collective that fails or times out ends the process
# (TORCH_NCCL_ASYNC_ERROR_HANDLING=1) after dumping the flight recorder
# (TORCH_NCCL_DUMP_ON_TIMEOUT=1, TORCH_FR_BUFFER_SIZE=2000); set them to override.
set -euo pipefail

if (($# < 1)); then
    echo "usage: ${0##*/} CONFIG.yaml [section.key=value ...]" >&2
    exit 2
fi
CONFIG=$1
shift
ENTRYPOINT=${ENTRYPOINT:-pretrain_gpt.py}
LOG_DIR=${LOG_DIR:-logs/torchrun}
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
    if [[ ! -x $PYTHON ]]; then PYTHON=python3; fi
    echo "== PYTHON=$PYTHON (the repository's .venv, else python3; set PYTHON to choose)"
fi
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-280}
MAX_RESTARTS=${MAX_RESTARTS:-3}

# torchrun's own default (--nproc-per-node=gpu) dies with a traceback on a machine without CUDA.
if [[ -z ${NPROC:-} ]]; then
    if [[ -v CUDA_VISIBLE_DEVICES ]]; then
        IFS=, read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
        gpus=0
        # CUDA stops at the first invalid entry: "-1" (or "") hides every GPU.
        for device in "${visible[@]}"; do
            [[ $device == -* ]] && break
            gpus=$((gpus + 1))
        done
        seen_by="CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
    else
        gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
        seen_by="nvidia-smi -L"
    fi
    if ((gpus > 0)); then
        NPROC=$gpus
        echo "== NPROC=$NPROC: one process per visible GPU ($seen_by)"
    else
        cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) # nproc obeys them, not the CPUs
        NPROC=1
        while ((NPROC * 2 <= cpus && NPROC * 2 <= 8)); do NPROC=$((NPROC * 2)); done
        echo "== NPROC=$NPROC: no GPU visible ($seen_by), CPU processes on gloo (the largest" \
            "power of two <= min($cpus CPUs, 8)); set NPROC to choose"
    fi
fi

# One CUDA hardware queue per process: kernels then start in the order they are issued, so the
# column-parallel layers' input-gradient all-reduce, issued before their weight-gradient GEMM,
# really runs alongside it (megatron/parallel/layers.py turns that overlap on only with this set).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}

# The checks training runs before its first collective, in one process: exit 2 on a mistake.
"$PYTHON" "$ENTRYPOINT" --preflight --world-size "$NPROC" --config "$CONFIG" "$@"
# Its warnings are shown: the workers run the same checks and leave them out (pretrain.py).
export MEGATRON_PREFLIGHT_PASSED=1

# torchrun runs with the stop signals ignored and leaves them out of --signals-to-handle.
STOP_SIGNALS=(SIGTERM SIGUSR1 SIGUSR2)
CMD=("$PYTHON" -m megatron.launch.torchrun --standalone --nnodes=1 --nproc-per-node="$NPROC"
    --log-dir="$LOG_DIR" --tee=3 --local-ranks-filter=0 --signals-to-handle=SIGINT,SIGHUP,SIGQUIT
    --shutdown-timeout="$SHUTDOWN_TIMEOUT" --max-restarts="$MAX_RESTARTS" "$ENTRYPOINT" --config "$CONFIG" "$@")
echo "== ${CMD[*]}"

OVERRIDES=("$@")
# The signal the ranks save on, read with the run's own config loader when a stop comes.
exit_signal() {
    "$PYTHON" - "$CONFIG" "${OVERRIDES[@]}" <<'EOF'
import sys

from megatron.config.load import load_config

print(load_config([sys.argv[1]], sys.argv[2:]).training.exit_signal)
EOF
}
TORCHRUN_PID=
TRAPPED= # set by the trap, so that the wait it cut short is waited again
on_stop() {
    local signal
    TRAPPED=1
    if ! signal=$(exit_signal); then
        signal=SIGTERM
        echo "== could not read training.exit_signal from $CONFIG; sending $signal"
    fi
    echo "== $(date -Is) $1: every rank saves and exits ($signal to torchrun's workers)"
    if [[ -n $TORCHRUN_PID ]]; then pkill "-$signal" -P "$TORCHRUN_PID" || true; fi
}
for sig in "${STOP_SIGNALS[@]}"; do trap "on_stop $sig" "$sig"; done
# The subshell becomes torchrun (same pid) with the stop signals ignored: an ignored signal stays
# ignored across exec, and torchrun's workers install their own handler for training.exit_signal
# (the other two stay ignored in them).
(
    trap '' "${STOP_SIGNALS[@]}"
    exec "${CMD[@]}"
) &
TORCHRUN_PID=$!
while :; do
    TRAPPED=
    status=0
    wait "$TORCHRUN_PID" || status=$?
    if ((status > 128)) && [[ -n $TRAPPED ]]; then continue; fi
    exit "$status"
done
