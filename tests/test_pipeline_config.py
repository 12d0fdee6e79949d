"""Pipeline parallelism before any process starts: the config's checks, the estimate per stage
and the dry run (issue 14).

The estimate of a small 2-stage config (1F1B and interleaved) is compared with a hand computation,
term by term; the schedule order the estimate replays (megatron/parallel/pipeline/timeline.py) is
compared with the events of the real schedules run over 4 gloo processes; bad pipeline sizes stop
the real entrypoint with one line and exit 2 before any process group exists; and the shipped 39B
config's dry run at TP 8 x PP 2 prints each stage's memory and the bubble.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron.config.load import load_config, parse_args
from megatron.config.schema import padded_vocab_size
from megatron.estimate.memory import GIB, estimate_stages, worst_stage
from megatron.estimate.parameters import stage_parameters
from megatron.launch.dry_run import dry_run
from megatron.parallel.pipeline import (
    ActivationSpec,
    PipelineGroup,
    interleaved_one_f_one_b,
    one_f_one_b,
)
from megatron.parallel.pipeline.timeline import ideal_bubble, in_flight, schedule_units
from tests.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# L 4, h 64, a 4, f 256, s = P = 32, b 2, bf16, TP 2 x PP 2 at world 4 (DP 1): m = 8 / 2 = 4.
SMALL = [
    "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4",
    "model.ffn_hidden_size=256", "model.seq_length=32", "model.max_position_embeddings=32",
    "precision.dtype=bf16", "parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2",
    "training.micro_batch_size=2", "training.global_batch_size=8",
]  # fmt: skip
VOCAB = 250  # padded to 256 at TP 2


def _small(*overrides: str):
    return load_config([os.path.join(ROOT, "configs", "gpt_tiny.yaml")], [*SMALL, *overrides])


# Hand computation for SMALL (h 64, f 256, V/t 128, t 2, e 2, s*b 64, s*b*h 4096):
LAYER_SPLIT = (3 * 64 * 64 + 3 * 64) + 64 * 64 + (256 * 64 + 256) + 64 * 256  # qkv, dense, fc1, fc2
LAYER_REPLICATED = 6 * 64  # two biases, two LayerNorms
WORD, POSITION, FINAL_LN = 256 * 64, 32 * 64, 2 * 64
STAGE0_PARAMS = (2 * LAYER_SPLIT + WORD) // 2 + 2 * LAYER_REPLICATED + POSITION
STAGE1_PARAMS = (2 * LAYER_SPLIT + WORD) // 2 + 2 * LAYER_REPLICATED + FINAL_LN  # its head copy
# One layer: s*b*h*(4e + 2 masks) + 16*s*b + [s*b*(4h + 2f)*e + 4*a*s*b] / t
LAYER = 4096 * 10 + 16 * 64 + (64 * (4 * 64 + 2 * 256) * 2 + 4 * 4 * 64) // 2
LAYER_INPUT = OUTPUT = 2 * 4096  # e*s*b*h: a layer input, a chunk's output
EMBEDDING_SIDE = 4096  # the embedding dropout mask
HEAD_SIDE = (2 * 4096 + 8 * 64) + 2 * 4096  # final LayerNorm input and statistics, LM head input
LOGITS = (2 + 4) * 64 * 128  # (e + 4) * b*s * V/t
EMBEDDING_GRAD = 2 * 128 * 64  # e * V/t * h


def test_small_1f1b_estimate_by_hand():
    """p = 2, m = 4: stage 0 holds min(2, 4) = 2 micro-batches, stage 1 one."""
    cfg = _small()
    padded = padded_vocab_size(VOCAB, 128, 2)
    counts = [stage_parameters(cfg.model, padded, 2, 2, s).per_gpu for s in (0, 1)]
    assert counts == [STAGE0_PARAMS, STAGE1_PARAMS]
    first, last = estimate_stages(cfg, padded, "gpt", dp_size=1)
    assert (first.in_flight, last.in_flight) == (2, 1)
    assert first.states == 18 * STAGE0_PARAMS and last.states == 18 * STAGE1_PARAMS
    assert first.activations_no_recompute == 2 * (2 * LAYER + EMBEDDING_SIDE + OUTPUT)
    assert last.activations_no_recompute == 2 * LAYER + HEAD_SIDE
    assert first.activations_recompute == 2 * (2 * LAYER_INPUT + EMBEDDING_SIDE + OUTPUT) + LAYER
    assert last.activations_recompute == 2 * LAYER_INPUT + HEAD_SIDE + LAYER
    assert (first.logits, last.logits) == (0, LOGITS)
    assert first.embedding_grad == last.embedding_grad == EMBEDDING_GRAD
    assert first.total == 18 * STAGE0_PARAMS + EMBEDDING_GRAD + 2 * (
        2 * LAYER + EMBEDDING_SIDE + OUTPUT
    )
    assert worst_stage(cfg, padded, "gpt", 1) == first
    # Fewer micro-batches than stages: stage 0 holds them all, m = 1 (gbs 2).
    one = estimate_stages(_small("training.global_batch_size=2"), padded, "gpt", 1)
    assert [stage.in_flight for stage in one] == [1, 1]


def test_small_interleaved_estimate_by_hand():
    """p = 2, v = 2, m = 4, one layer per chunk. Stage 0 runs F0 F0 F1 F1 (warm-up: 2(p-1) +
    (v-1)p = 4 units), then F0 B1 F0 B1 F1 B0 F1 B0, then B1 B1 B0 B0: at most 5 chunks held,
    4 of chunk 0 (which also holds the embedding's mask) and 1 of chunk 1 after the second
    steady forward. Stage 1 (warm-up 2: F0 F0, then F1 B1 ...) holds 2 of chunk 0 and 1 of its
    last chunk, the one with the head."""
    cfg = _small("parallel.virtual_pipeline_size=2")
    padded = padded_vocab_size(VOCAB, 128, 2)
    first, last = estimate_stages(cfg, padded, "gpt", dp_size=1)
    assert (first.in_flight, last.in_flight) == (5, 3)
    chunk0, chunk1 = LAYER + EMBEDDING_SIDE + OUTPUT, LAYER + OUTPUT
    assert first.activations_no_recompute == 4 * chunk0 + chunk1
    assert last.activations_no_recompute == 2 * (LAYER + OUTPUT) + LAYER + HEAD_SIDE
    assert first.states == 18 * STAGE0_PARAMS and last.states == 18 * STAGE1_PARAMS
    assert ideal_bubble(2, 2, 4) == 1 / 8


def test_in_flight_closed_forms():
    """The replayed order gives min(p - s, m) (1F1B) and Megatron's interleaved count."""
    for p in (2, 3, 4, 8):
        for s in range(p):
            for m in (1, 2, 3, p, 2 * p + 1):
                assert in_flight(p, 1, m, s) == min(p - s, m), (p, s, m)
            for v in (2, 3):
                for m in (p, 2 * p, 3 * p):
                    want = m * v if m == p else min(2 * (p - s - 1) + (v - 1) * p + 1, m * v)
                    assert in_flight(p, v, m, s) == want, (p, v, s, m)
    # The first stage of an interleaved pipeline: p * (1 + (p - 1)/(p*v)) stages' worth.
    p, v = 4, 2
    assert in_flight(p, v, 8, 0) / v == p * (1 + (p - 1) / (p * v))


class _Chunk(nn.Module):
    """A linear map; the pipeline's first chunk reads the micro-batch, its last returns a loss."""

    def __init__(self, last: bool):
        super().__init__()
        self.linear, self.last = nn.Linear(4, 4), last

    def forward(self, hidden: Tensor | None, batch: Tensor) -> Tensor:
        out = self.linear(batch if hidden is None else hidden)
        return out.sum() if self.last else out


# (pipeline size, chunks per stage, micro-batches) on 2 ranks: 1F1B with m < p and m > p,
# interleaved with m == p (all warm-up), m > p and v = 3. (tests/test_pipeline_schedule.py runs
# the 4-stage cases, and checks their in-flight bounds against the same formulas.)
ORDER_CASES = [(2, 1, 1), (2, 1, 3), (2, 2, 2), (2, 2, 6), (2, 3, 4)]


def _real_orders(cases: list) -> list[list]:
    dist.init_process_group("gloo")
    pipe = PipelineGroup.from_ranks([0, 1], dist.group.WORLD, dist.get_rank())
    orders = []
    for _, v, m in cases:  # p = 2
        chunks = [_Chunk(pipe.is_last and c == v - 1) for c in range(v)]
        spec = ActivationSpec((2, 4), torch.float32, torch.device("cpu"))
        batches = iter([torch.randn(2, 4) for _ in range(m)])
        if v == 1:
            result = one_f_one_b(chunks[0], batches, m, pipe, spec)
        else:
            result = interleaved_one_f_one_b(chunks, batches, m, pipe, spec)
        orders.append((pipe.rank, [(e.kind, e.chunk) for e in result.events]))
    return orders


@pytest.mark.slow
def test_the_replayed_order_is_the_real_schedules():
    """The order the estimate replays is the order megatron/parallel/pipeline runs units in."""
    for per_case in run_distributed(_real_orders, 2, ORDER_CASES):
        for (p, v, m), (stage, events) in zip(ORDER_CASES, per_case, strict=True):
            assert events == schedule_units(p, v, m, stage), (p, v, m, stage)


def test_a_world_that_tp_x_pp_does_not_divide_stops_the_entrypoint():
    """Launched as rank 0 of 4 with no peers and no rendezvous address: the line comes from
    validate, before any process group (which would wait for the absent peers). The other
    pipeline lines: tests/test_config.py::test_documented_errors."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "pretrain_gpt.py", "--config", "configs/gpt_tiny.yaml"]
    argv.append("parallel.pipeline_parallel_size=4")
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr == (
        "error: parallel.tensor_parallel_size=2 x parallel.pipeline_parallel_size=4 = 8 does not "
        "divide the world size 4; launch a multiple of 8 GPUs or use a pipeline size of 1 or 2\n"
    )


def test_39b_dry_run_at_tp8_pp2():
    """configs/gpt_39b.yaml on 16 GPUs (one replica): 39.1B parameters, both stages' memory,
    the first stage (two micro-batches in flight, the embeddings) the worst, the bubble of
    1536 micro-batches, and a fit in 80 GB."""
    cfg, args = parse_args(
        ["--config", "configs/gpt_39b.yaml", "--dry-run", "--world-size", "16",
         "--gpu-memory-gb", "80"]
    )  # fmt: skip
    m, p = cfg.model, cfg.parallel
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (
        48,
        8192,
        64,
        2048,
    )
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, cfg.tokenizer.type) == (8, 2, "gpt2")
    derived = cfg.derived(16)
    assert (derived.dp_size, derived.pp_size, derived.num_micro_batches) == (1, 2, 1536)
    out = io.StringIO()
    assert dry_run(cfg, args, out=out) == 0
    text = out.getvalue()
    padded = derived.padded_vocab_size(50257)
    stages = estimate_stages(cfg, padded, "gpt", 1)
    assert "world 16 = DP 1 x PP 2 x TP 8" in text
    assert "bubble (p-1)/(m*v) = 1/(1536*1) = 0.07% of the busy time" in text
    for stage, layers in zip(stages, ("0-23   <- worst", "24-47\n"), strict=True):
        assert f"{stage.total / GIB:10.2f}  {layers}" in text
    assert [stage.in_flight for stage in stages] == [2, 1]
    assert "parameters: 39,096,041,472 total" in text and "on stage 0 (the worst)" in text
    assert f"fits in 80 GB: yes ({stages[0].total / GIB:.2f} GiB" in text
