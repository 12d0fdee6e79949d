"""Measure what the distributed optimizer and sequence parallelism save, against the estimate.

Real processes on CPU (gloo, one thread each; tests/distributed.py), the gpt_tiny shapes
(4 layers, hidden 256, 4 heads, seq 128, micro-batch 4) with a vocabulary of 1000, bf16 as in
mixed-precision training:

- **Optimizer state**, DP=2 and DP=4 (TP=1): after one real training step, the bytes of the
  distinct storages that hold the optimizer's fp32 main copies and Adam moments (step counters
  left out; the model's own parameters and gradient buffer are not optimizer state), with the
  distributed optimizer and, the baseline, without it, on the same process group. Checks: the
  ratio is 1/DP within 2%; both agree with the dry run's figure (``worst_stage``, the stage the
  dry run reports: its fp32 main params + Adam moments) within 5%. ``state_bytes()`` (what the
  metrics file logs) is printed beside the measurement. The same checks in fp32, where both
  optimizers hold the moments only (fp32 parameters are their own main copy; the distributed
  one's are its parameter buffer's slices).
- **Activations**, TP=2, sequence parallelism off and on: one forward of the whole model (to the
  logits, without the loss, whose buffers the dry run lists apart) under
  ``torch.autograd.graph.saved_tensors_hooks``, counting the distinct storages saved for
  backward, parameters excluded. Distinct storages, not the bytes of each saved tensor, because
  several saved tensors alias one allocation (q, k and v are views of QKV's output; a reshape of
  the attention output is the dense layer's input) and a view keeps its whole storage alive: the
  storages are the memory backward holds. Each storage is charged to the transformer layer in
  whose forward it is first saved (a layer's input is first saved by its own first LayerNorm).
  Checks: layer 1's bytes against ``layer_activation_bytes`` for both settings within 5%, and the
  ratio on/off measured against estimated within 5%; the whole model's bytes against the dry
  run's "activations, no recomputation" within 5%.
  Dropout is off: on CPU ``F.dropout`` saves its mask in the model dtype (CUDA's fused kernel
  saves one byte per element, which the estimate assumes) and attention with dropout leaves the
  fused kernel for the math path (probabilities materialised, in fp32). A second measurement
  with ``hidden_dropout=0.1`` is printed as figures: the excess over the estimate must then be
  exactly the masks' extra bytes, (e - 1) per mask element, beyond the no-dropout excess.
  That no-dropout excess is small and negative: PyTorch's CPU LayerNorm saves its mean and rstd
  in bf16, where CUDA's (and the estimate's) are fp32: 8 * s * b bytes fewer per layer (/ t
  with sequence parallelism). With sequence parallelism the dropout keeps a bool mask (one byte
  per element, megatron/parallel/sequence_parallel.py), so there the excess is zero.

Prints one JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_memory.py
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.memory_probe import build_gpt, saved_bytes  # noqa: E402
from megatron.config.load import load_config  # noqa: E402
from megatron.config.schema import Config, padded_vocab_size  # noqa: E402
from megatron.estimate.activations import layer_activation_bytes  # noqa: E402
from megatron.estimate.memory import DTYPE_BYTES, worst_stage  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 1000
MEASURED_LAYER = 1  # not the first, whose input is the embedding's output
TOLERANCE = {"optimizer": 0.02, "activations": 0.05, "dry_run": 0.05}


def bench_config(dtype: str, tp: int, distributed: bool, sequence: bool, dropout: float) -> Config:
    """configs/gpt_tiny.yaml at these settings, attention dropout off (see the docstring)."""
    return load_config(
        [os.path.join(ROOT, "configs", "gpt_tiny.yaml")],
        [
            f"precision.dtype={dtype}",
            f"parallel.tensor_parallel_size={tp}",
            f"parallel.distributed_optimizer={str(distributed).lower()}",
            f"parallel.sequence_parallel={str(sequence).lower()}",
            f"model.hidden_dropout={dropout}",
            "model.attention_dropout=0.0",
        ],
    )


def _storages(tensors: list[Tensor], exclude: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those in ``exclude``."""
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in held.items() if ptr not in exclude)


