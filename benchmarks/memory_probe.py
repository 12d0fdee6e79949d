"""What the memory benchmarks measure against the estimate: a GPT built as training builds it,
and the bytes one forward saves for backward, per transformer layer.

Distinct storages, not the bytes of each saved tensor: several saved tensors alias one
allocation (q, k and v are views of QKV's output; a reshape of the attention output is the dense
layer's input) and a view keeps its whole storage alive, so the storages are the memory backward
holds. Each is charged to the transformer layer in whose forward it is first saved (a layer's
input is first saved by its own first LayerNorm); parameters are left out.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megatron.config.schema import Config, padded_vocab_size


def build_gpt(cfg: Config, state, vocab_size: int) -> nn.Module:
    """The GPT of ``cfg`` on ``state``'s groups, in the config's dtype, as training builds it."""
    from megatron.config.dtypes import DTYPES
    from megatron.models.build import build_model
    from megatron.parallel.random import RNGTracker

    tracker = RNGTracker(state.device)
    tracker.seed(cfg.training.seed, state.tp_rank)
    padded = padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, state.tp_size)
    model = build_model("gpt", cfg, vocab_size, padded, state, tracker)
    return model.to(DTYPES[cfg.precision.dtype]).train()


def saved_bytes(model: nn.Module, *inputs: Tensor) -> tuple[list[int], int]:
    """One forward ``model(*inputs)``: the bytes of the distinct storages saved for backward,
    charged to the layer whose forward first saves them, and in all (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers = list(model.transformer.layers)
    owner: dict[int, int] = {}  # storage -> the layer it was first saved in (-1: outside)
    nbytes: dict[int, int] = {}
    current = {"layer": -1}  # the layer whose forward is running, set by the module hooks

    def enter(index: int):
        return lambda *_: current.update(layer=index)

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(enter(i)))
        handles.append(layer.register_forward_hook(enter(-1)))

    def pack(t: Tensor) -> Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in owner:
            owner[ptr], nbytes[ptr] = current["layer"], t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    del out
    per_layer = [sum(n for ptr, n in nbytes.items() if owner[ptr] == i) for i in range(len(layers))]
    return per_layer, sum(nbytes.values())
