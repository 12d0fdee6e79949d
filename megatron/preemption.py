"""The exit signal: a handler that only records that the signal came.

The loop reads ``received`` once per iteration and all ranks agree through one all-reduce, so a
signal delivered to any one rank makes every rank save at the same iteration and exit 0.
"""

from __future__ import annotations

import signal
from types import FrameType


class ExitSignal:
    """Records delivery of the signal ``name`` until ``restore()`` reinstates the old handler."""

    def __init__(self, name: str):
        self.signum = getattr(signal, name)
        self.received = False
        self._previous = signal.signal(self.signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def restore(self) -> None:
        signal.signal(self.signum, self._previous)