def _optimizer_child(dtypes: list[str]) -> dict:
    """Per dtype, with and without the distributed optimizer: this rank's optimizer-state bytes
    after one step (measured, and ``state_bytes()``) and its parameter count."""
    from megatron.optim.build import build_optimizer
    from megatron.parallel.data_parallel import DataParallel
    from megatron.parallel.state import initialize

    state = initialize(1)
    out = {}
    for dtype in dtypes:
        for distributed in (False, True):
            cfg = bench_config(dtype, 1, distributed, False, 0.0)
            model = build_gpt(cfg, state, VOCAB)
            ddp = DataParallel(model, state, cfg.parallel.ddp_bucket_size_mb, distributed)
            opt = build_optimizer(model, cfg.optimizer, cfg.precision, state, ddp)
            g = torch.Generator().manual_seed(state.dp_rank)
            b, s = cfg.training.micro_batch_size, cfg.model.seq_length
            data = torch.randint(0, VOCAB, (b, s + 1), generator=g)
            opt.scale_loss(model(data[:, :-1], labels=data[:, 1:]).float().mean()).backward()
            ddp.finish_grad_sync()
            assert opt.step().updated  # the moments exist from here on
            moments = [
                value
                for per_param in opt.inner.state.values()
                for key, value in per_param.items()
                if key != "step"
            ]
            not_state = {p.untyped_storage().data_ptr() for p in model.parameters()}
            out[dtype, distributed] = {
                "measured": _storages(opt.main_params + moments, not_state),
                "state_bytes": opt.state_bytes(),
                "params": sum(p.numel() for p in model.parameters()),
            }
    return out


def _activation_child(dtype: str, dropouts: list[float]) -> dict:
    """Per hidden dropout, sequence parallelism off and on: each layer's and the model's saved
    bytes on this TP rank."""
    from megatron.parallel.state import initialize

    state = initialize(2)
    out = {}
    for dropout in dropouts:
        for sequence in (False, True):
            cfg = bench_config(dtype, 2, False, sequence, dropout)
            model = build_gpt(cfg, state, VOCAB)
            g = torch.Generator().manual_seed(0)  # the same tokens on both TP ranks
            b, s = cfg.training.micro_batch_size, cfg.model.seq_length
            tokens = torch.randint(0, VOCAB, (b, s), generator=g)
            out[dropout, sequence] = saved_bytes(model, tokens)
    return out


def _within(measured: float, expected: float, tolerance: float) -> dict:
    ratio = measured / expected
    return {"ratio": round(ratio, 5), "pass": abs(ratio - 1) <= tolerance}


def optimizer_figures(dtype: str, dp: int, ranks: list[dict]) -> dict:
    """The optimizer check at one DP size: rank 0's bytes (the largest shard: ceil) and all."""
    plain, sharded = ranks[0][dtype, False], ranks[0][dtype, True]
    padded = padded_vocab_size(VOCAB, 128, 1)
    dry = {
        d: worst_stage(bench_config(dtype, 1, d, False, 0.0), padded, "gpt", dp)
        for d in (False, True)
    }
    dry_bytes = {d: m.main_params + m.adam_moments for d, m in dry.items()}
    ratio = sharded["measured"] / plain["measured"]
    return {
        "params_per_rank": plain["params"],
        "baseline_bytes": plain["measured"],
        "distributed_bytes_per_rank": [r[dtype, True]["measured"] for r in ranks],
        "state_bytes_agree": all(
            r[dtype, d]["measured"] == r[dtype, d]["state_bytes"] for r in ranks for d in dry
        ),
        "ratio": round(ratio, 5),
        "ratio_over_1_dp": round(ratio * dp, 5),
        "pass": abs(ratio * dp - 1) <= TOLERANCE["optimizer"],
        # What the dry run's figures give for the same ratio (1.5 in fp32: see the docstring).
        "dry_run_ratio_over_1_dp": round(dry_bytes[True] / dry_bytes[False] * dp, 5),
        "dry_run_baseline_bytes": dry_bytes[False],
        "dry_run_distributed_bytes": dry_bytes[True],
        "dry_run_baseline": _within(plain["measured"], dry_bytes[False], TOLERANCE["dry_run"]),
        "dry_run_distributed": _within(sharded["measured"], dry_bytes[True], TOLERANCE["dry_run"]),
    }


