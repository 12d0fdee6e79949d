"""Measure what context parallelism saves in activations, against the estimate, and its step time.

Real processes on CPU (gloo, one thread each; tests/distributed.py), the gpt_tiny shapes (4
layers, hidden 256, 4 heads) at seq 512, micro-batch 2, a vocabulary of 1000, TP 1, bf16 as in
mixed-precision training, dropout off (ring attention has none, and the config checks refuse
attention dropout with CP). Every CP size sees the same global tokens: the same b samples of s
tokens, each rank its two of the 2*CP chunks (``split_sequence``, the cut ``split_batch`` makes
in training), positions global.

- **Activations**, CP 1, 2 and 4: one forward of the model built as training builds it (on
  ``initialize(1, 10.0, 1, cp)``'s state) to the logits, without the loss, whose buffers the
  estimate lists apart, under ``torch.autograd.graph.saved_tensors_hooks``: the bytes of the
  distinct storages saved for backward, parameters excluded, each charged to the transformer
  layer in whose forward it is first saved (benchmarks/bench_memory.py's count: several saved
  tensors alias one allocation, and a view keeps its whole storage alive). Checks (the CP
  ranks hold the same bytes, checked too): layer 1's bytes against
  ``layer_activation_bytes(..., context_parallel=cp)`` within 5%; the whole model's against
  the dry run's (``worst_stage``) "activations, no recomputation" within 5%; and the measured
  ratios CP2/CP1 and CP4/CP1 against the estimate's (1/2, 1/4: every term counts the rank's
  s/c tokens), within 5%.

  What CPU saves against what the estimate assumes. At CP 1 attention is
  ``scaled_dot_product_attention``; without dropout and with the causal flag PyTorch's CPU runs
  its flash kernel, which saves what the estimate's "fused" count assumes: q, k, v (views of
  QKV's output), its output laid out [b, s, a, d] (so the dense layer's input is a view of it)
  and an fp32 log-sum-exp [b, a, s]; no probabilities. With dropout CPU would take the math
  path and materialise them, which is why bench_memory turns dropout off, and so does this
  benchmark. At CP > 1 the ring attention Function (megatron/parallel/context_parallel.py)
  saves q, k, v, its output [b, a, s/c, d] (laid out [b, s/c, a, d] in memory, as the flash
  kernel's, so the dense layer's input is a view of it) and an fp32 lse [b, a, s/c]. The
  differences, checked to the byte
  (``excess_as_expected``): PyTorch's CPU LayerNorm saves its mean and rstd in bf16 where
  CUDA's (and the estimate's) are fp32, 4 bytes fewer per token per LayerNorm (8 per layer, 4
  for the final one); and the model keeps the int64 token and position ids its embeddings
  index with (16 bytes per token), which the estimate leaves out. Both count the rank's s/c
  tokens, so the ratios are unaffected.
  The ring's transient buffers (``ring_attention_bytes``: K/V messages, dK/dV accumulators,
  one fused-kernel pair's buffers) are not saved tensors and are not measured here; their
  figure is printed, and measured by the attention figures below.

- **Step time**, CP 1 against CP 2: real training steps (forward with the loss, backward,
  ``DataParallel.finish_grad_sync`` over the CP replicas, the optimizer's step) of the same
  model, optimizer and batch handling as ``megatron.training.loop`` (``split_batch``, the loss
  summed over the rank's tokens and divided by the whole samples' count), without the data
  loader, logging and checkpointing around them. Each process has one thread: CP 1 is one
  process on one core, CP 2 two processes on the two cores, so the ratio is the figure of this
  machine (two processes against one, the ring's messages through gloo), not a speed claim.
  An iteration's time is the slowest rank's; the median over the timed steps is printed, with
  the load average, since on 2 shared cores a busy neighbour moves it by tens of percent.

- **Attention alone** (``attention``; benchmarks/ring_attention_figures.py says how): at seq
  8192 (``--attention-seq``), b 1, 8 heads in 2 groups of 64 dims, bf16, causal, CP 2: one
  rank's peak resident memory for one ring forward+backward against the estimate (output, lse
  and ``ring_attention_bytes(..., "cpu")``) and against the four fp32 score blocks the unfused
  ring held; one rank's forward+backward time against one process's SDPA over the whole
  sequence (goal: at most 0.65x); and torch's experimental context_parallel ring, which on CPU
  raises (its ring covers only the CUDA SDPA kernels): its error is the figure.

Prints one JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_context_parallel.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_context_parallel.py --attention-only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.memory_probe import build_gpt, saved_bytes  # noqa: E402
from benchmarks.ring_attention_figures import AttnShape, attention_figures  # noqa: E402
from megatron.config.load import load_config  # noqa: E402
from megatron.config.schema import Config, padded_vocab_size  # noqa: E402
from megatron.estimate.activations import (  # noqa: E402
    layer_activation_bytes,
    ring_attention_bytes,
)
from megatron.estimate.memory import DTYPE_BYTES, worst_stage  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 1000
DTYPE = "bf16"
MEASURED_LAYER = 1  # not the first, whose input is the embedding's output
TOLERANCE = 0.05
CPS = (1, 2, 4)  # the activation measurement's CP sizes; the step time compares 1 and 2


@dataclass(frozen=True)
class Shape:
    """The model and batch: gpt_tiny's layers, hidden and heads at a longer sequence."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq: int = 512
    batch: int = 2


