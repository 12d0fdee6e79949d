"""One logger, one rank: the console line, TensorBoard scalars and the JSON-lines metrics file.

Only global rank 0 writes; other ranks log warnings and errors alone. The TensorBoard writer and
the metrics file sit behind objects that do nothing when disabled, so call sites never branch.
A training line averages the iterations of a ``LogWindow``; the window travels in checkpoints, so
a run resumed in the middle of one writes the same lines as a run that never stopped.
"""

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