def activation_figures(
    dtype: str, dropout: float, ranks: list[dict], baseline: dict | None = None
) -> dict:
    """The sequence-parallel check on TP rank 0 (both ranks hold the same shapes); with dropout,
    the layer's excess over the estimate against ``baseline``'s (the same without dropout)."""
    e = DTYPE_BYTES[dtype]
    figures: dict = {}
    for sequence in (False, True):
        cfg = bench_config(dtype, 2, False, sequence, dropout)
        m, b = cfg.model, cfg.training.micro_batch_size
        per_layer, total = ranks[0][dropout, sequence]
        estimated = layer_activation_bytes(m, b, 2, e, sequence_parallel=sequence)
        dry = worst_stage(cfg, padded_vocab_size(VOCAB, 128, 2), "gpt", 1)
        key = "sp_on" if sequence else "sp_off"
        figures[key] = {
            "layer_bytes": per_layer[MEASURED_LAYER],
            "layers_bytes": per_layer,
            "layer_estimate": estimated,
            "layer": _within(per_layer[MEASURED_LAYER], estimated, TOLERANCE["activations"]),
            "model_bytes": total,
            "dry_run_activations": dry.activations_no_recompute,
            "dry_run": _within(total, dry.activations_no_recompute, TOLERANCE["dry_run"]),
        }
        if baseline is not None:
            # Two masks per layer. Without sequence parallelism F.dropout's CPU mask is in the
            # model dtype: (e - 1) bytes per element more than the estimate's one; with it the
            # mask is bool, as the estimate counts.
            masks = 2 * m.seq_length * b * m.hidden_size // (2 if sequence else 1)
            no_dropout = baseline[key]["layer_bytes"] - baseline[key]["layer_estimate"]
            excess = per_layer[MEASURED_LAYER] - estimated - no_dropout
            expected = 0 if sequence else (e - 1) * masks
            figures[key]["mask_excess"] = excess
            figures[key]["mask_excess_as_expected"] = excess == expected
    off, on = figures["sp_off"], figures["sp_on"]
    measured = on["layer_bytes"] / off["layer_bytes"]
    estimated = on["layer_estimate"] / off["layer_estimate"]
    figures["sp_ratio_measured"] = round(measured, 5)
    figures["sp_ratio_estimated"] = round(estimated, 5)
    figures["sp_ratio"] = _within(measured, estimated, TOLERANCE["activations"])
    return figures


def main() -> None:
    start = time.perf_counter()
    result: dict = {"vocab": VOCAB, "shapes": "gpt_tiny: L4 h256 a4 s128 b4", "optimizer": {}}
    for dp in (2, 4):
        ranks = run_distributed(_optimizer_child, dp, ["bf16", "fp32"], timeout=600)
        for dtype in ("bf16", "fp32"):
            result["optimizer"][f"{dtype}_dp{dp}"] = optimizer_figures(dtype, dp, ranks)
    ranks = run_distributed(_activation_child, 2, "bf16", [0.0, 0.1], timeout=600)
    plain = activation_figures("bf16", 0.0, ranks)
    result["activations_tp2_bf16"] = plain
    result["activations_tp2_bf16_dropout_0.1"] = activation_figures("bf16", 0.1, ranks, plain)
    optimizer = [(dtype, dp) for dtype in ("bf16", "fp32") for dp in (2, 4)]
    checks = {
        **{
            f"optimizer_{t}_dp{dp}": result["optimizer"][f"{t}_dp{dp}"]["pass"]
            for t, dp in optimizer
        },
        **{
            f"optimizer_dry_run_{t}_dp{dp}": all(
                result["optimizer"][f"{t}_dp{dp}"][k]["pass"]
                for k in ("dry_run_baseline", "dry_run_distributed")
            )
            for t, dp in optimizer
        },
        "activations_layer": all(
            result["activations_tp2_bf16"][k]["layer"]["pass"] for k in ("sp_off", "sp_on")
        ),
        "activations_sp_ratio": result["activations_tp2_bf16"]["sp_ratio"]["pass"],
        "activations_dry_run": all(
            result["activations_tp2_bf16"][k]["dry_run"]["pass"] for k in ("sp_off", "sp_on")
        ),
    }
    result["checks"] = checks
    result["pass"] = all(checks.values())
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
