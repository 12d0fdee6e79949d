"""Replaying a pipeline step: each stage's units in the schedule's order, each starting as early
as its stage and its input allow.

A forward of virtual stage j (chunk c on stage s is j = c * p + s) needs the forward of j - 1 on
the same micro-batch, a backward of j the backward of j + 1; delays model the exchanges in
between. With free transfers and equal units it gives (p - 1) / (m * v). The step-time model
(megatron/estimate/step_time.py) replays the order of megatron/parallel/pipeline/timeline.py with
its predicted unit times; benchmarks/bench_pipeline.py replays recorded timelines.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron.parallel.pipeline.schedules import Event
from megatron.parallel.pipeline.timeline import schedule_units


def input_of(event: Event, stage: int, p: int, virtual: int) -> tuple[str, int, int] | None:
    """The unit whose output ``event`` receives from another stage, as (kind, virtual stage,
    micro-batch); None where it reads the micro-batch or its own forward's loss."""
    j = event.chunk * p + stage
    source = j - 1 if event.kind == "F" else j + 1
    return (event.kind, source, event.microbatch) if 0 <= source < virtual else None


def _sends(event: Event, stage: int, p: int, virtual: int) -> bool:
    """True where ``event``'s result goes to another stage: a forward's output to the next
    virtual stage (none after the last), a backward's input gradient to the previous (none
    before the first)."""
    j = event.chunk * p + stage
    return j < virtual - 1 if event.kind == "F" else j > 0


def virtual_stages(events_per_stage: list[list[Event]]) -> int:
    return len(events_per_stage) * (1 + max(e.chunk for s in events_per_stage for e in s))


def schedule_events(
    p: int, v: int, m: int, duration: Callable[[str, int, int], float]
) -> list[list[Event]]:
    """Each stage's units in the schedules' order (megatron/parallel/pipeline/timeline.py),
    numbered by micro-batch, unit (kind, chunk) of stage s lasting ``duration(kind, stage,
    chunk)`` (only durations matter to the replay)."""
    stages = []
    for s in range(p):
        seen: dict[tuple[str, int], int] = {}  # (kind, chunk) -> units so far = micro-batch
        events = []
        for kind, chunk in schedule_units(p, v, m, s):
            microbatch = seen.get((kind, chunk), 0)
            seen[kind, chunk] = microbatch + 1
            events.append(Event(kind, chunk, microbatch, 0.0, duration(kind, s, chunk)))
        stages.append(events)
    return stages


def replay(
    events_per_stage: list[list[Event]],
    delays: list[list[float]],
    input_delays: list[list[float]] | None = None,
) -> tuple[float, float]:
    """(makespan, busy time summed over stages) of the stages' unit order, each unit taking its
    recorded duration and starting as early as the order allows: ``delays[stage][i]`` seconds
    after its stage is free, and ``input_delays[stage][i]`` (the same, where None) after its
    input (see ``input_of``) is produced."""
    input_delays = delays if input_delays is None else input_delays
    p, virtual = len(events_per_stage), virtual_stages(events_per_stage)
    end: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end
    free, done = [0.0] * p, [0] * p
    while any(done[s] < len(events_per_stage[s]) for s in range(p)):
        progressed = False
        for s, events in enumerate(events_per_stage):
            while done[s] < len(events):
                i, e = done[s], events[done[s]]
                source = input_of(e, s, p, virtual)
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
    return max(free), busy


def replay_bubble(
    events_per_stage: list[list[Event]],
    delays: list[list[float]],
    input_delays: list[list[float]] | None = None,
) -> float:
    """The bubble of ``replay``: every stage's idle time over the busy time."""
    makespan, busy = replay(events_per_stage, delays, input_delays)
    return (len(events_per_stage) * makespan - busy) / busy


def transfer_delays(
    events_per_stage: list[list[Event]], transfer: float
) -> tuple[list[list[float]], list[list[float]]]:
    """``replay``'s two delay tables for transfers of ``transfer`` seconds each: a stage
    whose previous unit sent its result spends ``transfer`` posting it (a gloo send writes the
    tensor out before it returns), and a unit whose input comes from another stage starts
    ``transfer`` after that input was produced."""
    p, virtual = len(events_per_stage), virtual_stages(events_per_stage)
    after_stage, after_input = [], []
    for s, events in enumerate(events_per_stage):
        sent = [False] + [_sends(e, s, p, virtual) for e in events[:-1]]
        after_stage.append([transfer if x else 0.0 for x in sent])
        after_input.append([transfer] * len(events))
    return after_stage, after_input
