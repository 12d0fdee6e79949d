"""The GPU check's calibration of the step-time model, rehearsed on the CPU: it measures this
device, writes a profile the model (and ``--cluster``) reads, and predicts the check's own GPT
step from it."""

from __future__ import annotations

import math

import yaml

from megatron.estimate.cluster import load_cluster
from tools.gpu_check.calibration import predict
from tools.gpu_check.data import write_null_dataset
from tools.gpu_check.plan import DRY
from tools.gpu_check.pretrain import overrides


def test_dry_calibration_predicts_the_check_step(tmp_path):
    data = write_null_dataset(str(tmp_path / "ids"), DRY.vocab_size, DRY.data_tokens, seed=0)
    args = overrides(data, tmp_path / "run", DRY.vocab_size, DRY.gpt_overrides)
    log = tmp_path / "log"
    result = predict(DRY.gpt_config, args, 50.0, True, 120, log)
    profile = result["profile"]
    assert profile["device"] == "cpu" and set(profile["peak_tflops"]) == {"bf16"}
    fractions = [f for _, f in profile["gemm_efficiency"]]
    assert max(fractions) == 1.0 and all(0 < f <= 1 for f in fractions)
    assert result["predicted_ms_per_iter"] > 0 and result["measured_ms_per_iter"] == 50.0
    assert math.isclose(result["error"], result["predicted_ms_per_iter"] / 50.0 - 1)
    path = tmp_path / "measured.yaml"  # what a user saves of the JSON, for --cluster
    path.write_text(yaml.safe_dump(profile))
    assert load_cluster(str(path)).peak("bf16") == profile["peak_tflops"]["bf16"] * 1e12
