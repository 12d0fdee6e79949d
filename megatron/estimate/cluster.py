"""Cluster profiles for the step-time model: one GPU's peaks and bandwidths, and its links.

A profile is a YAML file (the shipped ones in megatron/estimate/clusters/, sources in their
comments and in docs/performance_model.md); ``--cluster`` takes a shipped name or a path. Every
field is required but the measured ones (``attention_efficiency``, the collectives' factors);
bandwidths are each way, per GPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, fields
from typing import NamedTuple

import yaml

from megatron.errors import ConfigError

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clusters")


class Link(NamedTuple):
    """A link's achievable bandwidth (bytes/s, each way, per GPU) and per-message latency (s);
    how much longer than the ring model its all-gathers and reduce-scatters take (measured); and
    the seconds each collective call costs the host that waits for it after compute (measured)."""

    bandwidth: float
    latency: float
    gather: float = 1.0
    scatter: float = 1.0
    sync: float = 0.0


@dataclass(frozen=True)
class Cluster:
    name: str
    device: str  # "cuda" or "cpu": which overlaps the code turns on (megatron/parallel/layers.py)
    gpus_per_node: int
    gpu_memory_gb: float  # GiB, as the dry run's --gpu-memory-gb
    peak_tflops: dict[str, float]  # dense tensor-core peak per precision.dtype
    hbm_gb_per_s: float
    hbm_efficiency: float  # the fraction of HBM bandwidth that streaming kernels reach
    intra_node_gb_per_s: float  # NVLink / NVSwitch, each way per GPU
    inter_node_gb_per_s: float  # the network, each way per GPU
    link_efficiency: float  # the fraction of a link's bandwidth that NCCL's rings reach
    intra_node_latency_us: float  # per step of a ring (one hop), not per collective
    inter_node_latency_us: float
    gemm_efficiency: list[list[float]]  # [GFLOP of one GEMM, fraction of peak], ascending
    # Fused attention's fraction of peak (its FLOPs counted as a full, unmasked product, as
    # flops.py counts them); optional, measured by a calibration: else a GEMM's of its size.
    attention_efficiency: float | None = None
    # Measured time of an all-gather / a reduce-scatter over the ring model's at the same link
    # (gloo's run well above it); optional: 1.
    all_gather_factor: float = 1.0
    reduce_scatter_factor: float = 1.0
    # Measured seconds (in µs) a collective costs beyond its ring time when called right after
    # compute, once per call: where the host runs the collective itself (gloo), each rank waits
    # for the later one and for its own wake-up. Optional: 0, as on GPUs, where NCCL's kernels
    # queue behind the compute and the host does not wait.
    collective_sync_us: float = 0.0

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s for ``dtype``; ConfigError when the profile has no figure for it."""
        if dtype not in self.peak_tflops:
            have = ", ".join(sorted(self.peak_tflops))
            raise ConfigError(
                f"cluster {self.name} has no peak_tflops for precision.dtype={dtype} (it has "
                f"{have}); set precision.dtype to one of them or add it to the profile"
            )
        return self.peak_tflops[dtype] * 1e12

    def hbm(self) -> float:
        """Achievable HBM bytes/s."""
        return self.hbm_gb_per_s * 1e9 * self.hbm_efficiency

    def link(self, crosses_nodes: bool) -> Link:
        gb, us = (
            (self.inter_node_gb_per_s, self.inter_node_latency_us)
            if crosses_nodes
            else (self.intra_node_gb_per_s, self.intra_node_latency_us)
        )
        factors = (self.all_gather_factor, self.reduce_scatter_factor)
        sync = self.collective_sync_us * 1e-6
        return Link(gb * 1e9 * self.link_efficiency, us * 1e-6, *factors, sync)

    def attention_fraction(self, flops: float) -> float:
        return self.attention_efficiency or self.gemm_fraction(flops)

    def gemm_fraction(self, flops: float) -> float:
        """The fraction of peak a GEMM of ``flops`` reaches: log-linear between the table's
        rows, flat beyond its ends (small GEMMs cannot fill the GPU's units)."""
        table, x = self.gemm_efficiency, math.log10(max(flops, 1.0) / 1e9)
        points = [(math.log10(g), f) for g, f in table]
        if x <= points[0][0]:
            return points[0][1]
        for (x0, f0), (x1, f1) in zip(points, points[1:]):
            if x <= x1:
                return f0 + (f1 - f0) * (x - x0) / (x1 - x0)
        return points[-1][1]


def shipped_clusters() -> list[str]:
    return sorted(n.removesuffix(".yaml") for n in os.listdir(PROFILE_DIR) if n.endswith(".yaml"))


def load_cluster(name_or_path: str) -> Cluster:
    """A shipped profile by name, or a user's YAML file; every field checked, one line if wrong."""
    path = name_or_path
    if not os.path.isfile(path):
        path = os.path.join(PROFILE_DIR, f"{name_or_path}.yaml")
        if not os.path.isfile(path):
            raise ConfigError(
                f"--cluster {name_or_path}: no such profile; use one of "
                f"{', '.join(shipped_clusters())} or the path of a YAML profile"
            )
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read the cluster profile ({e}); fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a cluster profile maps field: value; see {PROFILE_DIR}")
    values = {}
    for f in fields(Cluster):
        if f.name not in data and f.default is MISSING:
            raise ConfigError(
                f"{path}: the cluster profile lacks '{f.name}'; add it (see the shipped "
                f"profiles in {PROFILE_DIR})"
            )
        values[f.name] = data.get(f.name, f.default)
    _check(path, values)
    return Cluster(**values)


def _check(path: str, v: dict) -> None:
    """Types and ranges of a profile's fields: positive numbers, fractions in (0, 1]."""

    def positive(x: object) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and 0 < x < math.inf

    def bad(key: str, what: str) -> ConfigError:
        return ConfigError(f"{path}: {key}={v[key]!r} must be {what}; fix the profile")

    numbers = ("gpus_per_node", "gpu_memory_gb", "hbm_gb_per_s", "intra_node_gb_per_s")
    for key in numbers + ("inter_node_gb_per_s", "intra_node_latency_us", "inter_node_latency_us"):
        if not positive(v[key]):
            raise bad(key, "a positive number")
    for key in ("all_gather_factor", "reduce_scatter_factor"):
        if not positive(v[key]):
            raise bad(key, "a positive number")
    sync = v["collective_sync_us"]
    if not isinstance(sync, int | float) or isinstance(sync, bool) or not 0 <= sync < math.inf:
        raise bad("collective_sync_us", "a number of microseconds, 0 or more")
    optional = ("attention_efficiency",) if v["attention_efficiency"] is not None else ()
    for key in ("hbm_efficiency", "link_efficiency", *optional):
        if not positive(v[key]) or v[key] > 1:
            raise bad(key, "a fraction in (0, 1]")
    if v["device"] not in ("cuda", "cpu"):
        raise bad("device", "cuda or cpu")
    peaks = v["peak_tflops"]
    if not isinstance(peaks, dict) or not peaks or not all(map(positive, peaks.values())):
        raise bad("peak_tflops", "a mapping of dtype to a positive TFLOP/s, e.g. {bf16: 989}")
    table = v["gemm_efficiency"]
    rows_ok = (
        isinstance(table, list)
        and table
        and all(
            isinstance(r, list) and len(r) == 2 and positive(r[0]) and positive(r[1]) and r[1] <= 1
            for r in table
        )
    )
    if not rows_ok or [r[0] for r in table] != sorted({r[0] for r in table}):
        raise bad("gemm_efficiency", "rows [GFLOP, fraction in (0, 1]] with ascending GFLOP")
