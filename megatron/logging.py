"""One logger, one rank; the metrics' writers live in megatron.training.metrics."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("megatron")


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO to stdout; the others only WARNING and above, tagged with their rank."""
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False
