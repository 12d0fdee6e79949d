"""Seconds one transformer layer takes on one GPU for one micro-batch: its GEMMs, its
memory-bound kernels and the collectives inside it (TP, CP, EP), forward and backward.

GEMMs (the shapes of megatron/estimate/flops.py, per TP rank): QKV [T, h] x [h, (a+2g)d/t],
attention scores and weighted sum 4*T*s*a*d/t, output [T, ad/t] x [ad/t, h], fc1 [T, h] x
[h, m*f/t] (m = 2 with SwiGLU's gate), fc2 [T, f/t] x [f/t, h], for T = b*s/cp tokens; each at
the fraction of peak its size reaches (the cluster's table). Backward: dgrad and wgrad, twice the
forward's time. A MoE layer runs the router on every token and, with balanced routing, T*k rows
through this rank's E/ep experts (each expert's GEMM sized T*k*ep/E rows).

Memory-bound kernels stream bytes at the cluster's achievable HBM bandwidth: per layer forward
``HIDDEN_PASSES`` reads or writes of a [T, h] tensor (two norms: 2 each; two bias-dropout-adds:
3 each plus a 1-byte mask; split over TP under sequence parallelism, else whole on every rank)
and the activation's passes over fc1's output (2, SwiGLU 3); backward twice that. Attention is
fused (flash): its scores never reach memory, and its backward recomputes them, 2.5x the
forward's FLOPs; it runs at the profile's ``attention_efficiency`` where one was measured.

Collectives: TP's two all-reduces forward (sequence parallel: two all-gathers and two
reduce-scatters, the same ring traffic) and two backward, the input gradients of QKV and fc1,
which on CUDA overlap with those linears' weight-gradient GEMMs (megatron/parallel/layers.py,
``async_grad_allreduce_pays``; not on CPU); CP's ring, each K/V hop overlapping one block of
attention (megatron/parallel/context_parallel.py); EP's dispatch and combine all-to-alls, exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.schema import Config
from megatron.estimate.cluster import Cluster
from megatron.estimate.collectives import (
    Links,
    all_gather,
    all_reduce,
    all_to_all,
    reduce_scatter,
    send,
)
from megatron.estimate.memory import DTYPE_BYTES

HIDDEN_PASSES = 2 * 2 + 2 * 3.5  # norms' read + write, bias-dropout-adds' 3 passes + mask
ATTENTION_RECOMPUTE = 0.5  # fused attention's backward beyond twice its forward


@dataclass(frozen=True)
class Pass:
    """A forward or a backward: compute seconds, and communication seconds (all of it, and the
    part no compute hides)."""

    compute: float = 0.0
    comm: float = 0.0
    exposed: float = 0.0

    @property
    def time(self) -> float:
        return self.compute + self.exposed

    def __add__(self, other: Pass) -> Pass:
        return Pass(
            self.compute + other.compute, self.comm + other.comm, self.exposed + other.exposed
        )

    def __mul__(self, k: float) -> Pass:
        return Pass(self.compute * k, self.comm * k, self.exposed * k)


class Kernels:
    """GEMM and streaming times on one GPU of ``cluster`` at the config's dtype."""

    def __init__(self, cluster: Cluster, dtype: str) -> None:
        self.cluster, self.peak = cluster, cluster.peak(dtype)

    def gemm(self, flops: float, count: int = 1) -> float:
        """``count`` GEMMs of ``flops`` each."""
        return count * flops / (self.peak * self.cluster.gemm_fraction(flops)) if flops else 0.0

    def attention(self, flops: float) -> float:
        """Fused attention of ``flops`` (counted unmasked), forward."""
        return flops / (self.peak * self.cluster.attention_fraction(flops)) if flops else 0.0

    def stream(self, nbytes: float) -> float:
        return nbytes / self.cluster.hbm()


