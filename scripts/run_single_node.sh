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
#   PYTHON      interpreter with the requirements installed (default: python)
#   SHUTDOWN_TIMEOUT  seconds torchrun waits for the ranks after forwarding SIGTERM (default 280)
#
# Run from the repository root. `kill -TERM <torchrun pid>` makes every rank save and exit
# (training.exit_signal=SIGTERM): torchrun forwards the signal and, by default, sends SIGKILL
# 30 s later; --shutdown-timeout below gives a large model's save SHUTDOWN_TIMEOUT seconds.
set -euo pipefail

if (($# < 1)); then
    echo "usage: ${0##*/} CONFIG.yaml [section.key=value ...]" >&2
    exit 2
fi
CONFIG=$1
shift
ENTRYPOINT=${ENTRYPOINT:-pretrain_gpt.py}
LOG_DIR=${LOG_DIR:-logs/torchrun}
PYTHON=${PYTHON:-python}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-280}

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

CMD=("$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NPROC"
    --log-dir="$LOG_DIR" --tee=3 --local-ranks-filter=0 --shutdown-timeout="$SHUTDOWN_TIMEOUT"
    "$ENTRYPOINT" --config "$CONFIG" "$@")
echo "== ${CMD[*]}"
exec "${CMD[@]}"
