"""The two training steps: GPT throughput and MFU in bf16, and fp16 dynamic loss scaling.

Both run the real ``pretrain_gpt.py`` (one process, TP 1) on synthetic NullTokenizer data and
read the metrics JSONL the trainer writes; nothing here re-implements the loop.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from megatron.config.load import load_config
from megatron.estimate.device_peaks import bf16_peak_tflops, mfu
from megatron.estimate.memory import GIB, estimate_memory
from megatron.estimate.workload import Workload
from tools.gpu_check.calibration import predict
from tools.gpu_check.environment import ROOT, device_name
from tools.gpu_check.runner import run_command

# The console line's "peak memory (MB): ..." (the JSONL does not carry memory yet).
_PEAK = re.compile(r"peak memory \(MB\): ([0-9.]+)")


def overrides(data: str, run: Path, vocab_size: int, extra: dict[str, object]) -> list[str]:
    """The check's overrides: synthetic data, no evaluation or saving, metrics to ``run``."""
    keys: dict[str, object] = {
        "tokenizer.type": "NullTokenizer",
        "tokenizer.vocab_size": vocab_size,
        "tokenizer.vocab_file": "null",
        "tokenizer.merges_file": "null",
        "data.paths": f"[{data}]",
        "data.split": "1,0,0",  # training only: no validation samples to build
        "data.cache_dir": str(run / "cache"),
        "training.eval_iters": 0,
        "optimizer.lr_warmup_iters": 2,
        "checkpoint.save": "null",
        "logging.tensorboard_dir": "null",
        "logging.metrics_file": str(run / "metrics.jsonl"),
        **extra,
    }
    return [f"{k}={v}" for k, v in keys.items()]


def train(config: str, args: list[str], run: Path, timeout: float, log: Path) -> tuple[list, str]:
    """Run pretrain_gpt.py; its training lines from the metrics JSONL and its stdout."""
    run.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "pretrain_gpt.py", "--config", config, *args]
    stdout = run_command(cmd, timeout, log, cwd=ROOT)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [e for e in lines if "lm_loss" in e], stdout


def throughput(
    config: str, args: list[str], run: Path, warmup: int, timeout: float, log: Path, dry: bool
) -> dict[str, Any]:
    """Tokens/s, TFLOP/s, MFU and peak memory over the logged windows after ``warmup``, and
    the step-time model, calibrated on this device, against the measured step."""
    deadline = time.monotonic() + timeout
    lines, stdout = train(config, args, run, timeout, log)
    steady = [e for e in lines if e["iteration"] > warmup]
    if not steady:
        raise RuntimeError(f"no logged window after iteration {warmup}: {lines}")
    cfg = load_config([config], args)
    padded = cfg.derived(1).padded_vocab_size(cfg.tokenizer.vocab_size + 1)
    m, t = cfg.model, cfg.training
    seconds = statistics.mean(e["ms_per_iter"] for e in steady) / 1000
    # PaLM's MFU counts the model's FLOPs (attention included) once: recomputation is work the
    # hardware does on top, so it is in the trainer's TFLOP/s (hardware FLOPs) but not in MFU.
    no_recompute = dataclasses.replace(cfg, model=dataclasses.replace(m, recompute="none"))
    model_flops = Workload.of(no_recompute, padded, 1).flops_per_iter
    model_tflops = model_flops / seconds / 1e12
    hardware_tflops = statistics.mean(e["tflops"] for e in steady)
    name = device_name()
    cuda = name != "cpu"
    peak = bf16_peak_tflops(name)
    peaks = [float(x) for x in _PEAK.findall(stdout)]
    estimate = estimate_memory(cfg, padded)
    return {
        "config": config,
        "dtype": cfg.precision.dtype,
        "shape": {
            "num_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads,
            "seq_length": m.seq_length,
            "padded_vocab_size": padded,
            "micro_batch_size": t.micro_batch_size,
            "global_batch_size": t.global_batch_size,
            "recompute": m.recompute,
        },
        "warmup_iters": warmup,
        "measured_iters": len(steady) * cfg.logging.log_interval,
        "ms_per_iter": seconds * 1000,
        "tokens_per_s": statistics.mean(e["tokens_per_s"] for e in steady),
        "tflops_hardware": hardware_tflops,  # the trainer's figure: recomputation counted
        "tflops_model": model_tflops,
        "peak_tflops_bf16": peak,
        "mfu": mfu(model_tflops, name),
        "hfu": mfu(hardware_tflops, name),
        "peak_memory_gib": peaks[-1] * 2**20 / GIB if peaks else None,
        # The trainer's figure: CUDA's max_memory_allocated, or on the CPU the process's peak
        # resident size (interpreter and libraries included), which the estimate does not model.
        "peak_memory_of": "cuda max_memory_allocated" if cuda else "process max RSS",
        "estimated_memory_gib": estimate.total / GIB,
        "lm_loss": [e["lm_loss"] for e in lines],
        "step_time_model": _calibrated(config, args, seconds * 1000, dry, deadline, log),
    }


def _calibrated(
    config: str, args: list[str], measured_ms: float, dry: bool, deadline: float, log: Path
) -> dict[str, Any]:
    """``calibration.predict``, or why it did not finish: the throughput measured above is
    this step's figure and stands without it."""
    try:
        return predict(config, args, measured_ms, dry, deadline - time.monotonic(), log)
    except (RuntimeError, OSError, ValueError) as e:
        return {"failed": f"{type(e).__name__}: {str(e)[-500:]}"}


def loss_scaling(
    config: str, args: list[str], run: Path, timeout: float, log: Path
) -> dict[str, Any]:
    """The loss scale at every iteration, the skipped ones, and whether the loss stayed finite."""
    lines, _ = train(config, args, run, timeout, log)
    cfg = load_config([config], args)
    losses = [e["lm_loss"] for e in lines if not e["skipped"]]
    if not losses:
        raise RuntimeError(f"every one of {len(lines)} iterations was skipped: {lines[-1]}")
    return {
        "config": config,
        "dtype": cfg.precision.dtype,
        "shape": {
            "num_layers": cfg.model.num_layers,
            "hidden_size": cfg.model.hidden_size,
            "seq_length": cfg.model.seq_length,
            "micro_batch_size": cfg.training.micro_batch_size,
            "global_batch_size": cfg.training.global_batch_size,
        },
        "initial_loss_scale": cfg.precision.initial_loss_scale,
        "loss_scale_window": cfg.precision.loss_scale_window,
        "hysteresis": cfg.precision.hysteresis,
        "iterations": len(lines),
        "loss_scale": [e["loss_scale"] for e in lines],
        "skipped_iterations": [e["iteration"] for e in lines if e["skipped"]],
        "skipped": sum(e["skipped"] for e in lines),
        "nan": sum(e["nan"] for e in lines),
        "lm_loss_first_last": [losses[0], losses[-1]] if losses else None,
        "ms_per_iter_last": lines[-1]["ms_per_iter"] if lines else None,
    }
