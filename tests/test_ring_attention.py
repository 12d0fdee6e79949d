"""Ring attention against SDPA on the full sequence, on real gloo process groups.

Every rank builds the same full q, k, v (grouped-query: 4 heads over 2 K/V groups) and upstream
gradient, computes the reference on the whole sequence with SDPA, and runs ring attention on its
two chunks. For CP 2, 3 and 4 and causal, bidirectional and document masks (boundaries inside
and across chunks, a one-token document), its output and its chunks' q, k, v gradients match
the exact (float64 SDPA) reference's chunks within 2e-6 of their scale (fp32); bf16 stays
within bf16 error. A ring ordered against its group and, at world 4, two rings of strided
global ranks ({0, 2}, {1, 3}) check that peers are global ranks in ring order.
Traffic is counted: forward sends CP − 1 K/V messages, backward CP − 1 K/V and CP − 1 dK/dV
messages, and no collective runs. Backward keeps only the local q, k, v, the output and the
fp32 lse. CP 1 is SDPA itself, with no process group.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.parallel.context_parallel import (
    Ring,
    chunk_ids,
    held_positions,
    ring_attention,
    split_sequence,
)
from tests.distributed import run_distributed

B, HEADS, GROUPS, D, C = 2, 4, 2, 8, 4  # C: chunk length; S = 2 * CP * C
# Errors are measured against the float64 answer, relative to the values' scale: max |error| /
# max(1, max |value|). fp32 SDPA itself is off by up to 1.4e-6 absolute (values reach ~5, where
# an fp32 ulp is 4.8e-7), and the gradients' P * (dP - D) cancels: the ring measures up to 1e-6.
TOL = 2e-6
BF16_TOL = 2e-2  # bf16 SDPA measures 1.1e-2 on dk here (inputs rounded to 8 bits), the ring alike


def document_ids(seq: int) -> torch.Tensor:
    """[B, seq] ids: sample 0 has boundaries inside a chunk, on a chunk edge and a one-token
    document at the end; sample 1 has random ones (fixed seed)."""
    starts = [{0, 1, C + C // 2, 2 * C, 2 * C + 1, seq - 1}]
    g = torch.Generator().manual_seed(7)
    starts.append({0, *torch.randint(1, seq, (3,), generator=g).tolist()})
    ids = torch.zeros(B, seq, dtype=torch.long)
    for b, s in enumerate(starts):
        ids[b, sorted(p for p in s if p < seq)] = 1
    return ids.cumsum(1)


CASES = {  # name: (causal, use document ids)
    "causal": (True, False),
    "bidirectional": (False, False),
    "documents": (True, True),
    "documents bidirectional": (False, True),
}


def inputs(seq: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Full q [B, HEADS, seq, D], k, v [B, GROUPS, seq, D] and an upstream gradient like q."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, seq, D, generator=g)
    k, v = (torch.randn(B, GROUPS, seq, D, generator=g) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=g)


def reference(q, k, v, grad, causal, docs) -> tuple[torch.Tensor, ...]:
    """SDPA's output and q, k, v gradients on the full sequence, with a dense boolean mask."""
    seq = q.shape[2]
    mask = torch.ones(B, 1, seq, seq, dtype=torch.bool)
    if causal:
        mask &= torch.ones(seq, seq, dtype=torch.bool).tril()
    if docs is not None:
        mask &= (docs[:, :, None] == docs[:, None, :])[:, None]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@contextlib.contextmanager
