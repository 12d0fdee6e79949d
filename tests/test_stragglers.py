"""Straggler detection (megatron/training/stragglers.py): the rule on its own, and on the real
entrypoint a rank slowed on purpose (MEGATRON_TEST_DATA_DELAY) named by rank, host and phase
within two log intervals, while the same run unslowed names nobody."""

from __future__ import annotations

import socket

import pytest

from megatron.training.stragglers import DATA_DELAY, find_stragglers
from tests.gpt_run import read_metrics, run_pretrain, tiny_overrides


def _table(data: list[float], compute: list[float]) -> dict[str, list[float]]:
    waits = [10.0] * len(data)
    return {"phase_data_ms": data, "phase_compute_ms": compute,
            "phase_grad_sync_ms": waits, "phase_optimizer_ms": waits}  # fmt: skip


def test_the_rule():
    hosts = ["a", "a", "b", "b"]
    slow = find_stragglers(_table([1, 1, 9, 1], [50, 50, 50, 50]), [0] * 4, hosts, 1.5, 2.0)
    # of two ranks, the slower against the faster: twice as slow is named at a threshold of 2
    pair = find_stragglers(_table([1, 30], [50, 50]), [0, 0], hosts[:2], 2.0, 2.0)
    assert [(s.rank, s.phase, s.median_ms) for s in pair] == [(1, "data", 1)]
    assert [(s.rank, s.host, s.phase, s.ms, s.median_ms) for s in slow] == [(2, "b", "data", 9, 1)]
    # a phase just above the ratio but within the floor of noise names nobody
    assert find_stragglers(_table([1, 1, 2.5, 1], [50] * 4), [0] * 4, hosts, 1.5, 2.0) == []
    # each pipeline stage against its own median: stage 1's heavier compute is its work
    stages = [0, 0, 1, 1]
    assert find_stragglers(_table([1] * 4, [20, 20, 60, 60]), stages, hosts, 1.5, 2.0) == []
    named = find_stragglers(_table([1] * 4, [20, 20, 60, 200]), stages, hosts, 1.5, 2.0)
    assert [(s.rank, s.phase) for s in named] == [(3, "compute")]
    # the waits (gradient sync, optimizer) never name a rank: the fast ones wait there
    waits = _table([1] * 4, [50] * 4) | {"phase_grad_sync_ms": [1, 1, 1, 90]}
    assert find_stragglers(waits, [0] * 4, hosts, 1.5, 2.0) == []


@pytest.mark.slow
def test_a_slowed_rank_is_named_and_an_unslowed_run_names_none(gpt_data, tmp_path):
    """DP 2, logging every 4 iterations: rank 1 sleeps 100 ms in every data wait (2 micro-batches
    a step); by iteration 8 (the second log step; the first window, with the first step's
    one-off work, is not judged) it is named, on the console and in the metrics file, with the
    phase. The same run without the delay names nobody. Threshold 10: ten times the faster
    rank's time and 5% of the step more, over 4 iterations. This model's step is ~10 ms and its
    data wait under 1 ms, so at threshold 2 a 2 ms hiccup of a shared CPU named a rank; the
    slowed rank's 200 ms a step is hundreds of times the other's."""
    names = []
    for delay in (None, "1:0.1"):
        run = tmp_path / f"delay_{delay is not None}"
        keys = {
            "parallel.tensor_parallel_size": 1, "training.train_iters": 8,
            "training.eval_iters": 0, "optimizer.lr_warmup_iters": 0,
            "logging.log_interval": 4, "logging.straggler_threshold": 10.0,
        }  # fmt: skip
        env = {DATA_DELAY: delay} if delay else {}
        out = run_pretrain(
            "pretrain_gpt.py", "configs/gpt_tiny.yaml", tiny_overrides(gpt_data, run, **keys), 2,
            env=env,
        )  # fmt: skip
        logged = read_metrics(run / "metrics.jsonl")
        assert all(len(e["phase_data_ms"]) == 2 for e in logged if "phase_data_ms" in e)
        named = [s for e in logged for s in e.get("stragglers", [])]
        names.append(({(s["rank"], s["host"], s["phase"]) for s in named}, out.stdout + out.stderr))
    (quiet, quiet_log), (slowed, slowed_log) = names
    assert quiet == set() and "straggler:" not in quiet_log
    assert slowed == {(1, socket.gethostname(), "data")}
    assert slowed_log.count(f"straggler: rank 1 ({socket.gethostname()}) spends") == 1
    assert "in data, its pipeline stage's median rank" in slowed_log
