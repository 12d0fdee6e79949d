"""Pipeline schedules (1F1B, interleaved, forward-only) against the serial model.

A real stack (embedding, 8 TransformerLayers, LayerNorm + LM head + vocab-parallel cross
entropy) is cut into p * v chunks and run over 4 gloo processes: one pipeline of 4 stages, or
two pipelines of 2 side by side. Each rank also runs the whole model serially with gradient
accumulation over the same micro-batches. Both sides run the same ops on the same shapes and
accumulate gradients in the same micro-batch order, so on this CPU they agree to the bit; the
bar is the issue's 1e-6 relative (normalised by the largest magnitude, fp32), which leaves room
for kernels that order a reduction differently when the input is a received leaf tensor.

All cases run in one spawn of 4 processes (a module fixture): starting processes costs more
than the cases themselves.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron.models.embedding import Embedding
from megatron.models.transformer import TransformerLayer
from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.pipeline import (
    ActivationSpec,
    Event,
    PipelineGroup,
    bubble_fraction,
    interleaved_one_f_one_b,
    max_in_flight,
    one_f_one_b,
)
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState
from tests.distributed import run_distributed
from tests.model_config import tiny_model_config
from tests.test_layers import close

VOCAB, PADDED_VOCAB = 250, 256
LAYERS, MICRO_BATCH = 8, 2
WORLD = 4
PIPELINES = {2: [[0, 1], [2, 3]], 4: [[0, 1, 2, 3]]}  # pipeline size -> global ranks, by stage

# (name, pipeline size p, virtual size v, micro-batches m, forward only)
CASES = [
    ("1f1b_p2_m4", 2, 1, 4, False),
    ("1f1b_p4_m4", 4, 1, 4, False),
    ("1f1b_p4_m8", 4, 1, 8, False),
    ("interleaved_p2_v2_m4", 2, 2, 4, False),
    ("interleaved_p4_v2_m4", 4, 2, 4, False),  # m == p: every unit is warm-up
    ("interleaved_p4_v2_m8", 4, 2, 8, False),
    ("forward_only_p4_m4", 4, 1, 4, True),
    ("forward_only_p2_v2_m4", 2, 2, 4, True),
]


class LMHead(nn.Module):
    """Final LayerNorm, an untied output matrix, and the mean token loss."""

    def __init__(self, cfg, device: torch.device):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=device)
        self.out = nn.Linear(cfg.hidden_size, PADDED_VOCAB, bias=False, device=device)
        nn.init.normal_(self.out.weight, std=cfg.init_method_std)

    def forward(self, hidden: Tensor, labels: Tensor) -> Tensor:
        logits = self.out(self.ln(hidden))  # [b, s, padded_vocab]
        return vocab_parallel_cross_entropy(logits, labels, VOCAB, None).mean()


class Piece(nn.Module):
    """A run of named parts of the model (``embedding``, ``layer_<i>``, ``head``) as one chunk,
    called as the schedules call chunks: ``piece(hidden, (tokens, labels))``."""

    def __init__(self, parts: dict[str, nn.Module]):
        super().__init__()
        self.parts = nn.ModuleDict(parts)

    def forward(self, hidden: Tensor | None, batch: tuple[Tensor, Tensor]) -> Tensor:
        tokens, labels = batch
        for name, part in self.parts.items():
            if name == "embedding":
                hidden = part(tokens)  # [b, s, h]
            elif name == "head":
                return part(hidden, labels)
            else:
                hidden = part(hidden, None)  # causal attention
        return hidden


def serial_model() -> Piece:
    """The whole model, with the same weights on every rank (one seed, one process each)."""
    cfg = tiny_model_config(num_layers=LAYERS)
    state = ParallelState.serial(torch.device("cpu"))
    tracker = RNGTracker(state.device)
    tracker.seed(1234, 0)
    parts: dict[str, nn.Module] = {"embedding": Embedding(cfg, VOCAB, PADDED_VOCAB, state, tracker)}
    for i in range(LAYERS):
        parts[f"layer_{i}"] = TransformerLayer(cfg, state, tracker, i)
    parts["head"] = LMHead(cfg, state.device)
    return Piece(parts)


def microbatches(m: int) -> list[tuple[Tensor, Tensor]]:
    seq = tiny_model_config().seq_length
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (m, MICRO_BATCH, seq + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def chunk_of(model: Piece, virtual_stage: int, num_virtual: int) -> Piece:
    """Virtual stage j of ``num_virtual``: its layers, plus the embedding (first) or head (last)."""
    per_chunk = LAYERS // num_virtual
    first = virtual_stage * per_chunk
    names = [f"layer_{i}" for i in range(first, first + per_chunk)]
    if virtual_stage == 0:
        names.insert(0, "embedding")
    if virtual_stage == num_virtual - 1:
        names.append("head")
    return Piece({name: model.parts[name] for name in names})


def _run_case(p: int, v: int, m: int, forward_only: bool, groups: dict) -> dict:
    rank = dist.get_rank()
    ranks = PIPELINES[p][rank // p]  # this rank's pipeline
    pipe = PipelineGroup.from_ranks(ranks, groups[tuple(ranks)], rank)

    model = serial_model()
    pipelined = copy.deepcopy(model)  # same weights, no gradients yet
    batches = microbatches(m)
    ref_losses = []
    for batch in batches:  # gradient accumulation, the reference for the schedule
        loss = model(None, batch)
        ref_losses.append(loss.detach())
        (loss / m).backward()

    chunks = [chunk_of(pipelined, c * p + pipe.rank, p * v) for c in range(v)]
    cfg = tiny_model_config()
    shape = (MICRO_BATCH, cfg.seq_length, cfg.hidden_size)  # [micro_batch, seq, hidden]
    spec = ActivationSpec(shape, torch.float32, torch.device("cpu"))
    schedule = one_f_one_b if v == 1 else interleaved_one_f_one_b
    result = schedule(
        chunks[0] if v == 1 else chunks,
        iter(batches),
        m,
        pipe,
        spec,
        scale_loss=lambda loss: loss / m,
        forward_only=forward_only,
    )
    ref_grads = dict(model.named_parameters())
    grads = {
        name: (param.grad, ref_grads[name].grad)
        for chunk in chunks
        for name, param in chunk.named_parameters()
    }
    return dict(
        stage=pipe.rank,
        losses=result.losses,
        ref_losses=ref_losses,
        grads=grads,
        events=result.events,
    )


def _run_all(cases: list) -> dict:
    dist.init_process_group("gloo")
    # Every rank creates every group, in the same order.
    groups = {}
    for layout in PIPELINES.values():
        for ranks in layout:
            groups[tuple(ranks)] = dist.new_group(ranks)
    return {name: _run_case(p, v, m, fwd, groups) for name, p, v, m, fwd in cases}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run_all, WORLD, CASES)


def _case(name: str) -> tuple[int, int, int, bool]:
    return next(case[1:] for case in CASES if case[0] == name)


def _check_losses(name: str, results: list[dict]) -> None:
    p, _, m, _ = _case(name)
    for out in results:
        case = out[name]
        if case["stage"] == p - 1:
            assert len(case["losses"]) == m
            close(torch.stack(case["losses"]), torch.stack(case["ref_losses"]), 1e-6)
        else:
            assert case["losses"] == []


def _check_events(name: str, results: list[dict]) -> None:
    """Every micro-batch runs once forward and once backward through every chunk, backward
    after forward, in micro-batch order per chunk."""
    _, v, m, _ = _case(name)
    for out in results:
        events = out[name]["events"]
        for kind in "FB":
            for chunk in range(v):
                order = [e.microbatch for e in events if e.kind == kind and e.chunk == chunk]
                assert order == list(range(m)), (kind, chunk, order)
        ends = {(e.chunk, e.microbatch): e.end for e in events if e.kind == "F"}
        assert all(e.start >= ends[e.chunk, e.microbatch] for e in events if e.kind == "B")


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in CASES if not c[4]])
def test_schedule_matches_serial(name, results):
    _check_losses(name, results)
    _check_events(name, results)
    for out in results:
        grads = out[name]["grads"]
        assert grads, "every stage holds parameters"
        for param_name, (grad, ref) in grads.items():
            assert grad is not None, param_name
            close(grad, ref, 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1f1b_p2_m4", "1f1b_p4_m4", "1f1b_p4_m8"])
def test_1f1b_in_flight_bound(name, results):
    """Stage s of p holds exactly min(p - s, m) micro-batches at its peak: at most p - s, and
    no fewer (fewer would mean a stage waits on a backward it could have overlapped)."""
    p, _, m, _ = _case(name)
    for out in results:
        stage = out[name]["stage"]
        assert max_in_flight(out[name]["events"]) == min(p - stage, m), stage


@pytest.mark.slow
@pytest.mark.parametrize("name", ["interleaved_p2_v2_m4", "interleaved_p4_v2_m8"])
def test_interleaved_in_flight_bound(name, results):
    """Stage s holds at most (p - s - 1) * 2 + (v - 1) * p + 1 micro-batch chunks."""
    p, v, m, _ = _case(name)
    for out in results:
        stage = out[name]["stage"]
        bound = min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
        assert max_in_flight(out[name]["events"]) == bound, stage


@pytest.mark.slow
@pytest.mark.parametrize("name", ["forward_only_p4_m4", "forward_only_p2_v2_m4"])
def test_forward_only(name, results):
    """Evaluation: the last stage's losses equal the serial ones; nothing runs backward and no
    gradient appears."""
    _check_losses(name, results)
    for out in results:
        case = out[name]
        assert all(e.kind == "F" for e in case["events"])
        assert all(grad is None for grad, _ in case["grads"].values())


# 1F1B for p = 3, m = 4 with one tick per forward or backward, as the schedules docstring draws
# it: three characters per tick.
IDEAL_1F1B = [
    "F0 F1 F2       B0 F3 B1    B2    B3",
    "   F0 F1    B0 F2 B1 F3 B2    B3",
    "      F0 B0 F1 B1 F2 B2 F3 B3",
]


def test_bubble_of_the_ideal_1f1b_timeline():
    """The drawn timeline idles (p - 1) / m of its busy time and keeps p - s in flight."""
    stages = [
        [
            Event(row[col], 0, int(row[col + 1]), col // 3, col // 3 + 1)
            for col in range(0, len(row), 3)
            if row[col] != " "
        ]
        for row in IDEAL_1F1B
    ]
    assert bubble_fraction(stages) == (3 - 1) / 4
    assert [max_in_flight(events) for events in stages] == [3, 2, 1]


def test_interleaved_needs_a_multiple_of_the_pipeline_size():
    pipe = PipelineGroup(None, 0, 2, 1, 1)
    spec = ActivationSpec((1, 1, 1), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="not a multiple of the pipeline size 2"):
        interleaved_one_f_one_b([nn.Identity(), nn.Identity()], iter([]), 3, pipe, spec)
