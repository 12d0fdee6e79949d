"""training.test_iters: the test split, evaluated once when training ends (as Megatron does),
logged to the console and the metrics file like validation; built only when asked for."""

from __future__ import annotations

import json

import pytest

from megatron.config.load import load_config
from megatron.data.splits import samples_per_split
from tests.gpt_run import run_pretrain, tiny_overrides


def test_the_test_split_is_sized_only_when_asked_for():
    base = ["training.train_iters=10", "training.eval_interval=5", "training.eval_iters=2"]
    t = load_config(["configs/gpt_tiny.yaml"], base).training
    assert samples_per_split(t) == (160, 96, 0)  # 10 steps; evaluations at 0, 5, 10 of 2 batches
    t = load_config(["configs/gpt_tiny.yaml"], [*base, "training.test_iters=3"]).training
    assert samples_per_split(t) == (160, 96, 48)


@pytest.mark.slow
def test_the_test_split_is_evaluated_once_at_the_end(gpt_data, tmp_path):
    keys = {
        "parallel.tensor_parallel_size": 1,
        "data.split": "80,10,10",
        "training.train_iters": 4,
        "training.eval_interval": 2,
        "training.eval_iters": 1,
        "training.test_iters": 2,
    }
    out = run_pretrain(
        "pretrain_gpt.py", "configs/gpt_tiny.yaml", tiny_overrides(gpt_data, tmp_path, **keys)
    ).stdout
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    valid = [e["iteration"] for e in lines if "lm_loss_validation" in e]
    test = [e for e in lines if "lm_loss_test" in e]
    assert valid == [2, 4] and [e["iteration"] for e in test] == [4]
    assert lines[-1] is test[0] and test[0]["lm_loss_test_ppl"] > 1
    console = [line for line in out.splitlines() if line.startswith("test at iteration")]
    assert len(console) == 1 and console[0].startswith("test at iteration 4 | lm loss test: ")
