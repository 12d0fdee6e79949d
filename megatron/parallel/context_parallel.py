"""Context parallelism: ring attention over a sequence split across a CP group.

Layout. A sample's S tokens are cut into 2·CP chunks of c = S / (2·CP); ring position r holds
chunks r and 2·CP−1−r, in that order. Under a causal mask the work of a query chunk grows with
its index, so pairing an early chunk with its mirror gives every rank the same number of
(query chunk, key chunk) pairs: 2·CP+1 non-empty ones for each rank. Positions stay global:
``held_positions`` names the tokens a rank holds, ``split_sequence`` cuts any tensor alike.

Forward. Every rank keeps its queries; the K/V blocks (k and v stacked into one tensor) travel
around the ring, so at step i a rank holds position (index − i) mod CP's block. The next hop is
started before the current block's attention is computed and waited for after, overlapping the
transfer with compute. Between two chunks the causal mask is full (key chunk before query
chunk), lower-triangular (same chunk) or empty (key chunk after): empty pairs are skipped, and
every other pair is one call of a fused attention kernel (``attention_kernels``: which kernel
runs on which device) that returns the pair's output, normalised on its own, and its
log-sum-exp ([b, heads, c], natural log, fp32). Each is merged into the running fp32 output
with its lse; the output is cast back at the end. No rank ever holds a [c, c] score matrix: the
kernels tile it. At CP 1 the same code runs the ring's first step alone (a rank's own block:
its two diagonal pairs and one full pair); the model itself runs SDPA at CP 1.

Document ids (the full [b, S] tensor, the same on every rank) are turned once per call into each
sample's runs of equal id (one host copy). A document mask between two chunks allows exactly the
(query run, key run) rectangles of one document: each is a kernel call of its own (per sample),
unmasked, or causal where a run meets itself on the diagonal pair. So document masks run on the
same fused kernels and the same merged-lse backward, exactly, with no mask tensor; the cost is
one call per (sample, document piece) pair, which many tiny documents make slow: at seq 4096 on
one CPU thread (8 heads in 2 groups of 64, fp32, CP 1), forward+backward takes 0.5 s with 4
documents, 0.4 s with 64-token ones and 2.1 s with 1-token ones. flex_attention with a block
mask was the alternative, and measured out (torch 2.13, CPU, one thread, seq 4096, 8 heads in 2
groups of 64, fp32, 5 documents): the runs take 510 ms and 31 MiB for forward+backward; flex has
no backward on CPU ("FlexAttention does not support backward on CPU"), its eager forward alone
takes 8.0 s and 1.7 GiB, and compiled on CPU it refuses ``return_lse`` ("only supports
inference"); a dense-mask SDPA takes 2.9 s and 109 MiB. Nor can flex's backward take an external
(merged) lse. On CUDA flex (or the kernels' varlen forms) may beat many small calls: not
measured. A row that a pair masks entirely is not touched by it; the merged lse is finite, since
each query sees at least itself.

Backward, as flash attention's: with the final (merged) output and lse, each pair's P = exp(s −
lse) and rowsum(dO · O) are the whole softmax's, so the kernel's backward op gives that pair's
exact share of dq, dk and dv; it recomputes its scores tile by tile. The K/V blocks rotate
again, and a block's dK/dV accumulator (fp32) follows it one hop behind: the owner keeps its own
block's contribution locally, a rank adds its contribution to the accumulator it receives and
passes it on, and the last holder's hop lands it back at the owner. That hop, too, runs while
the next block is computed.

Traffic per call, with CP = size (one point-to-point send per message, no collective):
- forward: size − 1 K/V messages (each [2, b, groups, 2c, d] in the input dtype);
- backward: size − 1 K/V messages and size − 1 dK/dV messages ([2, b, groups, 2c, d], fp32).
size 1 sends nothing.

Saved for backward: the local q, k, v, the output, and the lse (fp32 [b, heads, 2c]); the
document runs are Python tuples. Received blocks live for one step. Grouped-query attention
sends only the groups' k/v; the kernels read them at group size where they can (CPU) and
expand them per pair where they cannot (see ``attention_kernels``). Transients, all linear in
c: ``megatron.estimate.activations.ring_attention_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.parallel import attention_kernels as kernels


@dataclass(frozen=True)
class Ring:
    group: dist.ProcessGroup | None  # the CP group (None: the default group)
    ranks: tuple[int, ...]  # global ranks, in ring order
    index: int  # this process's position in the ring

    @property
    def size(self) -> int:
        return len(self.ranks)


def chunk_ids(index: int, size: int) -> tuple[int, int]:
    """The two chunks ring position ``index`` holds, in local order."""
    return index, 2 * size - 1 - index


def _chunk_length(seq_length: int, size: int) -> int:
    if seq_length % (2 * size):
        raise ValueError(f"sequence length {seq_length} is not a multiple of 2 * CP = {2 * size}")
    return seq_length // (2 * size)


def split_sequence(t: Tensor, dim: int, index: int, size: int) -> Tensor:
    """This rank's two chunks of ``t`` (full length S along ``dim``), concatenated."""
    c = _chunk_length(t.size(dim), size)
    return torch.cat([t.narrow(dim, i * c, c) for i in chunk_ids(index, size)], dim)


