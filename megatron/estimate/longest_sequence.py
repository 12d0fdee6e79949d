"""The longest ``model.seq_length`` that fits a GPU at a layout, by the memory estimate: what
the dry run states beside its figures (context parallelism exists for long sequences)."""

from __future__ import annotations

import math
from dataclasses import replace

from megatron.config.schema import Config
from megatron.estimate.memory import fits, worst_stage
from megatron.estimate.parameters import ModelType


def seq_granularity(cfg: Config) -> int:
    """What ``model.seq_length`` must be a multiple of at this layout (as the config checks
    require): 2*CP (each sample cut into 2*cp chunks), and with sequence parallelism CP*TP (each
    rank's s/cp tokens split over TP)."""
    p = cfg.parallel
    cp = p.context_parallel_size
    chunks = 2 * cp if cp > 1 else 1
    return math.lcm(chunks, cp * p.tensor_parallel_size) if p.sequence_parallel else chunks


def with_seq_length(cfg: Config, seq_length: int) -> Config:
    """``cfg`` at ``seq_length``, its position table raised to it where shorter (RoPE has no
    parameters there; learned positions then count their longer table)."""
    positions = max(cfg.model.max_position_embeddings, seq_length)
    model = replace(cfg.model, seq_length=seq_length, max_position_embeddings=positions)
    return replace(cfg, model=model)


def longest_seq_length(
    cfg: Config,
    padded_vocab_size: int,
    model_type: ModelType,
    dp_size: int,
    gpu_memory_gb: float,
    limit: int = 2**30,
) -> int:
    """The longest ``model.seq_length`` (a multiple of ``seq_granularity``, at most ``limit``)
    whose worst stage fits a ``gpu_memory_gb`` GPU at this layout, all else as configured; 0
    when none does. Memory grows with the length, so a doubling and a bisection find it."""
    step = seq_granularity(cfg)

    def fit(n: int) -> bool:  # n multiples of the granularity
        changed = with_seq_length(cfg, n * step)
        return fits(
            worst_stage(changed, padded_vocab_size, model_type, dp_size).total, gpu_memory_gb
        )

    if not fit(1):
        return 0
    low, high = 1, 2  # fit(low), and high is the first doubling past it that does not fit
    while high * step <= limit and fit(high):
        low, high = high, 2 * high
    high = min(high, limit // step + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fit(mid) else (low, mid)
    return low * step
