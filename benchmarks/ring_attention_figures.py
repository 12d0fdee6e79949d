"""Attention alone: ring attention's peak memory and per-rank time at CP 2, against one-process
SDPA over the whole sequence, the estimate, the unfused ring it replaced and torch's own
experimental context-parallel ring (benchmarks/bench_context_parallel.py prints them).

- **Peak memory**: one causal forward+backward of ``ring_attention`` on this rank's two chunks,
  measured as the process's peak resident set (``VmHWM``, reset through
  ``/proc/self/clear_refs`` just before) above its resident set just before, after three
  warm-up calls. Resident memory sees every allocation, the kernels' private workspace and gloo's
  included; glibc is told to serve every block of 64 KiB or more with its own mapping
  (``mallopt(M_MMAP_THRESHOLD)``), so a freed tensor leaves the resident set at once instead of
  staying in the heap for the next to reuse unseen. Against it: the tensors that hold the
  output and lse (what backward keeps) plus ``ring_attention_bytes(..., device="cpu")``.
- **Time**: the median of the timed calls of one rank's forward+backward (every rank starts each
  call together; a call's time is the slowest rank's), against SDPA's causal forward+backward
  over the whole sequence (the same heads, groups and dtype) in rank 0's process while the other
  waits, alternated call by call with the ring's so that both see the same load. One thread per
  process: CP 2 is two processes on the two cores, SDPA one process on one core.
- **torch's ring**: ``torch.distributed.tensor.experimental.context_parallel`` on the same
  shapes, where it runs; on CPU it does not (its ring handles only the CUDA SDPA kernels), and
  the figure is the error it raises.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.estimate.activations import ring_attention_bytes
from tests.distributed import run_distributed
from tests.model_config import tiny_model_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class AttnShape:
    """q [batch, heads, seq, head_dim], k and v [batch, groups, seq, head_dim]."""

    batch: int = 1
    heads: int = 8
    groups: int = 2
    head_dim: int = 64
    seq: int = 8192
    dtype: str = "bf16"


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _own_mappings() -> None:
    """From here on, glibc serves every block of 64 KiB or more with its own mapping, returned
    when freed (M_MMAP_THRESHOLD, fixed: no longer raised by the frees). Call it first."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)


def _rss_peak(fn) -> int:
    """Bytes by which the resident set rose at its peak while ``fn()`` ran."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    fn()
    return _status("VmHWM") - base


def _inputs(shape: AttnShape, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[shape.dtype]
    # The [b, s, heads, d] memory order of the model's q, k and v.
    q, k, v = (
        torch.randn(shape.batch, seq, n, shape.head_dim, generator=g, dtype=dtype).transpose(1, 2)
        for n in (shape.heads, shape.groups, shape.groups)
    )
    dout = torch.randn(q.shape, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)], dout


def _timed(call, warmup: int, reps: int, barrier=lambda: None) -> list[float]:
    times = []
    for i in range(warmup + reps):
        barrier()
        start = time.perf_counter()
        call()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def _sdpa_call(shape: AttnShape):
    """One process's causal SDPA forward+backward over the whole sequence, as a call."""
    (q, k, v), dout = _inputs(shape, shape.seq, 0)

    def call():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(dout)
        for t in (q, k, v):
            t.grad = None

    return call


