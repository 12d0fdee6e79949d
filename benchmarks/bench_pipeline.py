"""Iteration time of PP=2 against PP=1 at equal global batch, and the measured pipeline bubble
against (p - 1) / (m * v) plus communication, on CPU.

The model is a stack of identical pre-LN TransformerLayers (hidden 256, seq 128, micro-batch 4,
fp32, no dropout), so every stage costs the same: the first chunk reads its input activation
from the micro-batch (no embedding) and the last ends in a mean-square loss (no LM head), both
negligible next to a layer. One iteration is the step's m micro-batches forward and backward,
then AdamW: PP=1 accumulates them on one process; PP=2 runs 1F1B (or interleaved 1F1B, v = 2)
on two processes. Every process has one thread: PP=2 uses two cores where PP=1 uses one, so
the ideal time ratio PP=2 / PP=1 is (1 + bubble) / 2.

Each schedule runs twice: with the real layers, and with ``FixedCostChunk`` stand-ins that
sleep for the real chunk's median unit times. The second is the run with equal stage costs
that the formula describes: on a shared 2-core host real units vary by 5-15 %, and each steady
tick waits for the slower stage, while the communication threads, with no core of their own,
can wait a scheduler tick for one. The ``checks`` judge the fixed-cost runs; the real-layer
figures show what the host adds.

How the bubble is accounted (per step; the median over the timed steps is reported):

    measured   ``bubble_fraction`` of the schedule's recorded events: the stages' idle time in
               the step's span over their compute time
    formula    (p - 1) / (m * v)
    comm       what the transfers on the critical path add: the schedule's unit order replayed
               (``replay_bubble``) with every forward (backward) at the median measured
               duration, equal stages as the formula assumes, and ``transfer_ms`` for each
               crossing (``transfer_delays``: after a unit that sent its result, and between a
               unit and the unit on another stage that reads it), minus the formula (which
               the same replay gives with free transfers). ``transfer_ms`` is what one steady
               exchange costs, measured apart from the schedules: both stages post an
               activation to each other at once and wait for the other's. With two stages
               1F1B has m + 1 crossings on its critical path
    expected   formula + comm; ``over_expected`` is measured / expected - 1
    comm_observed  the same replay with each unit's exchange time read off the timeline
               instead (its start minus the moment both its stage was free and its input was
               produced; with the recorded durations these replay the timeline exactly). Much
               more than comm means the stages wait in exchanges for more than their input's
               transfer: host scheduling on a loaded machine, or a schedule that waits for a
               tensor its next unit does not need
    exchange_ms  the median of those exchange times
    replayed   the replay with each unit's own recorded duration and ``transfer_ms``: what the
               compute times (stage imbalance and host noise included) and the wire explain;
               measured - replayed is time the schedule spends waiting beyond both

Prints one JSON line. Note the machine's load with the result: on 2 shared cores a busy
neighbour time-slices one stage and inflates the bubble.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_pipeline.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.pipeline_replay import observed_delays, uniform  # noqa: E402
from megatron.config.model import ModelConfig  # noqa: E402
from megatron.models.transformer import TransformerLayer  # noqa: E402
from megatron.parallel.pipeline import (  # noqa: E402
    ActivationSpec,
    Event,
    PipelineGroup,
    bubble_fraction,
    interleaved_one_f_one_b,
    one_f_one_b,
)
from megatron.parallel.pipeline.p2p import start_exchange  # noqa: E402
from megatron.parallel.pipeline.replay import replay_bubble, transfer_delays  # noqa: E402
from megatron.parallel.pipeline.timeline import ideal_bubble  # noqa: E402
from megatron.parallel.random import RNGTracker  # noqa: E402
from megatron.parallel.state import ParallelState  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """The benchmarked model and step: ``layers`` identical layers, ``micro_batches`` per step."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    seq: int = 128
    micro_batch: int = 4
    micro_batches: int = 4

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            num_layers=self.layers,
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            ffn_hidden_size=4 * self.hidden,
            seq_length=self.seq,
            max_position_embeddings=self.seq,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )

    @property
    def activation(self) -> tuple[int, int, int]:
        return (self.micro_batch, self.seq, self.hidden)  # [micro_batch, seq, hidden]