def layer_passes(
    cfg: Config, kernels: Kernels, links: Links, moe: bool, cuda: bool
) -> tuple[Pass, Pass]:
    """(forward, backward) of one layer for one micro-batch on one GPU, recomputation aside."""
    m, p = cfg.model, cfg.parallel
    t, cp, ep = p.tensor_parallel_size, p.context_parallel_size, p.expert_parallel_size
    e = DTYPE_BYTES[cfg.precision.dtype]
    h, s, d = m.hidden_size, m.seq_length, m.head_dim
    a, g = m.num_attention_heads, m.query_groups
    tokens = cfg.training.micro_batch_size * s // cp
    gated = 2 if m.activation == "swiglu" else 1
    qkv = kernels.gemm(2 * tokens * h * (a + 2 * g) * d / t)
    attention = kernels.attention(4 * tokens * s * a * d / t)
    dense = qkv + attention + kernels.gemm(2 * tokens * a * d * h / t)

    def mlp(width: int, rows: float, count: int = 1) -> tuple[float, float]:
        """(all GEMMs, fc1's) of ``count`` MLPs of ``width`` on ``rows`` tokens each."""
        fc1 = kernels.gemm(2 * rows * h * gated * width / t, count)
        return fc1 + kernels.gemm(2 * rows * width * h / t, count), fc1

    hidden_split = t if p.sequence_parallel else 1
    streamed = HIDDEN_PASSES * tokens * h / hidden_split
    if moe:
        k, experts = m.moe_router_topk, m.num_experts
        routed, fc1 = mlp(m.expert_ffn_hidden_size, tokens * k * ep / experts, experts // ep)
        mlp_time = routed + kernels.gemm(2 * tokens * h * experts / hidden_split)
        streamed += (gated + 1) * tokens * k * m.expert_ffn_hidden_size / t
        shared = m.moe_shared_expert_intermediate_size
        if shared:
            shared_time, shared_fc1 = mlp(shared, tokens)
            mlp_time, fc1 = mlp_time + shared_time, fc1 + shared_fc1
            streamed += (gated + 1) * tokens * shared / t
    else:
        mlp_time, fc1 = mlp(m.ffn_hidden_size, tokens)
        streamed += (gated + 1) * tokens * m.ffn_hidden_size / t
    compute = dense + mlp_time + kernels.stream(streamed * e)

    # TP: two all-reduces of the [T, h] activations each way (sequence parallel: two
    # all-gathers and two reduce-scatters, the same ring traffic)
    activation = tokens * h * e
    tp_each = all_reduce(activation, t, links.tp)
    if p.sequence_parallel:
        tp_each = all_gather(activation, t, links.tp) + reduce_scatter(activation, t, links.tp)
    forward = Pass(compute, 2 * tp_each, 2 * tp_each)
    wgrad = {"qkv": qkv, "fc1": fc1}  # what hides each column-parallel input-gradient reduce
    hidden = sum(min(tp_each, w) for w in wgrad.values()) if cuda else 0.0
    # Backward: twice the forward, and fused attention's recomputed scores on top (FlashAttention:
    # 2.5x its forward's FLOPs).
    backward = Pass(
        2 * compute + ATTENTION_RECOMPUTE * attention, 2 * tp_each, 2 * tp_each - hidden
    )

    if cp > 1:  # (cp - 1) hops of this rank's K/V [2, b, g/t, s/cp, d], each behind one block
        kv = 2 * tokens * g / t * d
        hop_fwd, hop_bwd = send(kv * e, links.cp), send(kv * (e + 4), links.cp)
        block = attention / cp
        forward += Pass(0.0, (cp - 1) * hop_fwd, (cp - 1) * max(0.0, hop_fwd - block))
        backward += Pass(0.0, (cp - 1) * hop_bwd, (cp - 1) * max(0.0, hop_bwd - 2 * block))
    if moe and ep > 1:  # dispatch and combine: T*k rows of h each, whole on every TP rank
        a2a = 2 * all_to_all(tokens * m.moe_router_topk * h * e, ep, links.ep)
        forward += Pass(0.0, a2a, a2a)
        backward += Pass(0.0, a2a, a2a)
    return forward, backward
