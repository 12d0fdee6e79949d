"""Attention within documents, built on the device from per-token document ids.

With ``data.reset_attention_mask`` a sample packs several documents, and a token attends only to
earlier tokens of its own document. The batch carries ``document_ids`` [b, s] (made by
``megatron.data.gpt_dataset.ltor_masks``) instead of a dense [b, 1, s, s] mask; the model turns
them into one mask per forward pass on the device, shared by every layer:

- on CUDA, when attention dropout is off (flex attention has none): a flex-attention
  ``BlockMask``, so whole blocks outside the documents are skipped and the kernel stays fused;
- otherwise: an additive [b, 1, s, s] mask (0 / -inf) in the activations' dtype for
  ``scaled_dot_product_attention``, made once rather than converted from bool in every layer.

Both say exactly ``key <= query and doc[key] == doc[query]``, Megatron's reset attention mask.

With context parallelism a rank holds two chunks of each sequence and attends over every rank's
keys in turn: the model passes a ``RingMask`` (causal or not, and the whole samples' document
ids), which ring attention applies block by block (``megatron.parallel.context_parallel``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.parallel.context_parallel import Runs, document_runs

try:  # torch >= 2.5; older builds keep the dense mask everywhere
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - depends on the installed torch
    BlockMask = create_block_mask = flex_attention = None


@dataclass(frozen=True)
class RingMask:
    """What ring attention masks: later keys when ``causal``, and keys of other documents when
    ``document_ids`` (int [b, s] over the whole sequence, not this rank's share) are given."""

    causal: bool
    document_ids: Tensor | None = None

    @functools.cached_property
    def runs(self) -> Runs | None:
        """The documents' runs ring attention calls its kernels on, found once per forward
        pass (one host copy of the ids) for every layer."""
        return None if self.document_ids is None else document_runs(self.document_ids)


def uses_flex(device: torch.device, dropout: float) -> bool:
    """Whether ``document_mask`` gives a BlockMask: CUDA, flex attention available, no dropout."""
    return flex_attention is not None and device.type == "cuda" and dropout == 0.0


def document_mask(doc: Tensor, dtype: torch.dtype, flex: bool) -> Tensor | BlockMask:
    """The causal within-document mask of ``doc`` [b, s] for every layer of one forward pass.

    ``flex``: a BlockMask for ``attention``; else additive float ``dtype`` [b, 1, s, s].
    """
    b, s = doc.shape
    if flex:

        def same_document_causal(batch, head, query, key):
            return (key <= query) & (doc[batch, query] == doc[batch, key])

        return create_block_mask(same_document_causal, b, None, s, s, device=doc.device)
    positions = torch.arange(s, device=doc.device)
    causal = positions[None, :] <= positions[:, None]  # [s_query, s_key]
    allowed = causal & (doc[:, None, :, None] == doc[:, None, None, :])  # [b, 1, s, s]
    mask = torch.zeros(b, 1, s, s, dtype=dtype, device=doc.device)
    return mask.masked_fill_(~allowed, float("-inf"))


@functools.cache
def _fused_flex():
    """flex_attention compiled once: run eagerly it materialises the full score matrix."""
    return torch.compile(flex_attention, dynamic=False)


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | BlockMask | None, dropout: float, causal: bool
) -> Tensor:
    """Scaled dot-product attention of q [b, heads, s, head_dim] and k, v [b, groups, s,
    head_dim] under ``mask``: query head i attends with key/value head i // (heads / groups),
    which both kernels read without materialising the repeated k and v (``enable_gqa``).

    A BlockMask goes to flex attention, which has no dropout (``uses_flex`` sees to that).
    Any other mask, or ``causal`` with none, goes to ``scaled_dot_product_attention``.
    """
    gqa = q.shape[1] != k.shape[1]
    if BlockMask is not None and isinstance(mask, BlockMask):
        if dropout:
            raise ValueError("flex attention has no dropout; use the additive document mask")
        if torch.compiler.is_compiling() or not q.is_cuda:
            # In a compiled layer dynamo fuses it into the layer's graph; on CPU the eager
            # (unfused, exact) form is what the tests check the mask with.
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        return _fused_flex()(q, k, v, block_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, enable_gqa=gqa
    )
