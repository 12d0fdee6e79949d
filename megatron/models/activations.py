"""``model.activation`` as the MLPs apply it: the dense MLP, the experts and the shared expert
(``activate``), and BERT's LM-head transform (``gelu``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def gelu(x: Tensor, activation: str) -> Tensor:
    """``model.activation``: "gelu" is exact (erf); "gelu_tanh" is the tanh approximation that
    released GPT-2 weights were trained with (HF's ``gelu_new``). BERT's LM-head transform keeps
    exact GeLU under "swiglu" MLPs."""
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def activate(y: Tensor, activation: str) -> Tensor:
    """fc1's output [..., f'] -> [..., f]: with SwiGLU, fc1's rows interleaved [f, (gate, up)]
    give SiLU(gate) * up; else GeLU (exact or tanh) of all f' = f."""
    if activation == "swiglu":
        gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)  # each [..., f]
        return F.silu(gate) * up
    return gelu(y, activation)
