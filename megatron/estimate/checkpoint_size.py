"""Bytes of one checkpoint of a config, from formulas (no model is built).

What megatron/checkpoint/save.py writes, summed over every file: each (TP, PP) rank's slice of
its stage's parameters (replicated ones in every TP rank's file) as weights in the model dtype,
the fp32 main copy when that dtype is not fp32, and the two fp32 Adam moments; with the
distributed optimizer the main copy (kept for fp32 models too) and the moments lie in DP shards
instead, the same bytes in all. Left out, as small beside them: safetensors headers, meta.json
and each rank's RNG states (tens of KiB).
"""

from __future__ import annotations

from megatron.config.schema import Config
from megatron.estimate.memory import DTYPE_BYTES
from megatron.estimate.parameters import ModelType, stage_parameters


def checkpoint_bytes(cfg: Config, padded_vocab_size: int, model_type: ModelType = "gpt") -> int:
    """The bytes of one whole checkpoint of ``cfg`` (every rank's files)."""
    tp, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    heads = (model_type, cfg.bert.num_tokentypes, cfg.bert.binary_head != "none")
    stored = sum(
        tp * stage_parameters(cfg.model, padded_vocab_size, tp, pp, stage, *heads).per_gpu
        for stage in range(pp)
    )
    e = DTYPE_BYTES[cfg.precision.dtype]
    main = 4 if e != 4 or cfg.parallel.distributed_optimizer else 0
    return stored * (e + main + 8)
