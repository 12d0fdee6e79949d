"""Every value a refusal suggests works: the hint's values, each set as suggested, pass that check
and every other at the same world size (a hint never leads to the next refusal)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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


def test_every_mistake_in_one_pass():
    """Three independent mistakes (CP at a world it does not divide, a warmup as long as the
    run, a loss-scale floor above its start) come out of one dry run of the real entrypoint (its
    checks are the launch's), a numbered line each, exit 2; fixing all three as hinted passes."""
    mistakes = [*NO_DROPOUT, "parallel.context_parallel_size=4", "training.train_iters=10",
                "precision.min_loss_scale=1e6", "precision.initial_loss_scale=1024"]  # fmt: skip
    argv = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--config", TINY,
            "--dry-run", "--world-size", "2"]  # fmt: skip
    run = subprocess.run([*argv, *mistakes], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[0] == "error: 3 config mistakes, each with its fix:", run.stderr
    assert [line.split(" ")[3] for line in lines[1:]] == [
        "parallel.tensor_parallel_size=2",
        "precision.min_loss_scale=1000000.0",
        "optimizer.lr_warmup_iters=30",
    ], run.stderr
    assert "use parallel.context_parallel_size=1, or launch" in lines[1], run.stderr
    assert "use optimizer.lr_warmup_iters=0, 1 or 9" in lines[3], run.stderr
    fixed = [*mistakes, "parallel.context_parallel_size=1", "optimizer.lr_warmup_iters=1",
             "precision.min_loss_scale=1"]  # fmt: skip
    validate(load_config([TINY], fixed), 2, check_files=False)


def test_out_of_range_values_come_alone_and_together():
    """Values the other checks would divide by are reported first, all of them."""
    with pytest.raises(ConfigError) as info:
        validate(load_config([TINY], ["model.num_layers=0", "optimizer.lr=-1"]), 1, False)
    assert str(info.value).splitlines()[1:] == [
        "  1. model.num_layers=0 must be positive; fix the value",
        "  2. optimizer.lr=-1.0 must be positive; fix the value",
    ]
