"""Pipeline parallelism: p2p between neighbouring stages (``p2p``), the 1F1B schedule
(``schedules``) and its interleaved form for virtual pipelines (``interleaved``)."""

from megatron.parallel.pipeline.interleaved import interleaved_one_f_one_b
from megatron.parallel.pipeline.p2p import ActivationSpec, PipelineGroup
from megatron.parallel.pipeline.schedules import (
    Event,
    ScheduleResult,
    bubble_fraction,
    max_in_flight,
    one_f_one_b,
)

__all__ = [
    "ActivationSpec",
    "Event",
    "PipelineGroup",
    "ScheduleResult",
    "bubble_fraction",
    "interleaved_one_f_one_b",
    "max_in_flight",
    "one_f_one_b",
]
