"""Which rank slows the others: each rank's host time per phase of a step, summed over the log
window with ``time.perf_counter`` (no device read: on CUDA a phase is the time the host spends
in it, launches and the waits it makes), gathered on log steps in the same gloo all-gather as the
memory figures, and each rank set against the median of the ranks doing the same work (its
pipeline stage; of an even count the lower middle one, so that of two ranks the slower is set
against the faster, not against their mean, which it can never double).

Phases: ``data`` (the next micro-batch: the loader and the copy to the device), ``compute``
(forward and backward; with pipeline parallelism the schedule, its sends and receives
included), ``grad_sync`` (the gradient all-reduces not overlapped with backward) and
``optimizer`` (the step with its all-reduce and host sync). The last two are where the others
wait for a slow rank, so they never name one: a straggler shows in ``data`` or ``compute``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from typing import NamedTuple

PHASES = ("data", "compute", "grad_sync", "optimizer")
_WAITS = {"grad_sync", "optimizer"}
# Test-only: "RANK:SECONDS" sleeps that long in RANK's every data phase (a slow loader on purpose).
DATA_DELAY = "MEGATRON_TEST_DATA_DELAY"


class Straggler(NamedTuple):
    rank: int
    host: str
    phase: str
    ms: float  # per iteration over the window
    median_ms: float  # of the ranks in its pipeline stage


class PhaseTimes:
    """This rank's seconds per phase since the last log step."""

    def __init__(self, rank: int):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        delay_rank, _, delay = os.environ.get(DATA_DELAY, "").partition(":")
        self.delay = float(delay) if delay_rank == str(rank) else 0.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        """The data phase, with the test's delay in it."""
        with self.phase("data"):
            if self.delay:
                time.sleep(self.delay)
            yield

    def window_ms(self) -> dict[str, float]:
        """ms per step of each phase over the window (``phase_<name>_ms``), then reset."""
        steps = max(self.steps, 1)
        figures = {f"phase_{name}_ms": 1000 * s / steps for name, s in self.seconds.items()}
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        return figures


def find_stragglers(
    every_rank: dict[str, list[float]],
    stages: list[int],
    hosts: list[str],
    threshold: float,
    floor_ms: float,
) -> list[Straggler]:
    """The ranks whose ``data`` or ``compute`` time per iteration (``every_rank``: each
    ``phase_<name>_ms``, index: global rank) is at least ``threshold`` times the median of their
    pipeline stage (``stages``: each rank's) and more than ``floor_ms`` above it (so that noise on
    a phase of a few microseconds names nobody)."""
    found = []
    for name in PHASES:
        if name in _WAITS:
            continue
        times = every_rank[f"phase_{name}_ms"]
        for stage in sorted(set(stages)):
            ranks = [r for r, s in enumerate(stages) if s == stage]
            median = statistics.median_low(times[r] for r in ranks)
            for r in ranks:
                if times[r] >= threshold * median and times[r] - median > floor_ms:
                    found.append(Straggler(r, hosts[r], name, times[r], median))
    return found
