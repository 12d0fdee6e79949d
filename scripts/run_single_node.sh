#!/bin/bash
# Pretrain on one machine: torchrun --standalone over its local GPUs, showing rank 0's output
# (every rank's full output goes to $LOG_DIR).
#
#   scripts/run_single_node.sh configs/gpt_345m.yaml [section.key=value ...]
#   NPROC=4 scripts/run_single_node.sh configs/gpt_345m.yaml parallel.tensor_parallel_size=2
#   NPROC=2 scripts/run_single_node.sh configs/gpt_tiny.yaml        # CPU: two gloo processes
#   ENTRYPOINT=pretrain_bert.py scripts/run_single_node.sh configs/bert_336m.yaml
#
#   NPROC       processes (default: gpu, one per visible GPU; set a number on a CPU machine)
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
NPROC=${NPROC:-gpu}
ENTRYPOINT=${ENTRYPOINT:-pretrain_gpt.py}
LOG_DIR=${LOG_DIR:-logs/torchrun}
PYTHON=${PYTHON:-python}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-280}

CMD=("$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NPROC"
    --log-dir="$LOG_DIR" --tee=3 --local-ranks-filter=0 --shutdown-timeout="$SHUTDOWN_TIMEOUT"
    "$ENTRYPOINT" --config "$CONFIG" "$@")
echo "== ${CMD[*]}"
exec "${CMD[@]}"