class LayerChunk(nn.Module):
    """A run of layers as the schedules call a chunk: ``chunk(hidden, batch)``. The pipeline's
    first chunk reads its input from the micro-batch (an activation), its last returns the mean
    square of its output as the loss."""

    def __init__(self, layers: list[nn.Module], first: bool, last: bool):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first, self.last = first, last

    def forward(self, hidden: Tensor | None, batch: Tensor) -> Tensor:
        x = batch if self.first else hidden  # [b, s, h]
        for layer in self.layers:
            x = layer(x, None)  # causal attention
        return x.square().mean() if self.last else x


def build_layers(shape: Shape) -> list[nn.Module]:
    """Every layer of the model, each from its own stream (the same weights in any process)."""
    cfg = shape.model_config()
    state = ParallelState.serial(torch.device("cpu"))
    tracker = RNGTracker(state.device)
    tracker.seed(1234, 0)
    return [TransformerLayer(cfg, state, tracker, i) for i in range(shape.layers)]


def stage_chunks(shape: Shape, p: int, v: int, stage: int) -> list[LayerChunk]:
    """Stage ``stage``'s v chunks: chunk c is virtual stage c * p + stage of p * v."""
    layers = build_layers(shape)
    per_chunk = shape.layers // (p * v)
    chunks = []
    for c in range(v):
        j = c * p + stage
        held = layers[j * per_chunk : (j + 1) * per_chunk]
        chunks.append(LayerChunk(held, first=j == 0, last=j == p * v - 1))
    return chunks


class _Hold(torch.autograd.Function):
    """Identity whose forward and backward each hold the calling thread for a fixed time,
    sleeping: the core stays free for the communication threads."""

    @staticmethod
    def forward(ctx, x: Tensor, forward_s: float, backward_s: float) -> Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class FixedCostChunk(nn.Module):
    """A stand-in for a chunk of layers whose every forward and backward take the same fixed
    time on every stage, as the formula assumes: it sleeps for the real chunk's measured unit
    times and passes its input on (through a scalar weight, so the chunk has a gradient).

    Real layers on this host vary by 5-15 % per unit, which lengthens the critical path (each
    steady tick waits for the slower stage), and leave the communication threads no core of
    their own, so a transfer can wait a scheduler tick (3-8 ms) for one. Sleeping units remove
    both, as a GPU does the second (transfers run on their own engine), and leave the schedule
    and the transfers themselves."""

    def __init__(self, first: bool, last: bool, forward_s: float, backward_s: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.first, self.last = first, last
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, hidden: Tensor | None, batch: Tensor) -> Tensor:
        x = (batch if self.first else hidden) * self.weight
        x = _Hold.apply(x, self.forward_s, self.backward_s)
        return x.square().mean() if self.last else x


def unit_budgets(chunks: list[LayerChunk], shape: Shape, trials: int = 6) -> tuple[float, float]:
    """Forward and backward times for ``FixedCostChunk``: the slowest stage's median unit
    (all-reduced over the pipeline, so every stage gets the same)."""
    forwards, backwards = [], []
    for trial in range(trials + 2):  # two untimed first: allocation and caches
        for chunk in chunks:
            x = torch.randn(shape.activation, requires_grad=True)
            start = time.perf_counter()
            y = chunk(x, x)
            middle = time.perf_counter()
            y.backward(torch.ones_like(y))
            if trial >= 2:
                forwards.append(middle - start)
                backwards.append(time.perf_counter() - middle)
    medians = torch.tensor([statistics.median(forwards), statistics.median(backwards)])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return float(medians[0]), float(medians[1])


