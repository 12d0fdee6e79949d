"""Every RNG state a bit-exact resume needs, as tensors and JSON (nothing to unpickle).

torch's CPU and CUDA generators and the TP dropout tracker are tensors; python's and numpy's
Mersenne Twister states are JSON in the safetensors header of the rank's RNG file.
"""

from __future__ import annotations

import json
import random

import numpy as np
import torch
from torch import Tensor

from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState


def rng_state(
    state: ParallelState, tracker: RNGTracker | None
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tensors, header): torch CPU/CUDA and tracker states; python and numpy states as JSON."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and state.device.type == "cuda":
        tensors["cuda"] = torch.cuda.get_rng_state(state.device)
    if tracker is not None and tracker.tp_state is not None:
        tensors.update({f"tracker/{k}": v for k, v in tracker.state_dict().items()})
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    header = {
        "python": json.dumps([version, list(mt), gauss]),
        "numpy": json.dumps([name, keys.tolist(), pos, has_gauss, cached]),
    }
    return tensors, header


def set_rng_state(tensors: dict[str, Tensor], header: dict[str, str], tracker: RNGTracker) -> None:
    """Restore what ``rng_state`` captured."""
    version, mt, gauss = json.loads(header["python"])
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = json.loads(header["numpy"])
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if "cuda" in tensors:
        torch.cuda.set_rng_state(tensors["cuda"], tracker.generator.device)
    if "tracker/tp" in tensors:
        tracker.load_state_dict({"shared": tensors["tracker/shared"], "tp": tensors["tracker/tp"]})


def reseed(seed: int, iteration: int) -> int:
    """A seed for a resumed run whose saved RNG states do not fit: a function of both numbers."""
    return int(np.random.SeedSequence([seed, iteration]).generate_state(1)[0])