def held_positions(seq_length: int, index: int, size: int, device=None) -> Tensor:
    """The global sequence indices (int64 [S / size]) this rank holds, in local order."""
    c = _chunk_length(seq_length, size)
    return torch.cat(
        [torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(index, size)]
    )


def _hop(ring: Ring, send: Tensor, recv: Tensor) -> list:
    """Start sending ``send`` to the next ring rank and receiving ``recv`` from the previous."""
    nxt, prev = ring.ranks[(ring.index + 1) % ring.size], ring.ranks[(ring.index - 1) % ring.size]
    ops = [
        dist.P2POp(dist.isend, send, nxt, ring.group),
        dist.P2POp(dist.irecv, recv, prev, ring.group),
    ]
    return dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _pairs(index: int, src: int, size: int, causal: bool) -> Iterator[tuple[int, int, int, int]]:
    """(local query chunk, global query chunk, local key chunk, global key chunk) for each pair
    of this rank's queries and ring position ``src``'s keys that the causal mask leaves."""
    for qi, qc in enumerate(chunk_ids(index, size)):
        for ki, kc in enumerate(chunk_ids(src, size)):
            if not causal or kc <= qc:
                yield qi, qc, ki, kc


Runs = tuple[tuple[tuple[int, int, int], ...], ...]  # per sample: (document id, start, end)


def document_runs(document_ids: Tensor) -> Runs:
    """Each sample's maximal runs of equal document id, as (id, first position, end), over the
    whole sequence; one host copy of the [b, S] ids."""
    ids = document_ids.cpu()
    runs = []
    for row in ids:
        starts = [0, *((row[1:] != row[:-1]).nonzero().flatten() + 1).tolist()]
        ends = starts[1:] + [row.numel()]
        runs.append(tuple((int(row[a]), a, e) for a, e in zip(starts, ends, strict=True)))
    return tuple(runs)


def _clip(runs: tuple[tuple[int, int, int], ...], chunk: int, c: int):
    """The runs that overlap chunk ``chunk``, clipped to it, offsets within the chunk."""
    lo, hi = chunk * c, (chunk + 1) * c
    return [(i, max(a, lo) - lo, min(e, hi) - lo) for i, a, e in runs if a < hi and e > lo]


def _blocks(
    qi: int, qc: int, ki: int, kc: int, c: int, causal: bool, runs: Runs | None
) -> Iterator[tuple[slice, slice, slice, bool]]:
    """(batch, local query rows, local key rows, causal) of each kernel call a pair needs.

    Without documents: the whole pair, causal on the diagonal. With them: one call per sample
    and per (query run, key run) of the same document, which is all a document mask allows
    between two chunks; a query and a key run of one document in one chunk are the same run
    (a causal square) or lie one before the other (the earlier keys wholly seen, the later
    ones not at all under a causal mask)."""
    if runs is None:
        rows, cols = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
        yield slice(None), rows, cols, causal and kc == qc
        return
    for b, sample in enumerate(runs):
        keys: dict[int, list[tuple[int, int]]] = {}  # document id: its key runs in the chunk
        for doc, ka, ke in _clip(sample, kc, c):
            keys.setdefault(doc, []).append((ka, ke))
        for doc, qa, qe in _clip(sample, qc, c):
            for ka, ke in keys.get(doc, ()):
                if causal and kc == qc and ka > qa:
                    continue
                rows, cols = slice(qi * c + qa, qi * c + qe), slice(ki * c + ka, ki * c + ke)
                yield slice(b, b + 1), rows, cols, causal and kc == qc and ka == qa


def _finite(lse: Tensor) -> Tensor:
    # Rows nobody has reached (lse −inf) subtract 0 instead, so exp gives 0 rather than NaN.
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _merge(out: Tensor, lse: Tensor, block: Tensor, block_lse: Tensor) -> None:
    """Fold a block's normalised output and lse into the running ones (views, in place)."""
    merged = torch.logaddexp(lse, block_lse)
    base = _finite(merged)
    out.mul_(torch.exp(lse - base).unsqueeze(-1))
    out.add_(block * torch.exp(block_lse - base).unsqueeze(-1))
    lse.copy_(merged)


