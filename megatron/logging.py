"""One logger, one rank: the console line, TensorBoard scalars and the JSON-lines metrics file.

Only global rank 0 writes; other ranks log warnings and errors alone. The TensorBoard writer and
the metrics file sit behind objects that do nothing when disabled, so call sites never branch.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from typing import Any

import torch

log = logging.getLogger("megatron")


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO to stdout; the others only WARNING and above, tagged with their rank."""
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated device memory (CUDA), or the process's peak resident size (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


class _NullWriter:
    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def add_text(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsLogger:
    """TensorBoard scalars (Megatron's names, each with a ``vs samples`` twin) and JSON lines."""

    def __init__(
        self,
        tensorboard_dir: str | None,
        metrics_file: str | None,
        enabled: bool,
        config_text: str,
    ):
        self.tb: Any = _NullWriter()
        self.metrics = None
        if not enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir)
            self.tb.add_text("config", f"```yaml\n{config_text}\n```")
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            # Append: a resumed run continues the same file; each line is flushed whole.
            self.metrics = open(metrics_file, "a", buffering=1)  # noqa: SIM115

    def scalars(self, values: dict[str, float], iteration: int, samples: int) -> None:
        for name, value in values.items():
            self.tb.add_scalar(name, value, iteration)
            self.tb.add_scalar(f"{name} vs samples", value, samples)

    def record(self, entry: dict[str, Any]) -> None:
        """One JSON line; floats are written with repr precision, so runs compare exactly."""
        if self.metrics is not None:
            self.metrics.write(json.dumps(entry) + "\n")

    def flush(self) -> None:
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()
        if self.metrics is not None:
            self.metrics.close()


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(20) like Megatron so early evaluations stay printable."""
    return math.exp(min(20.0, loss))


def format_line(fields: dict[str, Any]) -> str:
    """`` key: value | key: value`` with Megatron's number formats."""
    parts = []
    for key, value in fields.items():
        if isinstance(value, float):
            scientific = ("loss" in key and key != "loss scale") or key == "learning rate"
            text = f"{value:.6E}" if scientific else f"{value:.2f}"
        else:
            text = str(value)
        parts.append(f"{key}: {text}")
    return " | ".join(parts)
