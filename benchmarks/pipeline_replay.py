"""Replaying a pipeline step's recorded units: what the schedule's order, the units' durations and
the transfers explain of its bubble (benchmarks/bench_pipeline.py's accounting).

A replay starts each unit as early as its stage's order and its input allow: a forward of
virtual stage j needs the forward of j - 1 on the same micro-batch, a backward of j the backward
of j + 1; delays model the exchanges in between. With free transfers and equal units it gives
(p - 1) / (m * v); with each unit's exchange time read off the timeline (``observed_delays``) it
reproduces the timeline exactly.
"""

from __future__ import annotations

import statistics

from megatron.parallel.pipeline import Event


def _input_of(event: Event, stage: int, p: int, virtual: int) -> tuple[str, int, int] | None:
    """The unit whose output ``event`` receives from another stage, as (kind, virtual stage,
    micro-batch); None where it reads the micro-batch or its own forward's loss.

    Forward of virtual stage j (chunk c on stage s is j = c * p + s) needs the forward of j - 1
    on the same micro-batch; backward of j the backward of j + 1."""
    j = event.chunk * p + stage
    source = j - 1 if event.kind == "F" else j + 1
    return (event.kind, source, event.microbatch) if 0 <= source < virtual else None


def _sends(event: Event, stage: int, p: int, virtual: int) -> bool:
    """True where ``event``'s result goes to another stage: a forward's output to the next
    virtual stage (none after the last), a backward's input gradient to the previous (none
    before the first)."""
    j = event.chunk * p + stage
    return j < virtual - 1 if event.kind == "F" else j > 0


def _virtual_stages(events_per_stage: list[list[Event]]) -> int:
    return len(events_per_stage) * (1 + max(e.chunk for s in events_per_stage for e in s))


def replay_bubble(
    events_per_stage: list[list[Event]],
    delays: list[list[float]],
    input_delays: list[list[float]] | None = None,
) -> float:
    """The bubble of the stages' recorded unit order, each unit taking its recorded duration
    and starting as early as the order allows: ``delays[stage][i]`` seconds after its stage is
    free, and ``input_delays[stage][i]`` (the same, where None) after its input (see
    ``_input_of``) is produced."""
    input_delays = delays if input_delays is None else input_delays
    p, virtual = len(events_per_stage), _virtual_stages(events_per_stage)
    end: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end
    free, done = [0.0] * p, [0] * p
    while any(done[s] < len(events_per_stage[s]) for s in range(p)):
        progressed = False
        for s, events in enumerate(events_per_stage):
            while done[s] < len(events):
                i, e = done[s], events[done[s]]
                source = _input_of(e, s, p, virtual)
                if source is not None and source not in end:
                    break  # its input is not there yet: let the other stages run
                ready = free[s] + delays[s][i]
                if source is not None:
                    ready = max(ready, end[source] + input_delays[s][i])
                free[s] = ready + e.end - e.start
                end[e.kind, e.chunk * p + s, e.microbatch] = free[s]
                done[s] += 1
                progressed = True
        if not progressed:
            raise ValueError("the recorded unit order deadlocks: not a pipeline schedule")
    busy = sum(e.end - e.start for stage in events_per_stage for e in stage)
    return (p * max(free) - busy) / busy


def transfer_delays(
    events_per_stage: list[list[Event]], transfer: float
) -> tuple[list[list[float]], list[list[float]]]:
    """``replay_bubble``'s two delay tables for transfers of ``transfer`` seconds each: a stage
    whose previous unit sent its result spends ``transfer`` posting it (a gloo send writes the
    tensor out before it returns), and a unit whose input comes from another stage starts
    ``transfer`` after that input was produced."""
    p, virtual = len(events_per_stage), _virtual_stages(events_per_stage)
    after_stage, after_input = [], []
    for s, events in enumerate(events_per_stage):
        sent = [False] + [_sends(e, s, p, virtual) for e in events[:-1]]
        after_stage.append([transfer if x else 0.0 for x in sent])
        after_input.append([transfer] * len(events))
    return after_stage, after_input


def observed_delays(events_per_stage: list[list[Event]]) -> list[list[float]]:
    """Each unit's recorded start minus the moment both its stage was free (its previous unit
    ended) and its input was produced: the time its stage spent in exchanges that the unit's
    dependencies do not explain. Replaying with these reproduces the recorded timeline."""
    p, virtual = len(events_per_stage), _virtual_stages(events_per_stage)
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
            source = _input_of(e, s, p, virtual)
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
