"""benchmarks/bench_checkpoint_io.py, run tiny: it runs, prints every field, and our shard file is
byte for byte what safetensors.torch.save makes (its speed targets are the benchmark's to report,
never a test's)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_checkpoint_io_runs_tiny(tmp_path):
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_checkpoint_io.py", "--size-mb", "4", "--rounds", "1",
         "--dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["safetensors_identical"] is True
    for kind in ("ours", "torch", "dcp"):
        for op in ("save", "load"):
            assert result[f"{kind}_{op}_s"] > 0 and result[f"{kind}_{op}_mib_per_s"] > 0
    for field in ("save_ratio_ours_to_dcp", "load_ratio_ours_to_dcp", "state_mib"):
        assert result[field] > 0
    for save in ("sync", "async"):
        assert result[f"{save}_save_peak_rss_mib"] >= result[f"{save}_save_rss_before_mib"] > 0
        assert result[f"{save}_save_peak_ratio"] > 0
    assert os.listdir(tmp_path) == []  # everything it wrote is gone
