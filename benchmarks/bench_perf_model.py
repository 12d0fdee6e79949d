"""The step-time model against measured iterations of pretrain_gpt.py on this machine.

Runs a small GPT (4 layers, hidden 256, 8 heads, seq 256, micro-batch 4, global batch 16, fp32,
vocab 512) at TP1 (one process), TP2, DP2, PP2, TP2 with sequence parallelism and DP2 with the
distributed optimizer (two processes of one thread each), and sets the model's ms/iteration
beside each run's fastest iteration after warm-up (its metrics file; the median too).

Right before each run it calibrates a profile with as many processes as the run has
(megatron/estimate/calibrate.py: GEMM throughput by size, copy bandwidth, an activation's
forward and backward, causal fused attention, all of one thread, every process measuring at
once, since two processes on a shared 2-core machine get less than two cores; with two, gloo's
all-reduce bandwidth and latency between them, its all-gather and reduce-scatter against the
ring model, and what a collective costs beyond that when it follows compute, as a step's do).
This machine's speed drifts by a fifth and more over minutes with its host's other work, so a
profile measured minutes before a run describes another machine. The calibration keeps each
figure's fastest repeat and the runs their fastest iteration alike. Prints one JSON line, with
the machine's load.

    .venv/bin/python benchmarks/bench_perf_model.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_pretrain import SHAPE as MODEL_SHAPE  # noqa: E402
from megatron.config.load import load_config  # noqa: E402
from megatron.estimate.calibrate import (  # noqa: E402
    attention_rate,
    collective_factors,
    collective_sync,
    cpu_profile,
    elementwise_bandwidth,
    gemm_table,
    link_figures,
    stream_bandwidth,
)
from megatron.estimate.cluster import Cluster, load_cluster  # noqa: E402
from megatron.estimate.step_time import step_time  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.gpt_run import prepare_gpt_data, read_metrics, run_pretrain, tiny_overrides  # noqa: E402

SHAPE = {  # bench_pretrain.py's model, at a batch that splits over DP 2 and PP 2
    **MODEL_SHAPE,
    "training.micro_batch_size": 4,
    "training.global_batch_size": 16,
    "training.eval_iters": 0,
}
ITERS, WARMUP = 20, 4
ATTENTION_SHAPE = (4, 8, 256, 32)  # the model's micro-batch, heads, sequence and head width
LAYOUTS = {  # name -> (processes, overrides)
    "TP1": (1, {"parallel.tensor_parallel_size": 1}),
    "TP2": (2, {"parallel.tensor_parallel_size": 2}),
    "DP2": (2, {"parallel.tensor_parallel_size": 1}),
    "PP2": (2, {"parallel.tensor_parallel_size": 1, "parallel.pipeline_parallel_size": 2}),
    "TP2+SP": (2, {"parallel.tensor_parallel_size": 2, "parallel.sequence_parallel": "true"}),
    "DP2+distopt": (
        2,
        {"parallel.tensor_parallel_size": 1, "parallel.distributed_optimizer": "true"},
    ),
}


def _measure(world: int) -> tuple:
    """GEMMs and copies on every process at once (as a layout of ``world`` processes runs
    them), then, with two, the link between them."""
    cpu = torch.device("cpu")
    torch.set_num_threads(1)
    if world > 1:
        torch.distributed.init_process_group("gloo")
    peak, table = gemm_table(cpu, torch.float32)
    stream, elementwise = stream_bandwidth(cpu), elementwise_bandwidth(cpu)
    attention = attention_rate(cpu, torch.float32, ATTENTION_SHAPE)
    link = link_figures() if world > 1 else (1.0, 1.0)
    factors = collective_factors(link) if world > 1 else (1.0, 1.0)
    sync = collective_sync(link) if world > 1 else 0.0
    return peak, table, stream, link, elementwise, attention, factors, sync


def calibrate(out: Path, processes: int) -> Path:
    """Measure this machine with ``processes`` processes at once; a profile of it, under
    ``out``."""
    peak, table, stream, link, elementwise, attention, factors, sync = run_distributed(
        _measure, processes, processes
    )[0]
    path = out / f"this-cpu-{processes}.yaml"
    profile = cpu_profile(
        path.stem, peak, table, stream, link, elementwise, attention, factors, sync
    )
    path.write_text(yaml.safe_dump(profile))
    return path


def measured_ms(data: dict, run_dir: Path, nproc: int, overrides: list[str]) -> tuple[float, float]:
    """(fastest, median) ms/iteration after warm-up."""
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", overrides, nproc=nproc, timeout=900)
    times = [e["ms_per_iter"] for e in read_metrics(run_dir / "metrics.jsonl")][WARMUP:]
    return min(times), statistics.median(times)


def _figures(c: Cluster, processes: int) -> dict[str, float]:
    """A calibrated profile's figures, rounded; its link's only where there were two ranks."""
    figures = {
        "peak_gflops": round(c.peak("fp32") / 1e9, 1),
        "copy_gb_per_s": round(c.hbm_gb_per_s, 2),
        "elementwise_gb_per_s": round(c.hbm() / 1e9, 2),
        "attention_fraction_of_peak": round(c.attention_efficiency or 0.0, 3),
    }
    if processes == 1:
        return figures
    return figures | {
        "gloo_gb_per_s": round(c.intra_node_gb_per_s, 3),
        "gloo_latency_us_per_step": round(c.intra_node_latency_us, 1),
        "all_gather_factor": round(c.all_gather_factor, 2),
        "reduce_scatter_factor": round(c.reduce_scatter_factor, 2),
        "collective_sync_us": round(c.collective_sync_us, 1),
    }


def main() -> None:
    results, clusters = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_gpt_data(Path(tmp))
        for name, (nproc, layout) in LAYOUTS.items():
            clusters[name] = load_cluster(str(calibrate(Path(tmp), nproc)))
            run_dir = Path(tmp) / name
            extra = {**SHAPE, **layout, "training.train_iters": ITERS}
            overrides = tiny_overrides(data, run_dir, **extra)
            cfg = load_config(["configs/gpt_tiny.yaml"], overrides)
            padded = cfg.derived(nproc).padded_vocab_size(512)
            predicted = step_time(cfg, padded, "gpt", nproc, clusters[name]).seconds * 1e3
            fastest, median = measured_ms(data, run_dir, nproc, overrides)
            results[name] = {
                "predicted_ms": round(predicted, 1),
                "measured_ms": round(fastest, 1),
                "measured_median_ms": round(median, 1),
                "error": round(predicted / fastest - 1, 3),
            }
    within = sum(abs(r["error"]) <= 0.2 for r in results.values())
    profile = {name: _figures(c, LAYOUTS[name][0]) for name, c in clusters.items()}
    line = {"layouts": results, "within_20_percent": f"{within} of {len(results)}"}
    print(json.dumps(line | {"profile": profile, "loadavg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
