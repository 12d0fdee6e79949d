"""What one training iteration does over all ranks (tokens, FLOPs): the throughput fields of a
training line, and the dry run's FLOPs."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.schema import Config
from megatron.estimate.flops import flops_per_iteration


@dataclass(frozen=True)
class Workload:
    """What one iteration does, for the throughput fields of a training line."""

    train_iters: int
    tokens_per_iter: int  # over all ranks
    flops_per_iter: float  # over all ranks
    world_size: int

    @classmethod
    def of(cls, cfg: Config, padded_vocab_size: int, world_size: int) -> Workload:
        m, t = cfg.model, cfg.training
        flops = flops_per_iteration(m, padded_vocab_size, t.global_batch_size)
        tokens = t.global_batch_size * m.seq_length
        return cls(t.train_iters, tokens, flops, world_size)