def bench_config(shape: Shape, cp: int) -> Config:
    """configs/gpt_tiny.yaml at ``shape``, TP 1, CP ``cp``, bf16, dropout off."""
    overrides = {
        "model.num_layers": shape.layers,
        "model.hidden_size": shape.hidden,
        "model.num_attention_heads": shape.heads,
        "model.seq_length": shape.seq,
        "model.max_position_embeddings": shape.seq,
        "model.hidden_dropout": 0.0,
        "model.attention_dropout": 0.0,
        "training.micro_batch_size": shape.batch,
        "training.global_batch_size": shape.batch,  # one micro-batch a step, at DP 1
        "precision.dtype": DTYPE,
        "parallel.tensor_parallel_size": 1,
        "parallel.context_parallel_size": cp,
    }
    return load_config(
        [os.path.join(ROOT, "configs", "gpt_tiny.yaml")], [f"{k}={v}" for k, v in overrides.items()]
    )


def _batch(shape: Shape) -> dict[str, Tensor]:
    """One micro-batch of whole samples, the same on every rank (every CP rank loads them)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (shape.batch, shape.seq + 1), generator=g)
    positions = torch.arange(shape.seq).expand(shape.batch, -1)
    return {
        "tokens": data[:, :-1].contiguous(),
        "labels": data[:, 1:].contiguous(),
        "loss_mask": torch.ones(shape.batch, shape.seq),
        "position_ids": positions.contiguous(),
    }


def _activation_child(shape: Shape, cp: int) -> tuple[list[int], int]:
    """This CP rank's saved bytes per layer and in all, for one forward to the logits."""
    from megatron.parallel.context_parallel import split_sequence
    from megatron.parallel.state import initialize

    state = initialize(1, 10.0, 1, cp)
    model = build_gpt(bench_config(shape, cp), state, VOCAB)
    batch = _batch(shape)
    tokens, positions = (
        split_sequence(batch[k], 1, state.cp_rank, cp) for k in ("tokens", "position_ids")
    )
    return saved_bytes(model, tokens, positions)


def _step_child(shape: Shape, cp: int, warmup: int, steps: int) -> list[float]:
    """Milliseconds of each timed training step on this rank."""
    import torch.distributed as dist

    from megatron.optim.build import build_optimizer
    from megatron.parallel.context_batch import split_batch
    from megatron.parallel.data_parallel import DataParallel
    from megatron.parallel.state import initialize

    state = initialize(1, 10.0, 1, cp)
    cfg = bench_config(shape, cp)
    model = build_gpt(cfg, state, VOCAB)
    ddp = DataParallel(model, state, cfg.parallel.ddp_bucket_size_mb, False)
    opt = build_optimizer(model, cfg.optimizer, cfg.precision, state, ddp)
    batch = split_batch(_batch(shape), state, "gpt")
    times = []
    for i in range(warmup + steps):
        dist.barrier()  # every rank starts the step together: the slowest one sets its time
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
        loss = (losses * batch["loss_mask"]).sum() / batch["loss_tokens"]
        opt.scale_loss(loss).backward()
        ddp.finish_grad_sync()
        opt.step()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def _within(measured: float, expected: float, tolerance: float = TOLERANCE) -> dict:
    ratio = measured / expected
    return {"ratio": round(ratio, 5), "pass": abs(ratio - 1) <= tolerance}


def measure_activations(shape: Shape, cps: tuple[int, ...]) -> dict[int, list]:
    """Per CP size, every rank's (per-layer bytes, total bytes)."""
    return {cp: run_distributed(_activation_child, cp, shape, cp, timeout=600) for cp in cps}


