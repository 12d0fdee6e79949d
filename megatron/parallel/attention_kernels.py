"""The fused attention kernel each ring-attention pair runs, chosen per device in one place.

A pair is one block of queries against one block of keys, unmasked or causal (square, aligned
top-left: the diagonal pair). ``forward`` returns its output, normalised on its own, and its
log-sum-exp; ``backward`` takes the *merged* output and log-sum-exp of every pair a query row
saw (flash attention's backward: with the final output O and the final lse, a pair's
P = exp(s - lse) and D = rowsum(dO * O) are the whole softmax's, so its dq, dk, dv are its
exact contributions to the full gradients). Neither holds a [rows, keys] score matrix: the
kernels tile it in registers or per-thread blocks.

Which kernel runs where:

- CPU (any dtype, float64 included): ``aten._scaled_dot_product_flash_attention_for_cpu`` and
  its ``_backward``, torch's tiled CPU flash kernel (what SDPA itself runs on CPU without
  dropout). It reads grouped-query k and v at group size (head i uses group i // (heads /
  groups)) and returns dk, dv at group size. Its lse is [b, heads, rows], natural log, fp32
  (float64 for float64 inputs). The tests check this path against a float64 reference.
- CUDA, fp16 and bf16: ``aten._scaled_dot_product_flash_attention`` and its ``_backward``,
  FlashAttention-2 as torch builds it. It reads grouped-query k and v at group size, as the CPU
  kernel does, and returns dk, dv at group size: no per-head copy of K/V. Its lse is [b, heads,
  rows], natural log, fp32. Its backward takes the forward's sequence offsets, undefined for
  dense batches: None passes an undefined tensor, as SDPA's own autograd does. Checked on an
  H200 (``scripts/gpu_check.sh``'s ``ring_attention`` step: 64K tokens, CP 2, against SDPA over
  the whole sequence). The memory-efficient kernel was the first choice; its backward (torch
  2.11, through ``_efficient_attention_backward`` and through SDPA's own op pair alike) reads
  out of bounds at 16K-row blocks of 32 heads.
- CUDA, fp32 (which flash does not take): ``aten._efficient_attention_forward`` and
  ``_backward``, the memory-efficient kernel, in [b, rows, heads, d] layout (our tensors are
  transposed views of it), k and v expanded to heads and dk, dv summed back to groups, its lse
  padded to rows rounded up to 32. Checked on the H200 at CP 2 with 256, 8K and 16K tokens (blocks
  of up to 4K rows; max error 4e-6 against SDPA in fp32); the out-of-bounds read above is its
  backward's, at 16K-row blocks; blocks between 4K and 16K rows are unchecked.

Any other device raises: there is no unfused fallback to fall back to silently.
"""

from __future__ import annotations

import torch
from torch import Tensor

_ALIGN_LSE = 32  # the memory-efficient kernel's lse rows are padded to a multiple of this


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def kernel_name(device: torch.device) -> str:
    """The kernel ``forward`` and ``backward`` run on ``device``."""
    names = {
        "cpu": "_scaled_dot_product_flash_attention_for_cpu",
        "cuda": "_scaled_dot_product_flash_attention (fp32: _efficient_attention)",
    }
    return names.get(device.type, "none")


def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of q [b, heads, m, d] over k, v [b, groups, n, d]: (output [b, heads, m, d] in
    q's dtype, lse fp32 [b, heads, m]). ``causal``: key j is seen by query i iff j <= i."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale
        )
        return out, lse.float()
    if q.device.type == "cuda":
        return _cuda_forward(q, k, v, causal, scale)
    raise NotImplementedError(f"ring attention has no fused kernel for {q.device.type}")


def backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale
) -> tuple[Tensor, Tensor, Tensor]:
    """This pair's (dq, dk, dv) in the inputs' dtypes, dk and dv at group size, given the
    merged output ``out`` and merged ``lse`` (fp32 [b, heads, m]) of these query rows."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(_lse_dtype(q)), 0.0, causal, attn_mask=None, scale=scale
        )
    if q.device.type == "cuda":
        return _cuda_backward(dout, q, k, v, out, lse, causal, scale)
    raise NotImplementedError(f"ring attention has no fused kernel for {q.device.type}")


def _cuda_forward(q, k, v, causal, scale):  # pragma: no cover - needs a GPU
    if q.dtype == torch.float32:
        return _efficient_forward(q, k, v, causal, scale)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse


def _cuda_backward(dout, q, k, v, out, lse, causal, scale):  # pragma: no cover - needs a GPU
    if q.dtype == torch.float32:
        return _efficient_backward(dout, q, k, v, out, lse, causal, scale)
    m, n = q.shape[2], k.shape[2]
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)  # no dropout: never read
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, m, n, 0.0, causal, rng, rng, scale=scale
    )


def _per_head(t: Tensor, heads: int) -> Tensor:
    """[b, groups, n, d] -> [b, n, heads, d] (BMHK), each group repeated for its heads."""
    groups = t.shape[1]
    if groups != heads:
        t = t.repeat_interleave(heads // groups, dim=1)
    return t.transpose(1, 2)


def _to_groups(t: Tensor, groups: int) -> Tensor:
    """[b, n, heads, d] gradients -> [b, groups, n, d], summed over each group's heads."""
    b, n, heads, d = t.shape
    t = t.transpose(1, 2)
    if groups == heads:
        return t
    return t.reshape(b, groups, heads // groups, n, d).sum(2)


def _efficient_forward(q, k, v, causal, scale):  # pragma: no cover - needs a GPU
    heads, m = q.shape[1], q.shape[2]
    out, lse, *_ = torch.ops.aten._efficient_attention_forward(
        q.transpose(1, 2),
        _per_head(k, heads),
        _per_head(v, heads),
        None,
        None,
        None,
        None,
        None,
        0.0,
        1 if causal else 0,  # custom_mask_type 1: causal from the top left
        True,
        scale=scale,
    )
    return out.transpose(1, 2), lse[..., :m].float()


def _efficient_backward(dout, q, k, v, out, lse, causal, scale):  # pragma: no cover - needs a GPU
    b, heads, m, _ = q.shape
    n = k.shape[2]
    padded = torch.zeros(b, heads, -(-m // _ALIGN_LSE) * _ALIGN_LSE, device=q.device)
    padded[..., :m] = lse
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: never read
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        _per_head(k, heads),
        _per_head(v, heads),
        None,
        out.transpose(1, 2),
        None,
        None,
        m,
        n,
        padded,
        0.0,
        seed,
        seed,
        1 if causal else 0,
        False,
        scale=scale,
    )
    return dq.transpose(1, 2), _to_groups(dk, k.shape[1]), _to_groups(dv, k.shape[1])
