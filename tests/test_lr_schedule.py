"""LR schedule: values at chosen iterations, state dict, and megatron-core's scheduler as oracle."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from megatron.config.schema import OptimizerConfig
from megatron.optim.lr_schedule import LRSchedule


def test_warmup_then_cosine_values():
    s = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110, decay_style="cosine")
    assert s.lr_at(0) == 0.0  # the first step runs at lr_warmup_init, as in Megatron
    assert s.lr_at(5) == 0.5
    assert s.lr_at(10) == 1.0
    assert s.lr_at(60) == pytest.approx(0.55, abs=1e-15)  # halfway: (max + min) / 2
    assert s.lr_at(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert s.lr_at(110) == pytest.approx(0.1, abs=1e-15)
    assert s.lr_at(111) == 0.1 and s.lr_at(10**6) == 0.1


def test_linear_constant_and_warmup_init():
    linear = LRSchedule(2.0, 0.0, 0, 100, "linear")
    assert [linear.lr_at(i) for i in (0, 25, 50, 100, 101)] == [2.0, 1.5, 1.0, 0.0, 0.0]
    constant = LRSchedule(3.0, 0.5, 4, 8, "constant", warmup_init=1.0)
    assert [constant.lr_at(i) for i in (0, 2, 4, 5, 1000)] == [1.0, 2.0, 3.0, 3.0, 3.0]


def test_step_and_state_dict():
    cfg = OptimizerConfig(
        lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_iters=10, lr_decay_style="cosine"
    )
    s = LRSchedule.from_config(cfg)
    assert s.lr == 0.0
    assert s.step() == 5e-4 and s.step() == 1e-3
    t = LRSchedule.from_config(cfg)
    t.load_state_dict(s.state_dict())
    assert t.num_steps == 2 and t.lr == s.lr
    u = LRSchedule(2e-3, 1e-4, 2, 10, "cosine")
    changed = u.load_state_dict(s.state_dict())  # the config's settings win, and are named
    assert u.lr == 2e-3 and "max_lr" in changed


def test_invalid_settings():
    with pytest.raises(ValueError):
        LRSchedule(1.0, 0.0, 10, 10, "cosine")
    with pytest.raises(ValueError):
        LRSchedule(1.0, 0.0, 0, 10, "exponential")


ORACLE = """
import json, sys, torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
out = {}
for style, warmup, decay in json.loads(sys.argv[1]):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    s = OptimizerParamScheduler(
        opt, init_lr=1e-5, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
        wd_incr_steps=decay, wd_incr_style="constant")
    lrs = []
    for _ in range(decay + 5):
        lrs.append(opt.param_groups[0]["lr"])
        s.step(1)
    out[style + str(warmup)] = lrs
print(json.dumps(out))
"""


@pytest.mark.slow
def test_matches_megatron_core(tmp_path):
    """Exactly megatron-core 0.16.1's OptimizerParamScheduler (the same float operations).

    Runs in a subprocess outside the repo: our package is also named ``megatron``.
    """
    cases = [("cosine", 7, 50), ("linear", 7, 50), ("constant", 7, 50), ("cosine", 0, 30)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", ORACLE, json.dumps(cases)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    expected = json.loads(done.stdout.strip().splitlines()[-1])
    for style, warmup, decay in cases:
        ours = LRSchedule(3e-4, 3e-5, warmup, decay, style, warmup_init=1e-5)
        assert [ours.lr_at(i) for i in range(decay + 5)] == expected[style + str(warmup)]