def microbatches(shape: Shape, step: int) -> list[Tensor]:
    """The step's input activations, the same on every process."""
    g = torch.Generator().manual_seed(step)
    return list(torch.randn((shape.micro_batches, *shape.activation), generator=g))


def serial_step_times(shape: Shape, steps: int, warmup: int) -> list[float]:
    """PP=1: seconds per iteration (m micro-batches accumulated, AdamW) in this process."""
    model = LayerChunk(build_layers(shape), first=True, last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    m = shape.micro_batches
    times = []
    for step in range(warmup + steps):
        batches = microbatches(shape, step)
        start = time.perf_counter()
        for batch in batches:
            (model(None, batch) / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times[warmup:]


def transfer_seconds(pipe: PipelineGroup, spec: ActivationSpec, ticks: int = 24) -> float:
    """What one exchange costs a stage in the steady state: both stages, in step, post an
    activation to each other (as every steady tick does), through the schedules' own exchange
    with its deferred waits, and wait for the other's; the median time from posting to
    arrival. Each tick first sleeps for a while, as a stage computes, so the exchange starts
    with the peer's threads idle."""
    x = torch.randn(spec.shape)
    times = []
    for _ in range(ticks + 2):  # the first two set up the connection's buffers
        dist.barrier(group=pipe.group)
        time.sleep(0.005)
        start = time.perf_counter()
        pending = start_exchange(pipe, spec, send_next=x, recv_prev=True)
        pending.activation()
        times.append(time.perf_counter() - start)
        pending.wait_sends()
    return statistics.median(times[2:])


def core_share(seconds: float = 0.3) -> float:
    """The share of a core this process gets while computing (process CPU time over wall time
    of a busy loop): near 1 where every stage has a core to itself, less where other processes
    time-slice it, which stretches and shifts the stages' units and so distorts the bubble."""
    x = torch.randn(128, 128)
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        x = torch.tanh(x @ x)
    return (time.process_time() - cpu) / (time.perf_counter() - wall)


def pipeline_run(
    shape: Shape,
    schedules: tuple[int, ...],
    steps: int,
    warmup: int,
    fixed_costs: tuple[bool, ...] = (False, True),
) -> dict:
    """One process of PP=2 runs (gloo initialised here), for each v in ``schedules`` (1: 1F1B,
    else interleaved) with the layers as they are (fixed False) and as ``FixedCostChunk``
    (True), as ``fixed_costs`` asks: per timed step, this stage's events and its iteration
    seconds (from a barrier to the end of its AdamW step), the measured transfer time, core
    share and unit budgets; keyed by (v, fixed)."""
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    pipe = PipelineGroup.from_ranks(list(range(p)), None, rank)
    spec = ActivationSpec(shape.activation, torch.float32, torch.device("cpu"))
    transfer = transfer_seconds(pipe, spec)
    dist.barrier()  # both stages compute at once, as in the steady state
    share = core_share()
    m = shape.micro_batches
    runs = {}
    for v in schedules:
        layer_chunks = stage_chunks(shape, p, v, rank)
        budgets = unit_budgets(layer_chunks, shape) if True in fixed_costs else None
        for fixed in fixed_costs:
            chunks = layer_chunks
            if fixed:
                chunks = [FixedCostChunk(c.first, c.last, *budgets) for c in layer_chunks]
            params = [param for chunk in chunks for param in chunk.parameters()]
            opt = torch.optim.AdamW(params, lr=1e-4)
            events, times = [], []
            for step in range(warmup + steps):
                batches: Iterator[Tensor] = iter(microbatches(shape, step))
                dist.barrier()  # both stages start the step together
                start = time.perf_counter()
                if v == 1:
                    result = one_f_one_b(chunks[0], batches, m, pipe, spec, lambda loss: loss / m)
                else:
                    result = interleaved_one_f_one_b(
                        chunks, batches, m, pipe, spec, lambda loss: loss / m
                    )
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step >= warmup:
                    times.append(time.perf_counter() - start)
                    events.append(result.events)
            runs[v, fixed] = {
                "events": events,
                "times": times,
                "transfer": transfer,
                "core_share": share,
                "budgets": budgets if fixed else None,
            }
    return runs


def bubble_report(ranks: list[dict], m: int, v: int) -> dict:
    """The bubble figures of one PP run (see the module docstring), medians over its steps."""
    p = len(ranks)
    transfer = statistics.median(r["transfer"] for r in ranks)
    steps = [list(stages) for stages in zip(*(r["events"] for r in ranks))]
    formula = ideal_bubble(p, v, m)

    def median_over_steps(bubble: Callable[[list[list[Event]]], float]) -> float:
        return statistics.median(bubble(step) for step in steps)

    def unit_ms(kind: str) -> float:
        units = [e for step in steps for stage in step for e in stage if e.kind == kind]
        return 1e3 * statistics.median(e.end - e.start for e in units)

    comm = median_over_steps(
        lambda st: replay_bubble(uniform(st), *transfer_delays(st, transfer)) - formula
    )
    observed = median_over_steps(
        lambda st: replay_bubble(uniform(st), observed_delays(st)) - formula
    )
    measured = median_over_steps(bubble_fraction)
    report = {
        "measured": measured,
        "formula": formula,
        "comm": comm,
        "expected": formula + comm,
        "over_expected": measured / (formula + comm) - 1,
        "comm_observed": observed,
        "replayed": median_over_steps(lambda st: replay_bubble(st, *transfer_delays(st, transfer))),
        "exchange_ms": 1e3
        * statistics.median(d for step in steps for stage in observed_delays(step) for d in stage),
        "transfer_ms": 1e3 * transfer,
        "core_share": min(r["core_share"] for r in ranks),
        "forward_ms": unit_ms("F"),
        "backward_ms": unit_ms("B"),
    }
    budgets = ranks[0]["budgets"]
    if budgets is not None:
        report["budget_ms"] = [1e3 * b for b in budgets]
    return report


def iteration_seconds(ranks: list[dict]) -> float:
    """The median over steps of the slowest stage's iteration time."""
    return statistics.median(max(step) for step in zip(*(r["times"] for r in ranks)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed iterations per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = Shape()
    load_before = os.getloadavg()

    pp1 = statistics.median(serial_step_times(shape, args.steps, args.warmup))
    result: dict = {"pp1_ms": round(1e3 * pp1, 1)}
    names = {1: "pp2", 2: "pp2_interleaved"}
    runs = run_distributed(pipeline_run, 2, shape, tuple(names), args.steps, args.warmup)
    checks = {}
    for v, name in names.items():
        ranks = [run[v, False] for run in runs]
        seconds = iteration_seconds(ranks)
        bubble = bubble_report(ranks, shape.micro_batches, v)
        result[f"{name}_ms"] = round(1e3 * seconds, 1)
        result[f"{name}_over_pp1"] = round(seconds / pp1, 3)
        result[f"{name}_ideal_over_pp1"] = round((1 + bubble["formula"]) / 2, 3)
        result[f"{name}_bubble"] = {k: round(x, 4) for k, x in bubble.items()}
        fixed = bubble_report([run[v, True] for run in runs], shape.micro_batches, v)
        result[f"{name}_fixed_cost_bubble"] = {
            k: [round(x, 2) for x in y] if isinstance(y, list) else round(y, 4)
            for k, y in fixed.items()
        }
        checks[f"{name}_fixed_cost_bubble_within_10pct"] = abs(fixed["over_expected"]) <= 0.10
    result["checks"] = checks
    result["shape"] = asdict(shape)
    result["threads_per_process"] = 1
    result["loadavg_before"] = [round(x, 2) for x in load_before]
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