def attend_block(q, kv, index, src, size, causal, runs, out, lse) -> None:
    """Fold the attention of this rank's queries q [b, heads, 2c, d] over ring position ``src``'s
    K/V block ``kv`` [2, b, groups, 2c, d] into the running fp32 ``out`` and ``lse`` (in place):
    the pairs the mask leaves, one kernel call each. The forward's work for one ring step."""
    c, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[3])
    for pair in _pairs(index, src, size, causal):
        for n, rows, cols, diagonal in _blocks(*pair, c, causal, runs):
            block, block_lse = kernels.forward(
                q[n, :, rows], kv[0][n, :, cols], kv[1][n, :, cols], diagonal, scale
            )
            _merge(out[n, :, rows], lse[n, :, rows], block, block_lse)


def attend_block_backward(dout, q, kv, out, lse, index, src, size, causal, runs, dq, dkv) -> None:
    """Add the same pairs' shares of the gradients to the fp32 ``dq`` (like q) and ``dkv`` (like
    kv), from the merged ``out`` and ``lse``: each pair's P = exp(s − lse) and rowsum(dO · O)
    are the whole softmax's, so the kernel's backward gives that pair's exact share."""
    c, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[3])
    for pair in _pairs(index, src, size, causal):
        for n, rows, cols, diagonal in _blocks(*pair, c, causal, runs):
            dqb, dkb, dvb = kernels.backward(
                dout[n, :, rows],
                q[n, :, rows],
                kv[0][n, :, cols],
                kv[1][n, :, cols],
                out[n, :, rows],
                lse[n, :, rows],
                diagonal,
                scale,
            )
            dq[n, :, rows] += dqb
            dkv[0][n, :, cols] += dkb
            dkv[1][n, :, cols] += dvb
            del dqb, dkb, dvb


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, runs):
        b, h, s_local, d = q.shape
        size = ring.size
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kv = torch.stack((k, v))
        for step in range(size):
            if step < size - 1:
                nxt = torch.empty_like(kv)
                works = _hop(ring, kv, nxt)
            src = (ring.index - step) % size
            attend_block(q, kv, ring.index, src, size, causal, runs, out, lse)
            if step < size - 1:
                _wait(works)
                kv = nxt
        # In [b, s, heads, d] memory order, as SDPA returns it: the layer's transpose and
        # reshape into the dense input are then a view of this, not a copy kept beside it.
        result = torch.empty(b, s_local, h, d, dtype=q.dtype, device=q.device)
        out = result.copy_(out.transpose(1, 2)).transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.runs = ring, causal, runs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, runs = ctx.ring, ctx.causal, ctx.runs
        size = ring.size
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        own = incoming = None  # this rank's own dK/dV; the last dK/dV hop (works, recv, sent)
        for step in range(size):
            if step < size - 1:
                nxt = torch.empty_like(kv)
                works = _hop(ring, kv, nxt)
            src = (ring.index - step) % size
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            attend_block_backward(
                dout, q, kv, out, lse, ring.index, src, size, causal, runs, dq, dkv
            )
            if step < size - 1:
                _wait(works)
                kv = nxt
            if step == 0:
                own = dkv  # never leaves: the owner is the block's first holder
                continue
            if incoming is not None:  # the block's earlier holders' sum (none at step 1)
                _wait(incoming[0])
                dkv += incoming[1]
            # Pass the accumulator on; from behind comes the one of the block held next, and
            # after the last step, this rank's own block's.
            buf = torch.empty_like(dkv)
            incoming = (_hop(ring, dkv, buf), buf, dkv)  # the sent tensor lives until waited
        if incoming is not None:
            _wait(incoming[0])
            own += incoming[1]
        del kv, dkv, incoming  # before the casts to the inputs' dtype: they are the peak no more
        dq = dq.to(q.dtype)
        return dq, own[0].to(k.dtype), own[1].to(v.dtype), None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ring: Ring,
    causal: bool,
    document_ids: Tensor | None,
    runs: Runs | None = None,
) -> Tensor:
    """Attention of this rank's queries over the whole sequence held by ``ring``.

    q: [b, heads, 2c, d], k and v: [b, groups, 2c, d] (this rank's two chunks, in local
    order); ``document_ids``: None or the full [b, S] ids, and ``runs`` their
    ``document_runs`` if already found (a forward pass finds them once for all its layers).
    Returns [b, heads, 2c, d] in q's dtype: softmax(q kᵀ / sqrt(d) + mask) v, without dropout.
    """
    b, h, s_local, _ = q.shape
    g = k.shape[1]
    if s_local % 2 or h % g or k.shape != v.shape or k.shape[2] != s_local:
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    runs = None
    if document_ids is not None:
        if document_ids.shape != (b, s_local * ring.size):
            raise ValueError(f"document_ids {tuple(document_ids.shape)} are not [b, S]")
        if runs is None:
            runs = document_runs(document_ids)
    return _RingAttention.apply(q, k, v, ring, causal, runs)