def activation_figures(shape: Shape, measured: dict[int, list]) -> dict:
    """Per CP size: the largest rank's layer and model bytes against the estimate; then the
    ratios to CP 1, measured and estimated."""
    e = DTYPE_BYTES[DTYPE]
    figures: dict = {}
    for cp, ranks in measured.items():
        cfg = bench_config(shape, cp)
        estimated = layer_activation_bytes(
            cfg.model, shape.batch, 1, e, fused_attention=True, context_parallel=cp
        )
        dry = worst_stage(cfg, padded_vocab_size(VOCAB, 128, 1), "gpt", 1)
        layer = max(per_layer[MEASURED_LAYER] for per_layer, _ in ranks)
        total = max(t for _, t in ranks)
        # The docstring's CPU differences, per token this rank holds: bf16 LayerNorm statistics
        # (4 bytes short each), the embeddings' int64 token and position ids (16 bytes).
        tokens = shape.batch * shape.seq // cp
        layer_excess = -8 * tokens
        model_excess = (shape.layers * -8 - 4 + 16) * tokens
        figures[f"cp{cp}"] = {
            "layer_bytes": layer,
            "layers_bytes_rank0": ranks[0][0],
            "ranks_agree": all(r == ranks[0] for r in ranks),
            "layer_estimate": estimated,
            "layer": _within(layer, estimated),
            "layer_excess": layer - estimated,
            "layer_excess_as_expected": layer - estimated == layer_excess,
            "model_bytes": total,
            "dry_run_activations": dry.activations_no_recompute,
            "dry_run": _within(total, dry.activations_no_recompute),
            "model_excess": total - dry.activations_no_recompute,
            "model_excess_as_expected": total - dry.activations_no_recompute == model_excess,
            "ring_attention_transient_estimate": ring_attention_bytes(
                cfg.model, shape.batch, 1, e, cp
            ).total,
        }
    base = figures["cp1"]
    for cp in measured:
        if cp == 1:
            continue
        f = figures[f"cp{cp}"]
        for what, est in (
            ("layer_bytes", "layer_estimate"),
            ("model_bytes", "dry_run_activations"),
        ):
            m_ratio, e_ratio = f[what] / base[what], f[est] / base[est]
            figures[f"cp{cp}_over_cp1_{what}"] = {
                "measured": round(m_ratio, 5),
                "estimated": round(e_ratio, 5),
                **_within(m_ratio, e_ratio),
            }
    return figures


def activation_checks(figures: dict, cps: tuple[int, ...]) -> dict[str, bool]:
    """The pass flags of ``activation_figures`` at ``cps`` (CP 1 first)."""
    checks = {}
    for cp in cps:
        f = figures[f"cp{cp}"]
        checks[f"layer_cp{cp}"] = f["layer"]["pass"]
        checks[f"dry_run_cp{cp}"] = f["dry_run"]["pass"]
        checks[f"excess_as_expected_cp{cp}"] = (
            f["layer_excess_as_expected"] and f["model_excess_as_expected"]
        )
        checks[f"ranks_agree_cp{cp}"] = f["ranks_agree"]
        if cp > 1:
            for what in ("layer_bytes", "model_bytes"):
                checks[f"ratio_cp{cp}_{what}"] = figures[f"cp{cp}_over_cp1_{what}"]["pass"]
    return checks


def measure_steps(shape: Shape, cps: tuple[int, ...], warmup: int, steps: int) -> dict:
    """Per CP size, the median over the timed steps of the slowest rank's milliseconds."""
    out = {}
    for cp in cps:
        ranks = run_distributed(_step_child, cp, shape, cp, warmup, steps, timeout=600)
        per_step = [max(r[i] for r in ranks) for i in range(steps)]
        out[cp] = round(statistics.median(per_step), 2)
    return out


def attention_checks(figures: dict) -> dict[str, bool]:
    """The attention figures' goals: peak within 10% of the estimate, CP 2's time at most 0.65x
    SDPA's over the whole sequence."""
    return {
        "attention_peak_within_10pct_of_estimate": abs(figures["peak_over_estimate"] - 1) <= 0.1,
        "attention_cp2_at_most_0.65x_sdpa": figures["cp2_over_sdpa"] <= 0.65,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention-seq", type=int, default=8192)
    parser.add_argument("--attention-reps", type=int, default=3)
    parser.add_argument("--attention-only", action="store_true", help="skip the model figures")
    args = parser.parse_args()
    start = time.perf_counter()
    shape = Shape()
    cfg = bench_config(shape, 1)
    result: dict = {"threads_per_process": 1}
    checks: dict[str, bool] = {}
    if not args.attention_only:
        result["config"] = {
            **asdict(shape),
            "base": "configs/gpt_tiny.yaml",
            "vocab": VOCAB,
            "dtype": DTYPE,
            "tp": 1,
            "dropout": 0.0,
            "ffn_hidden": cfg.model.ffn_hidden_size,
            "global_tokens_per_step": shape.batch * shape.seq,
        }
        acts = activation_figures(shape, measure_activations(shape, CPS))
        result["activations"] = acts
        warmup, steps = 3, 10
        ms = measure_steps(shape, (1, 2), warmup, steps)
        result["step"] = {
            "what": "forward+loss, backward, grad sync over CP, optimizer step (no data loader)",
            "warmup_steps": warmup,
            "timed_steps": steps,
            "cp1_ms": ms[1],
            "cp1_processes": 1,
            "cp2_ms": ms[2],
            "cp2_processes": 2,
            "cp2_over_cp1": round(ms[2] / ms[1], 3),
            "note": "2 processes on 2 shared cores at CP 2, 1 at CP 1: a figure, not a claim",
        }
        checks.update(activation_checks(acts, CPS))
    attention = attention_figures(AttnShape(seq=args.attention_seq), reps=args.attention_reps)
    result["attention"] = attention
    checks.update(attention_checks(attention))
    result["checks"] = checks
    result["pass"] = all(checks.values())
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