def _ring_child(shape: AttnShape, cp: int, warmup: int, reps: int) -> dict:
    """This rank's peak bytes and per-call ms; rank 0 also times SDPA over the whole sequence
    between the ring's calls, while the other ranks wait (the same load on the machine)."""
    import torch.distributed as dist

    from megatron.parallel.context_parallel import Ring, ring_attention
    from megatron.parallel.state import initialize

    _own_mappings()
    state = initialize(1, cp_size=cp)
    ring = Ring(state.cp_group, state.cp_ranks, state.cp_rank)
    (q, k, v), dout = _inputs(shape, shape.seq // cp, state.cp_rank)

    def call():
        ring_attention(q, k, v, ring, True, None).backward(dout)
        for t in (q, k, v):
            t.grad = None  # freed here, not inside the next call's measurement

    for _ in range(3):  # the first calls' resident set holds one-time pages (code, gloo)
        call()
    dist.barrier()
    peak = _rss_peak(call)
    sdpa = _sdpa_call(shape) if state.cp_rank == 0 else None
    ring_ms, sdpa_ms = [], []
    for _ in range(warmup + reps):  # alternated: ring, then SDPA on rank 0
        ring_ms += _timed(call, 0, 1, dist.barrier)
        dist.barrier()
        if sdpa is not None:
            sdpa_ms += _timed(sdpa, 0, 1)
        dist.barrier()
    return {"peak_bytes": peak, "ms": ring_ms[warmup:], "sdpa_ms": sdpa_ms[warmup:]}


def _torch_ring_child(shape: AttnShape, warmup: int, reps: int) -> dict:
    """torch's experimental context-parallel SDPA, or the error it raises here."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    (q, k, v), dout = _inputs(shape, shape.seq, 0)
    buffers = [t.detach().clone() for t in (q, k, v, dout)]
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4):
            qs, ks, vs = (t.detach().requires_grad_() for t in buffers[:3])

            def call():
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                out.backward(buffers[3])

            return {"runs": True, "ms": _timed(call, warmup, reps, dist.barrier)}
    except Exception as e:  # noqa: BLE001 - the figure is what it raises
        return {"runs": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def estimate(shape: AttnShape, cp: int) -> dict:
    """What the estimate says one rank holds at the backward's peak: the output and lse that
    backward keeps, and the ring's transients on CPU's kernel."""
    model = tiny_model_config(
        num_attention_heads=shape.heads,
        num_query_groups=shape.groups,
        hidden_size=shape.heads * shape.head_dim,
        seq_length=shape.seq,
        max_position_embeddings=shape.seq,
    )
    e = DTYPES[shape.dtype].itemsize
    tokens = shape.batch * shape.seq // cp
    saved = tokens * shape.heads * (shape.head_dim * e + 4)  # output and fp32 lse
    ring = ring_attention_bytes(model, shape.batch, 1, e, cp, device="cpu")
    return {"saved": saved, **ring._asdict(), "total": saved + ring.total}


def unfused_scores_bytes(shape: AttnShape, cp: int) -> int:
    """The four fp32 [b, heads, s/2c, s/2c] score blocks the unfused ring held in backward."""
    c = shape.seq // (2 * cp)
    return 4 * 4 * shape.batch * shape.heads * c * c


def attention_figures(shape: AttnShape, warmup: int = 1, reps: int = 3) -> dict:
    """Peak memory and per-rank time of CP 2 against SDPA, the estimate and torch's ring."""
    ranks = run_distributed(_ring_child, 2, shape, 2, warmup, reps, timeout=900)
    ring_ms = statistics.median(max(r["ms"][i] for r in ranks) for i in range(reps))
    sdpa_ms = statistics.median(ranks[0]["sdpa_ms"])
    torch_ring = run_distributed(_torch_ring_child, 2, shape, warmup, reps, timeout=900)[0]
    peak = max(r["peak_bytes"] for r in ranks)
    est = estimate(shape, 2)
    figures = {
        "shape": {**shape.__dict__, "cp": 2},
        "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks],
        "peak_estimate": est,
        "peak_over_estimate": round(peak / est["total"], 4),
        "unfused_score_blocks_bytes": unfused_scores_bytes(shape, 2),
        "cp2_fwd_bwd_ms_per_rank": round(ring_ms, 2),
        "sdpa_whole_sequence_fwd_bwd_ms": round(sdpa_ms, 2),
        "cp2_over_sdpa": round(ring_ms / sdpa_ms, 3),
        "torch_context_parallel": torch_ring,
        "timed_calls": reps,
    }
    if torch_ring.get("runs"):
        torch_ms = statistics.median(torch_ring["ms"])
        figures["cp2_over_torch_context_parallel"] = round(ring_ms / torch_ms, 3)
    return figures
