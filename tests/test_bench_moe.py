"""benchmarks/bench_moe.py's timed rows run and time what they say: the MoE layer on the grouped
GEMM against a dense MLP, and ours against a MixtralForCausalLM of exactly as many parameters."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import bench_moe
from megatron.parallel.state import ParallelState

ONE_STEP = argparse.Namespace(steps=1, warmup=0)


def test_layer_row():
    row = bench_moe.layer_row(ParallelState.serial(torch.device("cpu")), ONE_STEP)
    assert row["grouped_gemm"] and row["moe_ms"] > 0 and row["dense_ms"] > 0


@pytest.mark.slow
def test_mixtral_row_compares_models_of_one_size():
    pytest.importorskip("transformers")
    row = bench_moe.mixtral_row(ParallelState.serial(torch.device("cpu")), ONE_STEP)
    assert row["params_ours"] == row["params_hf"] > 0
