"""The dry run's time lines (``--cluster NAME --nodes N``): the step-time model's prediction for
this config and layout on that cluster (megatron/estimate/step_time.py; its terms and sources in
docs/performance_model.md)."""

from __future__ import annotations

import argparse
from typing import TextIO

from megatron.config.schema import Config
from megatron.errors import ConfigError
from megatron.estimate.cluster import Cluster, load_cluster
from megatron.estimate.parameters import ModelType
from megatron.estimate.step_time import step_time, weak_scaling_efficiency


def cluster_and_world(args: argparse.Namespace) -> tuple[Cluster | None, int | None]:
    """The ``--cluster`` profile (None without one) and the world size ``--nodes`` of it make
    (None without ``--nodes``; ``--world-size`` must then agree)."""
    cluster = getattr(args, "cluster", None)
    nodes = getattr(args, "nodes", None)
    if cluster is None:
        if nodes is not None:
            raise ConfigError("--nodes needs --cluster NAME (the GPUs per node come from it)")
        return None, None
    profile = load_cluster(cluster)
    if nodes is None:
        return profile, None
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes}: give at least one node")
    world = nodes * profile.gpus_per_node
    if args.world_size and args.world_size != world:
        raise ConfigError(
            f"--world-size {args.world_size} disagrees with --nodes {nodes} x "
            f"{profile.gpus_per_node} GPUs of {profile.name} = {world}; give one of them"
        )
    return profile, world


def report_time(
    cfg: Config,
    padded_vocab: int,
    model_type: ModelType,
    world: int,
    cluster: Cluster,
    out: TextIO,
) -> dict[str, float]:
    """Write the predicted step's lines; return its figures for ``--json``."""
    step = step_time(cfg, padded_vocab, model_type, world, cluster)
    weak = weak_scaling_efficiency(cfg, padded_vocab, model_type, world, cluster)
    nodes = -(-world // cluster.gpus_per_node)
    crossing = [group for group, crosses in step.crosses_nodes.items() if crosses]
    out.write(
        f"predicted on {nodes} node(s) of {cluster.name} ({world} GPUs, {cfg.precision.dtype}): "
        f"{step.seconds * 1e3:,.0f} ms/iteration, {step.tokens_per_s:,.0f} tokens/s, "
        f"{step.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {step.mfu:.1%}\n"
        f"  communication {step.comm * 1e3:,.0f} ms per GPU per step, "
        f"{step.exposed_comm * 1e3:,.0f} ms exposed ({step.exposed_comm_fraction:.1%} of the "
        f"step); across nodes: {', '.join(crossing) or 'nothing'}\n"
        f"  pipeline bubble (the schedule replayed with these unit times): "
        f"{step.bubble_fraction:.1%} of the busy time\n"
        f"  weak-scaling efficiency against one node: {weak:.1%} (model and sources: "
        "docs/performance_model.md)\n"
    )
    return {
        "ms_per_iter": step.seconds * 1e3,
        "tokens_per_s": step.tokens_per_s,
        "tflops_per_gpu": step.tflops_per_gpu,
        "mfu": step.mfu,
        "exposed_comm_fraction": step.exposed_comm_fraction,
        "bubble_fraction": step.bubble_fraction,
        "weak_scaling_efficiency": weak,
    }
