"""Calibrating a profile from this machine (megatron/estimate/calibrate.py): what it measures
becomes a profile the step-time model loads. The figures themselves are timings, checked by
benchmarks/bench_perf_model.py against real runs, not here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import yaml

from megatron.config.load import load_config
from megatron.errors import ConfigError
from megatron.estimate.calibrate import (
    GEMM_SIDES,
    attention_rate,
    collective_factors,
    collective_sync,
    cpu_profile,
    elementwise_bandwidth,
    gemm_table,
    link_figures,
    stream_bandwidth,
)
from megatron.estimate.cluster import load_cluster
from megatron.estimate.step_time import step_time
from tests.distributed import run_distributed


def test_a_measured_cpu_profile_loads_and_predicts(tmp_path):
    torch.set_num_threads(1)
    peak, table = gemm_table(torch.device("cpu"), torch.float32)
    assert len(table) == len(GEMM_SIDES) and max(f for _, f in table) == 1.0
    assert [g for g, _ in table] == sorted(g for g, _ in table)
    path = tmp_path / "here.yaml"
    profile = cpu_profile("here", peak, table, stream_bandwidth(torch.device("cpu")), (1e9, 1e-4))
    path.write_text(yaml.safe_dump(profile))
    cluster = load_cluster(str(path))
    assert cluster.device == "cpu" and cluster.peak("fp32") == pytest.approx(peak)
    cfg = load_config(["configs/gpt_tiny.yaml"], ["precision.dtype=fp32"])
    assert step_time(cfg, 512, "gpt", 2, cluster).seconds > 0
    with pytest.raises(ConfigError, match="precision.dtype=bf16"):
        step_time(load_config(["configs/gpt_tiny.yaml"], ["precision.dtype=bf16"]), 512, "gpt",
                  2, cluster)  # fmt: skip


def test_slower_attention_and_activations_measured_slow_the_prediction(tmp_path):
    """The CPU's own figures for fused attention and memory-bound kernels enter the profile,
    and a slower measurement of either predicts a slower step."""
    cpu = torch.device("cpu")
    torch.set_num_threads(1)
    peak, table = gemm_table(cpu, torch.float32, (64, 128))
    stream, elementwise = stream_bandwidth(cpu), elementwise_bandwidth(cpu)
    attention = attention_rate(cpu, torch.float32, (2, 4, 128, 32))
    assert 0 < elementwise and 0 < attention
    cfg = load_config(["configs/gpt_tiny.yaml"], ["precision.dtype=fp32"])

    def seconds(elementwise: float, attention: float) -> float:
        profile = cpu_profile("here", peak, table, stream, (1e9, 1e-4), elementwise, attention)
        path = tmp_path / "here.yaml"
        path.write_text(yaml.safe_dump(profile))
        return step_time(cfg, 512, "gpt", 2, load_cluster(str(path))).seconds

    base = seconds(elementwise, attention)
    assert seconds(elementwise / 2, attention) > base and seconds(elementwise, attention / 2) > base


def _link() -> tuple[tuple[float, float], tuple[float, float], float]:
    dist.init_process_group("gloo")
    link = link_figures()
    return link, collective_factors(link), collective_sync(link, calls=4, chains=2)


@pytest.mark.slow
def test_the_link_is_measured_on_both_ranks_alike(tmp_path):
    """Both ranks measure the link, the sequence-parallel collectives against it and the wait a
    collective after compute adds; a slower all-gather measured makes a sequence-parallel step
    slower, and only that one."""
    ((bw0, lat0), factors, sync0), ((bw1, lat1), _, sync1) = run_distributed(_link, 2)
    assert bw0 > 0 and bw1 > 0 and lat0 > 0 and lat1 > 0 and min(factors) > 0
    assert sync0 == sync1 >= 0
    cfg = load_config(["configs/gpt_tiny.yaml"], ["precision.dtype=fp32"])
    sequence = load_config(
        ["configs/gpt_tiny.yaml"], ["precision.dtype=fp32", "parallel.sequence_parallel=true"]
    )

    def seconds(cfg, gather: float) -> float:
        profile = cpu_profile("here", 1e11, [[1.0, 1.0]], 1e10, (bw0, lat0), None, None,
                              (gather, factors[1]))  # fmt: skip
        path = tmp_path / "here.yaml"
        path.write_text(yaml.safe_dump(profile))
        return step_time(cfg, 512, "gpt", 2, load_cluster(str(path))).seconds

    assert seconds(sequence, 4 * factors[0]) > seconds(sequence, factors[0])
    assert seconds(cfg, 4 * factors[0]) == seconds(cfg, factors[0])


def test_each_collective_call_pays_the_measured_sync_once(tmp_path):
    """Per micro-batch at TP2, each layer makes four TP collectives (two all-reduces each way),
    the embedding and the head one each, and the vocab-parallel loss three; with sequence
    parallelism each all-reduce becomes an all-gather and a reduce-scatter, and the embedding's
    split and the head's gather add one each way: eight a layer, two each for the embedding and
    the head. A measured wait per call adds exactly that many waits to the step (one stage,
    nothing overlapped on CPU)."""
    sync = 1e-3

    def seconds(cfg, sync_s: float) -> float:
        profile = cpu_profile("here", 1e11, [[1.0, 1.0]], 1e10, (1e9, 1e-4), sync=sync_s)
        path = tmp_path / "here.yaml"
        path.write_text(yaml.safe_dump(profile))
        return step_time(cfg, 512, "gpt", 2, load_cluster(str(path))).seconds

    for sp, per_layer, ends in (("false", 4, 2 + 3), ("true", 8, 4 + 3)):
        cfg = load_config(["configs/gpt_tiny.yaml"], [f"parallel.sequence_parallel={sp}"])
        micro = cfg.training.global_batch_size // cfg.training.micro_batch_size  # DP 1
        calls = micro * (cfg.model.num_layers * per_layer + ends)
        added = seconds(cfg, sync) - seconds(cfg, 0.0)
        assert added == pytest.approx(calls * sync), sp
