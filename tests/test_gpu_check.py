"""``scripts/gpu_check.sh --dry``: every step runs on the CPU and writes its JSON file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.estimate.device_peaks import bf16_peak_tflops, mfu
from tests.gpt_run import ROOT

STEPS = ["tests", "gpt_bf16", "fp16_loss_scale", "sdpa", "ring_attention"]


def test_device_peaks_match_the_most_specific_name():
    assert bf16_peak_tflops("NVIDIA H200") == 989.0
    assert bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bf16_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert bf16_peak_tflops("cpu") is None and mfu(100.0, "cpu") is None
    assert mfu(494.5, "NVIDIA H200") == pytest.approx(0.5)


@pytest.mark.slow
def test_dry_run_writes_every_step(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == STEPS
    records = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in STEPS}
    for name, record in records.items():
        assert record["status"] == "ok", f"{name}: {record.get('error')}\n{proc.stdout[-3000:]}"
        assert record["dry"] is True and record["environment"]["device"] == "cpu"
        assert record["seconds"] > 0 and "git_commit" in record["environment"]
    assert proc.returncode == 0 and summary["ok"]

    tests = records["tests"]["figures"]
    assert tests["device"] == "cpu" and tests["passed"] > 0 and tests["failed"] == 0
    gpt = records["gpt_bf16"]["figures"]
    assert gpt["dtype"] == "bf16" and gpt["measured_iters"] == 5
    assert gpt["tokens_per_s"] > 0 and gpt["tflops_model"] > 0 and gpt["mfu"] is None
    assert gpt["peak_memory_gib"] > 0 and gpt["estimated_memory_gib"] > 0
    fp16 = records["fp16_loss_scale"]["figures"]
    assert fp16["dtype"] == "fp16" and len(fp16["loss_scale"]) == fp16["iterations"] == 6
    assert fp16["nan"] == 0 and fp16["lm_loss_first_last"] is not None
    sdpa = records["sdpa"]["figures"]
    assert sdpa["backends"]["gpt_causal"]["MATH"] == "ok"
    assert sdpa["backends"]["bert_padding_mask"]["MATH"] == "ok"
    assert all(any("scaled_dot_product" in k for k in ran) for ran in sdpa["ran"].values())
    ring = records["ring_attention"]["figures"]
    assert ring["kernel"] == "_scaled_dot_product_flash_attention_for_cpu"
    assert ring["shape"]["cp"] == 2 and ring["fwd_bwd_ms"] > 0
    assert ring["max_error"] < 2e-2  # bf16 against bf16 SDPA over the whole sequence


def test_a_missing_package_is_one_line_before_any_step(tmp_path):
    """An interpreter without pytest (here: ours without its site-packages) is named in one
    line with the install command, exit 2, and no step runs (no log, no JSON)."""
    python = tmp_path / "python-bare"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(python)}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("gpu_check: pytest, ") and f"not installed for {sys.executable};" in line
    assert line.endswith(f"install -r {ROOT / 'requirements-dev.txt'}")
    assert not (tmp_path / "out").exists()
