#!/usr/bin/env bash
# The GPU check (docs/gpu_check.md): CUDA tests, GPT 1.2B throughput and MFU in bf16, fp16 loss
# scaling and the SDPA backends, each step's figures as JSON under $OUT (else ./gpu_check/).
# At most 8 minutes on one GPU; steps that fail are recorded and the rest still run.
#
#   scripts/gpu_check.sh          # on a GPU
#   scripts/gpu_check.sh --dry    # the same steps on the CPU, tiny shapes, no MFU
#
#   PYTHON  interpreter with the requirements installed (default: python3)
#   OUT     where the JSON files go (default: gpu_check/ in the repository)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null; then
    echo "gpu_check: PYTHON=$PY is not an interpreter here; set PYTHON to one" >&2
    exit 2
fi
# Every package the steps import, before any runs: a missing one is one line and exit 2.
"$PY" -m tools.gpu_check.requirements
export PYTHONUNBUFFERED=1
# One connection per device so the overlapped TP communication is issued in order (issue #11).
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec "$PY" -m tools.gpu_check --out "${OUT:-gpu_check}" "$@"
