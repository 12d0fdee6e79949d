"""Calibrating a cluster profile from this machine: its GEMM throughput by size, its streaming
bandwidth and its collectives' bandwidth and latency, measured, then written as a profile the
step-time model reads (megatron/estimate/cluster.py).

On CPU each "GPU" is one training process of one thread (the tests' and benchmarks' layout:
processes x threads <= cores), so every figure is measured on one thread; the peak is the
fastest GEMM measured, the table each size's fraction of it. The link is gloo's between the
processes of a group, fitted to the ring's cost: an all-reduce over two ranks takes
B / bandwidth + 2 * latency, so a small message gives the latency and a large one the bandwidth.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.config.dtypes import DTYPES
from megatron.estimate.cluster import Link
from megatron.estimate.collectives import all_gather, all_reduce
from megatron.parallel.mappings import all_gather_seq, reduce_scatter_seq

GEMM_SIDES = (32, 64, 128, 256, 512, 1024)  # square GEMMs of 2 * n^3 FLOPs
STREAM_BYTES = 16 * 2**20
SMALL_BYTES, LARGE_BYTES = 4 * 2**10, 8 * 2**20


def _best_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """The fastest of ``repeats`` timed calls: on a machine shared with other work, the one
    least disturbed by it (what the machine itself does)."""
    fn()  # warm-up: allocation, kernel selection
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


def gemm_table(
    device: torch.device, dtype: torch.dtype, sides: tuple[int, ...] = GEMM_SIDES
) -> tuple[float, list[list[float]]]:
    """(the fastest GEMM's FLOP/s, [[GFLOP, fraction of it], ...]) over square GEMMs of
    ``sides``."""
    rates = []
    for n in sides:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        seconds = _best_seconds(lambda: a @ b, 7, _sync(device))  # noqa: B023
        rates.append((2 * n**3, 2 * n**3 / seconds))
    peak = max(rate for _, rate in rates)
    return peak, [[flops / 1e9, round(rate / peak, 4)] for flops, rate in rates]


def stream_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large copy (each byte read and written)."""
    src = torch.empty(STREAM_BYTES // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * STREAM_BYTES / _best_seconds(lambda: dst.copy_(src), 9, _sync(device))


def elementwise_bandwidth(device: torch.device) -> float:
    """Bytes/s of an activation's forward and backward (GELU: 8 bytes an element forward, 12
    backward, in fp32): what a layer's memory-bound kernels reach, which on a CPU thread is
    compute, not the copy's bandwidth."""
    x = torch.randn(STREAM_BYTES // 4 // 1024, 1024, device=device, requires_grad=True)
    grad = torch.randn_like(x)

    def gelu() -> None:
        torch.nn.functional.gelu(x).backward(grad)

    return 20 * x.numel() / _best_seconds(gelu, 7, _sync(device))


def attention_rate(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> float:
    """FLOP/s of causal fused attention forward on ``shape`` (batch, heads, seq, head dim),
    its FLOPs counted unmasked (4 b s^2 a d) as the step-time model counts them."""
    b, a, s, d = shape
    q, k, v = (torch.randn(b, a, s, d, device=device, dtype=dtype) for _ in "qkv")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    seconds = _best_seconds(lambda: sdpa(q, k, v, is_causal=True), 7, _sync(device))
    return 4 * b * s * s * a * d / seconds


def link_figures(group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """(bytes/s, seconds per ring step) of the all-reduce on ``group`` (two ranks), measured in
    place on fp32 tensors; every rank of the group calls it."""
    n = dist.get_world_size(group)
    steps, factor = 2 * (n - 1), 2 * (n - 1) / n

    def all_reduce_seconds(nbytes: int) -> float:
        x = torch.zeros(nbytes // 4)
        return _best_seconds(lambda: dist.all_reduce(x, group=group), 15, dist.barrier)

    small, large = all_reduce_seconds(SMALL_BYTES), all_reduce_seconds(LARGE_BYTES)
    latency = small / steps
    return factor * LARGE_BYTES / max(large - small, 1e-9), latency


def collective_factors(link: tuple[float, float], group: dist.ProcessGroup | None = None):
    """(all-gather, reduce-scatter): the time of each, as sequence parallelism runs them on a
    1 MiB activation (megatron/parallel/mappings.py, reshapes included), over the ring model's
    on ``link`` (``link_figures``'s); every rank of the group calls it."""

    n, whole = dist.get_world_size(group), torch.zeros(1, 1024, 256)
    part = whole[:, : 1024 // n].contiguous()
    model = all_gather(whole.nbytes, n, Link(*link))
    group = group or dist.group.WORLD
    gather = _best_seconds(lambda: all_gather_seq(part, group), 15, dist.barrier)
    scatter = _best_seconds(lambda: reduce_scatter_seq(whole, group), 15, dist.barrier)
    return gather / model, scatter / model


def collective_sync(
    link: tuple[float, float],
    group: dist.ProcessGroup | None = None,
    calls: int = 64,
    chains: int = 16,
) -> float:
    """Seconds a collective costs beyond its ring time on ``link`` (``link_figures``'s) when it
    follows compute, as each of a step's does: each rank reaches it when its own GEMM ends and
    waits for the later one, and for gloo's threads to wake, which on this machine now and then
    takes a scheduler tick. A call timed alone after a barrier pays neither, so the wait is timed
    in place: chains of ``calls`` (a layer's GEMM, then a 4 MiB all-reduce: four of a layer's
    1 MiB activations here), the time inside the all-reduces averaged over the chain and the
    ranks, the fastest of ``chains`` chains, less the ring's time. The wait is heavy-tailed (most
    calls pay a fraction of a millisecond, some a 4 ms tick) and drifts with the host's other
    work: a chain of about a step's calls, the fastest of as many as a benchmark's measured
    iterations, reads it as a run's fastest iteration meets it. Every rank of the group calls it
    and gets the same figure.
    """
    x = torch.zeros(2**20)  # 4 MiB of fp32
    a, w = torch.randn(256, 1024), torch.randn(1024, 1024)  # ~0.5 GFLOP, a layer's GEMM here
    ranks = dist.get_world_size(group)
    ring = all_reduce(x.nbytes, ranks, Link(*link))

    def chain() -> float:
        waited = torch.tensor([-calls * ring], dtype=torch.float64)  # this rank's own ring
        dist.barrier(group=group)
        for _ in range(calls):
            a @ w
            start = time.perf_counter()
            dist.all_reduce(x, group=group)
            waited += time.perf_counter() - start
        dist.all_reduce(waited, group=group)
        return waited.item() / (calls * ranks)

    return max(0.0, min(chain() for _ in range(chains)))


def cpu_profile(
    name: str,
    peak: float,
    table: list[list[float]],
    stream: float,
    link: tuple[float, float],
    elementwise: float | None = None,
    attention: float | None = None,
    factors: tuple[float, float] = (1.0, 1.0),
    sync: float = 0.0,
) -> dict:
    """A profile (the fields of megatron/estimate/cluster.py's Cluster) for processes of one
    thread on this machine: a node is its cores, every figure achievable as measured; the
    memory-bound kernels at ``elementwise`` bytes/s (else the copy's), fused attention at
    ``attention`` FLOP/s (else a GEMM's rate), all-gathers and reduce-scatters at ``factors``
    times the ring model (``collective_factors``), and each collective call ``sync`` seconds
    more (``collective_sync``)."""
    cores = os.cpu_count() or 1
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    bandwidth, latency = link
    return {
        "name": name,
        "device": "cpu",
        "gpus_per_node": cores,
        "gpu_memory_gb": round(memory_gb / cores, 1),
        "peak_tflops": {"fp32": peak / 1e12},
        "hbm_gb_per_s": stream / 1e9,
        "hbm_efficiency": min(1.0, elementwise / stream) if elementwise else 1.0,
        "intra_node_gb_per_s": bandwidth / 1e9,
        "inter_node_gb_per_s": bandwidth / 1e9,
        "link_efficiency": 1.0,
        "intra_node_latency_us": latency * 1e6,
        "inter_node_latency_us": latency * 1e6,
        "gemm_efficiency": table,
        "attention_efficiency": min(1.0, attention / peak) if attention else None,
        "all_gather_factor": factors[0],
        "reduce_scatter_factor": factors[1],
        "collective_sync_us": sync * 1e6,
    }


def measured_device(
    base: dict,
    device: torch.device,
    dtype: str,
    sides: tuple[int, ...],
    attention_shape: tuple[int, int, int, int],
) -> dict:
    """``base`` (a profile's fields) with this device's GEMM table and peak for ``dtype``, its
    streaming bandwidth and its fused attention's rate on ``attention_shape`` measured: what a
    one-GPU step's prediction rests on (its links stay ``base``'s)."""
    peak, table = gemm_table(device, DTYPES[dtype], sides)
    stream = stream_bandwidth(device)
    # A GPU's memory-bound kernels stream at the copy's rate; a CPU thread's compute.
    elementwise = elementwise_bandwidth(device) if device.type == "cpu" else stream
    attention = attention_rate(device, DTYPES[dtype], attention_shape)
    return {
        **base,
        "name": f"{base['name']} (measured)",
        "peak_tflops": {dtype: peak / 1e12},
        "hbm_gb_per_s": stream / 1e9,
        "hbm_efficiency": min(1.0, elementwise / stream),
        "gemm_efficiency": table,
        "attention_efficiency": min(1.0, attention / peak),
    }
