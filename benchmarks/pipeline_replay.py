"""What a recorded pipeline step's timeline says about its bubble (benchmarks/bench_pipeline.py's
accounting): the exchange time each unit waited that its dependencies do not explain
(``observed_delays``; replaying with it, megatron/parallel/pipeline/replay.py, reproduces the
timeline exactly), and the same unit order at equal unit durations (``uniform``).
"""

from __future__ import annotations

import statistics

from megatron.parallel.pipeline import Event
from megatron.parallel.pipeline.replay import input_of, virtual_stages


def observed_delays(events_per_stage: list[list[Event]]) -> list[list[float]]:
    """Each unit's recorded start minus the moment both its stage was free (its previous unit
    ended) and its input was produced: the time its stage spent in exchanges that the unit's
    dependencies do not explain. Replaying with these reproduces the recorded timeline."""
    p, virtual = len(events_per_stage), virtual_stages(events_per_stage)
    end = {
        (e.kind, e.chunk * p + s, e.microbatch): e.end
        for s, st in enumerate(events_per_stage)
        for e in st
    }
    step_start = min(e.start for stage in events_per_stage for e in stage)
    delays = []
    for s, events in enumerate(events_per_stage):
        previous_end, stage_delays = step_start, []
        for e in events:
            source = input_of(e, s, p, virtual)
            ready = previous_end if source is None else max(previous_end, end[source])
            stage_delays.append(e.start - ready)
            previous_end = e.end
        delays.append(stage_delays)
    return delays


def uniform(events_per_stage: list[list[Event]]) -> list[list[Event]]:
    """The same unit order with every forward (backward) at the median forward (backward)
    duration over all stages: equal stage costs, as the formula assumes."""
    median = {
        kind: statistics.median(
            e.end - e.start for stage in events_per_stage for e in stage if e.kind == kind
        )
        for kind in "FB"
    }
    return [
        [Event(e.kind, e.chunk, e.microbatch, 0.0, median[e.kind]) for e in s]
        for s in events_per_stage
    ]
