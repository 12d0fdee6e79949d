"""Every value a refusal suggests works: the hint's values, each set as suggested, pass that check
and every other at the same world size (a hint never leads to the next refusal)."""

from __future__ import annotations

import os
import re

import pytest

from megatron.config.load import load_config
from megatron.errors import ConfigError
from megatron.launch.preflight import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "gpt_tiny.yaml")
NO_DROPOUT = ["model.attention_dropout=0", "model.hidden_dropout=0"]
HINT = re.compile(r"use ([a-z_]+\.[a-z_]+)=([0-9, or]+)")


def _refusal(overrides: list[str], world: int) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config([TINY], overrides), world, check_files=False)
    return str(info.value)


@pytest.mark.parametrize(
    "overrides, world, key",
    [
        (["parallel.tensor_parallel_size=3"], 4, "parallel.tensor_parallel_size"),
        (
            [*NO_DROPOUT, "parallel.context_parallel_size=2", "parallel.tensor_parallel_size=2"],
            2,
            "parallel.context_parallel_size",
        ),  # TP 2 x CP 2 on 2 processes: either alone fits
        (
            [
                *NO_DROPOUT,
                "parallel.context_parallel_size=2",
                "parallel.tensor_parallel_size=1",
                "model.seq_length=126",
            ],
            2,
            "model.seq_length",
        ),  # 4 chunks: 124 or 128, not 132 (past max_position_embeddings=128)
        (
            ["parallel.sequence_parallel=true", "model.seq_length=127"],
            2,
            "model.seq_length",
        ),
        (["training.global_batch_size=20"], 4, "training.global_batch_size"),
        (["training.train_iters=5"], 2, "optimizer.lr_warmup_iters"),  # the tiny config's 30
    ],
)
def test_each_suggested_value_passes_every_check(overrides, world, key):
    message = _refusal(overrides, world)
    hints = HINT.findall(message)
    assert key in [k for k, _ in hints], message
    for hinted, values in hints:
        for value in re.findall(r"\d+", values):
            cfg = load_config([TINY], [*overrides, f"{hinted}={value}"])
            validate(cfg, world, check_files=False)  # raises if the hint was wrong
