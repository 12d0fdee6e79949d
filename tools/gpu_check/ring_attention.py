"""One rank's share of CP 2 ring attention: the pair loop on fused kernels, without the sends.

Rank 0 of a CP 2 ring holds chunks 0 and 3 of the sequence; here one process holds every
rank's K/V block already (cut with ``split_sequence``), so the timing is the ring's compute
alone: ``attend_block`` over both blocks (forward), then ``attend_block_backward`` over both
(backward), the same functions ring attention runs between its hops
(megatron/parallel/context_parallel.py; the kernel per device in attention_kernels.py). On CUDA
that is the flash kernel, which no CPU test runs, so the step also checks it: with
an upstream gradient on rank 0's rows only, SDPA over the whole sequence gives rank 0's output
and dq rows and every dK/dV row this share must produce (``max_error``: the largest absolute
error over out, dq, dk, dv relative to max(1, the largest value)).

    python -m tools.gpu_check.ring_attention --batch 1 --heads 32 --groups 8 --seq 65536 \\
        --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from megatron.parallel import attention_kernels
from megatron.parallel.context_parallel import (
    attend_block,
    attend_block_backward,
    split_sequence,
)

CP, INDEX = 2, 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_rank_share(q, blocks, dout):
    """Rank INDEX's forward and backward over ``blocks`` (src: [2, b, g, 2c, d]), ring order."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    order = [(INDEX - step) % CP for step in range(CP)]
    for src in order:
        attend_block(q, blocks[src], INDEX, src, CP, True, None, out, lse)
    out = out.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = {
        src: torch.zeros(blocks[src].shape, dtype=torch.float32, device=q.device) for src in order
    }
    for src in order:
        attend_block_backward(
            dout, q, blocks[src], out, lse, INDEX, src, CP, True, None, dq, dkv[src]
        )
    return out, dq, dkv


def measure(shape: dict[str, int], device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    b, h, g, s, d = (shape[k] for k in ("batch", "heads", "groups", "seq", "head_dim"))
    gen = torch.Generator(device).manual_seed(0)
    q_all = torch.randn(b, h, s, d, generator=gen, device=device, dtype=dtype)
    k_all, v_all = (
        torch.randn(b, g, s, d, generator=gen, device=device, dtype=dtype) for _ in "kv"
    )
    q = split_sequence(q_all, 2, INDEX, CP)
    dout = torch.randn(q.shape, generator=gen, device=device, dtype=dtype)
    blocks = {
        r: torch.stack([split_sequence(t, 2, r, CP) for t in (k_all, v_all)]) for r in range(CP)
    }
    times = []
    for _ in range(1 + reps):  # the first call's autotuning and allocation are not timed
        _sync(device)
        start = time.perf_counter()
        out, dq, dkv = one_rank_share(q, blocks, dout)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    # The whole sequence's SDPA, upstream gradient on rank INDEX's rows only.
    qr, kr, vr = (t.clone().requires_grad_() for t in (q_all, k_all, v_all))
    grad = torch.zeros_like(q_all)
    c = s // (2 * CP)
    for j, chunk in enumerate((INDEX, 2 * CP - 1 - INDEX)):
        grad[:, :, chunk * c : (chunk + 1) * c] = dout[:, :, j * c : (j + 1) * c]
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
    ref.backward(grad)
    dk = torch.zeros(2, b, g, s, d, dtype=torch.float32, device=device)
    for r in range(CP):
        for j, chunk in enumerate((r, 2 * CP - 1 - r)):
            dk[:, :, :, chunk * c : (chunk + 1) * c] = dkv[r][:, :, :, j * c : (j + 1) * c]
    pairs = [
        (out, split_sequence(ref.detach(), 2, INDEX, CP)),
        (dq, split_sequence(qr.grad, 2, INDEX, CP)),
        (dk[0], kr.grad),
        (dk[1], vr.grad),
    ]
    error = max(
        ((a.double() - e.double()).abs().max() / e.double().abs().max().clamp(min=1)).item()
        for a, e in pairs
    )
    # Causal attention FLOPs of this share: 4 b h d per (query, key) pair forward, 2.5x that in
    # backward (flash's recomputation included); rank 0 of CP 2 sees 3 full and 2 half blocks.
    pairs_seen = 4 * c * c
    flops = 4 * b * h * d * pairs_seen * 3.5
    ms = sorted(times[1:])[len(times[1:]) // 2]
    return {
        "device_type": device.type,
        "kernel": attention_kernels.kernel_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {**shape, "cp": CP, "rank": INDEX, "chunk": c},
        "fwd_bwd_ms": round(ms, 3),
        "tflops": round(flops / ms / 1e9, 2),
        "timed_calls": reps,
        "max_error": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key in ("batch", "heads", "groups", "seq", "head-dim"):
        parser.add_argument(f"--{key}", type=int, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    shape = {k: getattr(args, k) for k in ("batch", "heads", "groups", "seq", "head_dim")}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(json.dumps(measure(shape, device, getattr(torch, args.dtype), args.reps)))


if __name__ == "__main__":
    main()