def recorded_p2p() -> Iterator[dict[str, list]]:
    """Each message sent through batch_isend_irecv inside, as (shape, dtype), and the name of
    any collective or blocking point-to-point call; torch.distributed is restored afterwards."""
    calls: dict[str, list] = {"sends": [], "other": []}
    others = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object")
    others += ("reduce_scatter", "reduce_scatter_tensor", "broadcast", "barrier", "reduce")
    others += ("all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv")
    real = {name: getattr(dist, name) for name in (*others, "batch_isend_irecv")}

    def batch(ops):
        calls["sends"] += [
            (tuple(op.tensor.shape), op.tensor.dtype) for op in ops if op.op is dist.isend
        ]
        return real["batch_isend_irecv"](ops)

    def other(name):
        return lambda *a, **k: (calls["other"].append(name), real[name](*a, **k))[1]

    dist.batch_isend_irecv = batch
    for name in others:
        setattr(dist, name, other(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def run_case(ring: Ring, causal: bool, with_docs: bool, seed: int, dtype=torch.float32) -> dict:
    """This rank's errors against the reference chunks, and the messages it sent."""
    size, index = ring.size, ring.index
    seq = 2 * size * C
    q, k, v, grad = inputs(seq, seed)
    docs = document_ids(seq) if with_docs else None
    # The exact answer (float64): fp32 SDPA is itself a few ulps off, as much as the ring.
    expected = reference(q.double(), k.double(), v.double(), grad.double(), causal, docs)
    mine = [split_sequence(t, 2, index, size).to(dtype).requires_grad_() for t in (q, k, v)]
    saved = []  # (shape, dtype) of each tensor saved for backward

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with recorded_p2p() as calls:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = ring_attention(*mine, ring, causal, docs)
        forward = list(calls["sends"])
        calls["sends"].clear()
        out.backward(split_sequence(grad, 2, index, size).to(dtype))
    got = [out.detach()] + [t.grad for t in mine]
    errors = {}  # name: max abs error / max(1, max abs value), of this rank's chunks
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        e = split_sequence(e, 2, index, size)
        errors[name] = ((a.double() - e).abs().max() / e.abs().max().clamp(min=1)).item()
    assert out.dtype == dtype and all(t.grad.dtype == dtype for t in mine)
    return {
        "errors": errors,
        "forward": forward,
        "backward": list(calls["sends"]),
        "other": calls["other"],
        "saved": saved,
    }


def _child() -> dict:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ring = Ring(dist.new_group(list(range(world))), tuple(range(world)), rank)
    out = {
        name: run_case(ring, causal, docs, seed=i)
        for i, (name, (causal, docs)) in enumerate(CASES.items())
    }
    # Ring order other than group order, and rings of non-adjacent global ranks: peers are
    # ring.ranks, global ranks, whatever the group.
    backwards = tuple(reversed(range(world)))
    out["reversed ring"] = run_case(Ring(ring.group, backwards, world - 1 - rank), True, True, 5)
    if world == 2:
        out["bf16"] = run_case(ring, True, True, seed=0, dtype=torch.bfloat16)
    if world == 4:
        rings = [(0, 2), (1, 3)]
        groups = [dist.new_group(list(r)) for r in rings]  # every rank creates every group
        mine = rings[rank % 2]
        out["strided rings"] = run_case(
            Ring(groups[rank % 2], mine, mine.index(rank)), True, True, 6
        )
    return out


@functools.cache
def results(cp: int) -> list[dict]:
    return run_distributed(_child, cp)


def saved(dtype: torch.dtype) -> list:
    """What backward keeps: the local q, k, v, the output, and the fp32 lse [b, heads, 2c]."""
    q, kv = (B, HEADS, 2 * C, D), (B, GROUPS, 2 * C, D)
    return [(q, dtype), (kv, dtype), (kv, dtype), (q, dtype), ((B, HEADS, 2 * C), torch.float32)]


def messages(cp: int, dtype: torch.dtype) -> tuple[list, list]:
    kv = ((2, B, GROUPS, 2 * C, D), dtype)
    dkv = ((2, B, GROUPS, 2 * C, D), torch.float32)
    return [kv] * (cp - 1), [kv] * (cp - 1) + [dkv] * (cp - 1)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_attention_matches_sdpa(cp):
    for rank, out in enumerate(results(cp)):
        for name in [*CASES, "reversed ring"] + (["strided rings"] if cp == 4 else []):
            errors = out[name]["errors"]
            assert max(errors.values()) <= TOL, (cp, rank, name, errors)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_attention_traffic(cp):
    forward, backward = messages(cp, torch.float32)
    for rank, out in enumerate(results(cp)):
        for name in CASES:
            case = out[name]
            assert case["forward"] == forward, (cp, rank, name, case["forward"])
            assert sorted(case["backward"], key=str) == sorted(backward, key=str), (cp, rank, name)
            assert case["other"] == [], (cp, rank, name, case["other"])
            assert case["saved"] == saved(torch.float32), (cp, rank, name, case["saved"])


@pytest.mark.slow
def test_ring_attention_bf16():
    forward, backward = messages(2, torch.bfloat16)
    for rank, out in enumerate(results(2)):
        case = out["bf16"]
        assert max(case["errors"].values()) <= BF16_TOL, (rank, case["errors"])
        assert case["forward"] == forward
        assert sorted(case["backward"], key=str) == sorted(backward, key=str)
        assert case["saved"] == saved(torch.bfloat16)


@pytest.mark.parametrize("name", CASES)
def test_cp1_is_sdpa_and_sends_nothing(name):
    causal, docs = CASES[name]
    case = run_case(Ring(None, (0,), 0), causal, docs, seed=11)
    assert max(case["errors"].values()) <= TOL, case["errors"]
    assert case["forward"] == case["backward"] == case["other"] == []
    assert case["saved"] == saved(torch.float32)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout(cp):
    seq = 2 * cp * C
    held = [held_positions(seq, r, cp, "cpu") for r in range(cp)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(seq))
    full = torch.arange(3 * seq).view(3, seq)
    for r in range(cp):
        assert chunk_ids(r, cp) == (r, 2 * cp - 1 - r)
        assert held[r].dtype == torch.int64
        mine = split_sequence(full, 1, r, cp)
        assert mine.is_contiguous() and torch.equal(mine, full[:, held[r]])
    with pytest.raises(ValueError):
        split_sequence(full[:, :-1], 1, 0, cp)


def test_strided_inputs():
    """q, k, v as [b, s, heads, d] tensors' transposes (a layer's layout) give the same output
    and gradients as contiguous ones."""
    ring, seq = Ring(None, (0,), 0), 2 * C
    q, k, v, grad = inputs(seq, 3)
    results = []
    for strided in (False, True):
        ts = [t.transpose(1, 2).contiguous().transpose(1, 2) if strided else t for t in (q, k, v)]
        ts = [t.detach().requires_grad_() for t in ts]
        assert all(t.is_contiguous() != strided for t in ts)
        out = ring_attention(*ts, ring, True, document_ids(seq))
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in ts])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
