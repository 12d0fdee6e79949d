"""The step-time model calibrated on the device the check runs on, and its prediction of the
check's own GPT step set against the measurement (docs/performance_model.md).

``python -m tools.gpu_check.calibration --dtype bf16 [--dry]`` measures this device's GEMM
throughput by size and its streaming bandwidth (megatron/estimate/calibrate.py) and prints the
resulting profile as one JSON line: the shipped profile of the same GPU (its links, which one
GPU's step does not use) with the measured figures in place. On the CPU (``--dry``) the base is
a one-thread CPU profile whose link figures are placeholders, as nothing here crosses a link.
``predict`` runs it and returns the profile, the predicted and the measured ms/iteration.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from megatron.config.load import load_config
from megatron.estimate.calibrate import cpu_profile, measured_device
from megatron.estimate.cluster import PROFILE_DIR, Cluster
from megatron.estimate.step_time import step_time
from tools.gpu_check.environment import ROOT, device_name
from tools.gpu_check.runner import run_command

GPU_SIDES, CPU_SIDES = (512, 1024, 2048, 4096, 8192), (32, 64, 128, 256)
# (batch, heads, seq, head dim) of the attention timed: the 1.2B step's, and the dry plan's.
GPU_ATTENTION, CPU_ATTENTION = (8, 16, 1024, 96), (2, 4, 64, 16)
# The shipped profile whose links a measured GPU keeps, by a word of its name.
_BASES = {"H200": "dgx-h200", "H100": "dgx-h100", "A100": "dgx-a100-80gb", "V100": "dgx2h-v100"}
_PLACEHOLDER_LINK = (1e9, 1e-5)  # bytes/s, s per ring step: unused by a one-process step


def _base(name: str) -> dict[str, Any]:
    shipped = next((p for word, p in _BASES.items() if word in name), "dgx-h100")
    return yaml.safe_load((Path(PROFILE_DIR) / f"{shipped}.yaml").read_text())


def profile(dtype: str, dry: bool) -> dict[str, Any]:
    """This device's measured profile for ``dtype``."""
    if dry or not torch.cuda.is_available():
        torch.set_num_threads(1)
        base = cpu_profile("cpu", 1.0, [[1.0, 1.0]], 1.0, _PLACEHOLDER_LINK)
        return measured_device(base, torch.device("cpu"), dtype, CPU_SIDES, CPU_ATTENTION)
    cuda = torch.device("cuda")
    return measured_device(_base(device_name()), cuda, dtype, GPU_SIDES, GPU_ATTENTION)


def predict(
    config: str, args: list[str], measured_ms: float, dry: bool, timeout: float, log: Path
) -> dict[str, Any]:
    """The calibrated profile, and the step time it predicts for ``config`` with ``args`` (one
    process) against ``measured_ms``."""
    cfg = load_config([config], args)
    cmd = [sys.executable, "-m", "tools.gpu_check.calibration", "--dtype", cfg.precision.dtype]
    measured = json.loads(run_command([*cmd, *(["--dry"] if dry else [])], timeout, log, cwd=ROOT)
                          .splitlines()[-1])  # fmt: skip
    cluster = Cluster(**measured)
    padded = cfg.derived(1).padded_vocab_size(cfg.tokenizer.vocab_size + 1)
    predicted = step_time(cfg, padded, "gpt", 1, cluster).seconds * 1000
    return {
        "profile": measured,
        "predicted_ms_per_iter": predicted,
        "measured_ms_per_iter": measured_ms,
        "error": predicted / measured_ms - 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--dry", action="store_true")
    args = parser.parse_args()
    print(json.dumps(profile(args.dtype, args.dry)))


if __name__ == "__main__":
    main()
