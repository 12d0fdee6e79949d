"""The pipeline bubble's accounting, and what the schedules wait for.

benchmarks/bench_pipeline.py measures the bubble of real PP=2 runs against (p - 1) / (m * v) plus
communication; a timing bar belongs there, not in a unit test. What is checked here holds on any
host: the schedule's unit order replayed with free transfers gives exactly the formula (and, for
two stages, 1F1B's m + 1 transfers on the critical path); on a real two-process run, compute plus
the exchanges observed in the recorded timeline replay that timeline's bubble exactly, so the
benchmark's split of the bubble into schedule, communication and host noise is complete; and in
the interleaved schedule no unit waits for more than its input (a forward that needs none waits
for no gradient, and no forward waits for its sender's next backward).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from benchmarks.bench_pipeline import FixedCostChunk, Shape, pipeline_run
from benchmarks.pipeline_replay import observed_delays
from megatron.parallel.pipeline import (
    ActivationSpec,
    Event,
    PipelineGroup,
    bubble_fraction,
    interleaved_one_f_one_b,
)
from megatron.parallel.pipeline.replay import replay_bubble, schedule_events, transfer_delays
from megatron.parallel.pipeline.timeline import ideal_bubble
from tests.distributed import run_distributed

STEPS, WARMUP = 5, 1


def ideal_events(p: int, v: int, m: int, forward: float, backward: float) -> list[list[Event]]:
    """Each stage's units in the schedules' order, of fixed durations."""
    return schedule_events(p, v, m, lambda kind, _s, _c: forward if kind == "F" else backward)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 1, 4), (3, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)])
def test_replay_with_free_transfers_gives_the_formula(p, v, m):
    """Equal stages, backward twice a forward: the replayed order idles exactly (p-1)/(m*v)."""
    events = ideal_events(p, v, m, 1.0, 2.0)
    bubble = replay_bubble(events, *transfer_delays(events, 0.0))
    assert bubble == pytest.approx(ideal_bubble(p, v, m), rel=1e-12)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_two_stage_1f1b_puts_m_plus_one_transfers_on_the_critical_path(m):
    """Two stages: micro-batch 0 goes down, then each backward on stage 1 waits for the next
    forward's activation and each on stage 0 for the gradient, m + 1 crossings in all; a
    transfer of c lengthens the step by (m + 1) c, the bubble by (m + 1) c / (m (F + B))."""
    forward, backward, c = 1.0, 2.0, 0.01
    events = ideal_events(2, 1, m, forward, backward)
    bubble = replay_bubble(events, *transfer_delays(events, c))
    assert bubble == pytest.approx(1 / m + (m + 1) * c / (m * (forward + backward)), rel=1e-9)


@pytest.mark.slow
def test_observed_exchanges_and_compute_replay_the_measured_bubble():
    """On real processes: each step's recorded units and observed exchange times, replayed,
    give the recorded timeline's bubble."""
    runs = run_distributed(pipeline_run, 2, Shape(), (1,), STEPS, WARMUP, (False,))
    ranks = [run[1, False] for run in runs]
    for step in zip(*(rank["events"] for rank in ranks)):
        step = list(step)
        assert replay_bubble(step, observed_delays(step)) == pytest.approx(bubble_fraction(step))


# The benchmark's fixed-cost units: they sleep, so host load shifts the timeline by scheduler
# slices only. Those slices reach 15 ms with the suite's other worker busy on 2 cores (seen in
# CI at 20 ms units), while each stall checked for here lasts a whole backward at least; hence
# units this long, and a limit of half a backward on a unit's wait.
SLEEP_FORWARD_S, SLEEP_BACKWARD_S = 0.05, 0.10
LATE_S = SLEEP_BACKWARD_S / 2


def sleeping_interleaved_run(m: int) -> list[Event]:
    """One interleaved step (v = 2, a stage per process) of sleeping chunks; this stage's
    events."""
    dist.init_process_group("gloo")
    pipe = PipelineGroup.from_ranks(list(range(dist.get_world_size())), None, dist.get_rank())
    spec = ActivationSpec((1, 1, 4), torch.float32, torch.device("cpu"))
    chunks = [
        FixedCostChunk(
            pipe.is_first and c == 0, pipe.is_last and c == 1, SLEEP_FORWARD_S, SLEEP_BACKWARD_S
        )
        for c in range(2)
    ]
    dist.barrier()
    return interleaved_one_f_one_b(chunks, iter([torch.ones(1, 1, 4)] * m), m, pipe, spec).events


def test_interleaved_forward_needing_no_input_does_not_wait_for_a_gradient():
    """Stage 0's warm-up ends by posting the receive of its first gradient, which stage 1
    sends only after its first backward; the next unit, F0.2 (chunk 0 reads the micro-batch),
    must run meanwhile: waiting for the gradient before it is the stall the deferred waits
    remove. Units sleep, so host load shifts the timeline by scheduler slices only."""
    stage0, stage1 = run_distributed(sleeping_interleaved_run, 2, 4)
    units = {(e.kind, e.chunk, e.microbatch): e for e in stage0}
    warmup_end = units["F", 1, 1].end
    first_backward_end = next(e for e in stage1 if e.kind == "B").end
    f02 = units["F", 0, 2]
    assert f02.start - warmup_end < LATE_S, (f02, warmup_end)
    assert f02.start < first_backward_end, (f02, first_backward_end)


@pytest.mark.slow
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_interleaved_units_wait_for_their_inputs_only(p, m):
    """Every unit starts as soon as its stage is free and its input exists (plus a transfer):
    a stage sends a forward's output before running its backward, so no forward waits for the
    sender's backward too, as it would where the pair shared one exchange (stage 0's F1.2
    waited for stage 1's B0.0 at p = 2, m = 4)."""
    stages = run_distributed(sleeping_interleaved_run, p, m)
    late = [
        (stage, e.kind, e.chunk, e.microbatch, round(wait, 3))
        for stage, (events, waits) in enumerate(zip(stages, observed_delays(stages)))
        for e, wait in zip(events, waits)
        if wait > LATE_S
    ]
    assert not late, late
