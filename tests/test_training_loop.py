"""Loop behaviour under injected non-finite losses, through the real entrypoint's ``main``.

The loss of chosen iterations is multiplied by inf (one micro-batch per step, so the n-th call
of forward_step is iteration n); the run is a real single-rank process with its own process
group, data, checkpoints and metrics file.
"""

import math

import pytest

from megatron.optim.lr_schedule import LRSchedule
from tests.distributed import run_distributed
from tests.gpt_run import read_metrics, tiny_overrides

CONFIG = "configs/gpt_tiny.yaml"


def _train_with_bad_losses(overrides: list[str], bad: set[int], factor: float) -> int:
    import pretrain_gpt
    from megatron.training.pretrain import main

    calls = {"n": 0}

    def forward_step(model, batch):
        losses = pretrain_gpt.forward_step(model, batch)
        calls["n"] += 1
        if model.training and calls["n"] in bad:
            losses = {name: (total * factor, count) for name, (total, count) in losses.items()}
        return losses

    return main(
        ["--config", CONFIG, *overrides],
        "",
        pretrain_gpt.datasets_provider,
        forward_step,
    )


def _overrides(gpt_data, run_dir, **extra):
    base = {
        "parallel.tensor_parallel_size": 1,
        "training.micro_batch_size": 8,
        "training.eval_iters": 0,
        "training.train_iters": 12,
    }
    return tiny_overrides(gpt_data, run_dir, **{**base, **extra})


@pytest.mark.slow
def test_fp16_overflow_skips_that_step_and_backs_off_after_hysteresis(gpt_data, tmp_path):
    overrides = _overrides(
        gpt_data,
        tmp_path,
        **{
            "precision.dtype": "fp16",
            "precision.initial_loss_scale": 1024.0,
            "precision.hysteresis": 2,
            "optimizer.lr_warmup_iters": 3,
        },
    )
    assert run_distributed(_train_with_bad_losses, 1, overrides, {5, 6, 9}, math.inf) == [0]
    run = read_metrics(tmp_path / "metrics.jsonl")
    skipped = [e["iteration"] for e in run if e["skipped"]]
    assert skipped == [5, 6, 9]
    scales = [e["loss_scale"] for e in run]
    # Hysteresis 2: the first overflow only spends it, each later one halves the scale.
    assert scales == [1024.0] * 6 + [512.0] * 3 + [256.0] * 3
    schedule = LRSchedule(1e-3, 1e-4, 3, 12, "cosine")  # gpt_tiny min_lr
    done = 0
    for e in run:
        done += 0 if e["skipped"] else 1
        assert e["lr"] == schedule.lr_at(done), e["iteration"]  # skipped steps keep the LR step
    assert all(math.isfinite(e["grad_norm"]) != bool(e["skipped"]) for e in run)


@pytest.mark.slow
def test_nan_is_skipped_and_counted_then_the_run_stops(gpt_data, tmp_path):
    overrides = _overrides(
        gpt_data,
        tmp_path,
        **{"training.max_consecutive_nan": 3, "checkpoint.save": str(tmp_path / "ckpt")},
    )
    code = run_distributed(_train_with_bad_losses, 1, overrides, {4, 7, 8, 9, 10}, math.nan)[0]
    assert code == 3
    run = read_metrics(tmp_path / "metrics.jsonl")
    assert [e["iteration"] for e in run if e["skipped"]] == [4, 7, 8, 9]
    assert [e["nan"] for e in run] == [0, 0, 0, 1, 0, 0, 1, 1, 1]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "9"
