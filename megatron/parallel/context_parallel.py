"""Context parallelism: ring attention over a sequence split across a CP group.

Layout. A sample's S tokens are cut into 2·CP chunks of c = S / (2·CP); ring position r holds
chunks r and 2·CP−1−r, in that order. Under a causal mask the work of a query chunk grows with
its index, so pairing an early chunk with its mirror gives every rank the same number of
(query chunk, key chunk) pairs: 2·CP+1 non-empty ones for each rank. Positions stay global:
``held_positions`` names the tokens a rank holds, ``split_sequence`` cuts any tensor alike.

Forward. Every rank keeps its queries; the K/V blocks (k and v stacked into one tensor) travel
around the ring, so at step i a rank holds position (index − i) mod CP's block. The next hop is
started before the current block's attention is computed and waited for after, overlapping the
transfer with compute. Each block's partial output is normalised on its own and merged into the
running output with its log-sum-exp, all in fp32 (scores included, whatever the input dtype);
the output is cast back at the end. Between two chunks the causal mask is full (key chunk
before query chunk), lower-triangular (same chunk) or empty (key chunk after): empty pairs are
skipped without a matmul. Document ids (the full [b, S] tensor, the same on every rank) add an
elementwise equality mask; only global chunk ids index them, so no mask travels. A row that a
pair masks entirely has lse −inf there and contributes nothing; the merged lse is finite, since
each query sees at least itself.

Backward recomputes each pair's probabilities from the saved lse (flash-attention's formulas)
while the K/V blocks rotate again. A block's dK/dV accumulator (fp32) follows it one hop behind:
the owner keeps its own block's contribution locally, a rank adds its contribution to the
accumulator it receives and passes it on, and the last holder's hop lands it back at the owner.
That hop, too, runs while the next block is computed.

Traffic per call, with CP = size (one point-to-point send per message, no collective):
- forward: size − 1 K/V messages (each [2, b, groups, 2c, d] in the input dtype);
- backward: size − 1 K/V messages and size − 1 dK/dV messages ([2, b, groups, 2c, d], fp32).
size 1 sends nothing and is plain attention.

Saved for backward: the local q, k, v, the output, and the lse (fp32 [b, heads, 2c]); the
document ids are referenced, not copied. Received blocks live for one step. Grouped-query
attention sends only the groups' k/v: heads are viewed as [groups, heads / groups] and broadcast
against their group in the matmuls, and per-head dK/dV are summed back to groups.

The per-pair math is plain torch and materialises [b, heads, c, c] fp32 scores per pair; a fused
kernel that returns the lse (flash attention) is a later speed-up behind the same merge.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


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


def _mask(qc: int, kc: int, c: int, causal: bool, docs: Tensor | None, device) -> Tensor | None:
    """Where a query of chunk ``qc`` may attend a key of chunk ``kc`` (None: everywhere),
    broadcastable to the scores' [b, groups, heads / groups, c, c]."""
    mask = None
    if causal and kc == qc:
        mask = torch.ones(c, c, dtype=torch.bool, device=device).tril()
    if docs is not None:
        same = docs[:, qc * c : (qc + 1) * c, None] == docs[:, None, kc * c : (kc + 1) * c]
        same = same[:, None, None]
        mask = same if mask is None else same & mask
    return mask


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """fp32 masked scores [b, g, r, c, c] of q [b, g, r, c, d] against k [b, g, c, d]."""
    s = torch.matmul(q.float(), k.float().unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, docs):
        b, h, s_local, d = q.shape
        g, c, size = k.shape[1], s_local // 2, ring.size
        scale = 1.0 / math.sqrt(d)
        q5 = q.reshape(b, g, h // g, s_local, d)  # head i uses K/V group i // (h // g)
        out = torch.zeros(q5.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q5.shape[:-1], float("-inf"), device=q.device)
        kv = torch.stack((k, v))
        for step in range(size):
            if step < size - 1:
                nxt = torch.empty_like(kv)
                works = _hop(ring, kv, nxt)
            src = (ring.index - step) % size
            for qi, qc, ki, kc in _pairs(ring.index, src, size, causal):
                rows, cols = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                mask = _mask(qc, kc, c, causal, docs, q.device)
                s = _scores(q5[..., rows, :], kv[0][..., cols, :], mask, scale)
                block_lse = torch.logsumexp(s, -1)
                p = torch.exp(s - _finite(block_lse).unsqueeze(-1))
                block = torch.matmul(p, kv[1][..., cols, :].float().unsqueeze(2))
                _merge(out[..., rows, :], lse[..., rows], block, block_lse)
            if step < size - 1:
                _wait(works)
                kv = nxt
        # In [b, s, heads, d] memory order, as SDPA returns it: the layer's transpose and
        # reshape into the dense input are then a view of this, not a copy kept beside it.
        result = torch.empty(b, s_local, h, d, dtype=q.dtype, device=q.device)
        out = result.copy_(out.view(b, h, s_local, d).transpose(1, 2)).transpose(1, 2)
        lse = lse.view(b, h, s_local)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.docs = ring, causal, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, docs = ctx.ring, ctx.causal, ctx.docs
        b, h, s_local, d = q.shape
        g, c, size = k.shape[1], s_local // 2, ring.size
        scale = 1.0 / math.sqrt(d)
        shape5 = (b, g, h // g, s_local, d)
        q5, do5 = q.reshape(shape5).float(), dout.reshape(shape5).float()
        lse5 = lse.view(shape5[:-1])
        delta = (dout.float() * out.float()).sum(-1).view(shape5[:-1])
        dq = torch.zeros(shape5, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        own = incoming = None  # this rank's own dK/dV; the last dK/dV hop (works, recv, sent)
        for step in range(size):
            if step < size - 1:
                nxt = torch.empty_like(kv)
                works = _hop(ring, kv, nxt)
            src = (ring.index - step) % size
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            for qi, qc, ki, kc in _pairs(ring.index, src, size, causal):
                rows, cols = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                mask = _mask(qc, kc, c, causal, docs, q.device)
                kb, vb = kv[0][..., cols, :].float(), kv[1][..., cols, :].float()
                p = torch.exp(_scores(q5[..., rows, :], kb, mask, scale) - lse5[..., rows, None])
                do = do5[..., rows, :]
                dkv[1][..., cols, :] += torch.matmul(p.transpose(-1, -2), do).sum(2)
                dp = torch.matmul(do, vb.unsqueeze(2).transpose(-1, -2))
                ds = p * (dp - delta[..., rows, None])
                dq[..., rows, :] += torch.matmul(ds, kb.unsqueeze(2)) * scale
                dkv[0][..., cols, :] += (
                    torch.matmul(ds.transpose(-1, -2), q5[..., rows, :]).sum(2) * scale
                )
                del p, dp, ds  # before the next pair's: four score blocks at most, not five
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
        dq = dq.to(q.dtype).view(q.shape)  # contiguous, whatever q's strides
        return dq, own[0].to(k.dtype), own[1].to(v.dtype), None, None, None


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, ring: Ring, causal: bool, document_ids: Tensor | None
) -> Tensor:
    """Attention of this rank's queries over the whole sequence held by ``ring``.

    q: [b, heads, 2c, d], k and v: [b, groups, 2c, d] (this rank's two chunks, in local
    order); ``document_ids``: None or the full [b, S] ids. Returns [b, heads, 2c, d] in q's
    dtype: softmax(q kᵀ / sqrt(d) + mask) v, without dropout.
    """
    b, h, s_local, _ = q.shape
    g = k.shape[1]
    if s_local % 2 or h % g or k.shape != v.shape or k.shape[2] != s_local:
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if document_ids is not None:
        if document_ids.shape != (b, s_local * ring.size):
            raise ValueError(f"document_ids {tuple(document_ids.shape)} are not [b, S]")
        document_ids = document_ids.to(q.device)
    return _RingAttention.apply(q, k, v, ring, causal, document_ids)
