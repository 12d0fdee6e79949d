"""Resuming through the real entrypoint: bit-exact continuation, resharding, SIGKILL in a save.

Bit-exact: a run of N iterations, and a run that exits at N/2 (``training.exit_interval``) and
is resumed by a new process, write identical metrics lines (losses, validation losses, grad
norms, loss scales, learning rates; == on floats written at full precision). That needs every
rank's RNG states, the positions of both data streams, the optimizer, loss scaler, LR schedule
and the open log window restored.
"""

import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.checkpoint import find_latest
from megatron.checkpoint.format import checkpoint_name
from tests.gpt_run import ROOT, run_pretrain, tiny_overrides

CONFIG = "configs/gpt_tiny.yaml"
# Wall-clock fields differ between runs (the step's phases too, ``phase_*``), and so do
# measured memory figures (``mem_*``).
TIMING = ("ms_per_iter", "tokens_per_s", "tflops")


def metric_lines(path: Path) -> list[dict]:
    """Every training and validation line of a metrics file, timing fields dropped (a run that
    saves also writes a line per save, and one that resumes a line for the load, with their
    timings: those are left out)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines = [e for e in lines if "save_total_ms" not in e and "load_total_ms" not in e]
    return [
        {k: v for k, v in e.items() if k not in TIMING and not k.startswith(("mem_", "phase_"))}
        for e in lines
    ]


def save_lines(path: Path) -> list[dict]:
    """The lines of a metrics file that record a save's timings."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [e for e in lines if "save_total_ms" in e]


def losses(path: Path) -> dict[int, float]:
    return {e["iteration"]: e["lm_loss"] for e in metric_lines(path) if "lm_loss" in e}


def train(gpt_data, run_dir: Path, nproc: int, metrics: Path, **extra) -> str:
    """One real run of pretrain_gpt.py; its stdout."""
    overrides = tiny_overrides(gpt_data, run_dir, **{"logging.metrics_file": metrics, **extra})
    return run_pretrain("pretrain_gpt.py", CONFIG, overrides, nproc).stdout


def straight_and_resumed(
    gpt_data, tmp_path: Path, nproc: int, save_interval: int | None = None, **extra
) -> tuple[list, list]:
    """8 iterations in one run; 4, exit, then a new process for the other 4 (same metrics file).

    ``save_interval``: the saving runs also save every that many iterations."""
    extra = {
        "training.train_iters": 8,
        "training.eval_interval": 2,
        "model.hidden_dropout": 0.1,
        "model.attention_dropout": 0.1,
        **extra,
    }
    straight, resumed, ckpt = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl", tmp_path
    train(gpt_data, tmp_path / "a", nproc, straight, **extra)
    save = {"checkpoint.save": ckpt / "ckpt", "checkpoint.save_interval": save_interval, **extra}
    train(gpt_data, tmp_path / "b", nproc, resumed, **save, **{"training.exit_interval": 4})
    assert find_latest(str(ckpt / "ckpt")) == 4
    out = train(gpt_data, tmp_path / "b", nproc, resumed, **save)
    assert "at iteration 4" in out and find_latest(str(ckpt / "ckpt")) == 8
    return metric_lines(straight), metric_lines(resumed)


@pytest.mark.slow
def test_resume_at_tp2_dp2_with_dropout_is_bit_exact(gpt_data, tmp_path):
    straight, resumed = straight_and_resumed(
        gpt_data, tmp_path, 4, **{"parallel.tensor_parallel_size": 2}
    )
    assert [e["iteration"] for e in straight if "lm_loss" in e] == list(range(1, 9))
    assert sum("lm_loss_validation" in e for e in straight) == 4  # both streams resume
    assert resumed == straight


@pytest.mark.slow
def test_resume_with_fp16_loss_scale_state_is_bit_exact(gpt_data, tmp_path):
    """The scale grows every 2 clean steps, so the saved scaler is not the initial one."""
    straight, resumed = straight_and_resumed(
        gpt_data,
        tmp_path,
        2,
        **{
            "parallel.tensor_parallel_size": 1,
            "precision.dtype": "fp16",
            "precision.initial_loss_scale": 1024,
            "precision.loss_scale_window": 2,
        },
    )
    scales = [e["loss_scale"] for e in straight if "lm_loss" in e]
    assert scales[3] > scales[0] == 1024  # changed before the save at iteration 4
    assert resumed == straight


@pytest.mark.slow
def test_async_save_keeps_losses_and_resume_bit_exact(gpt_data, tmp_path):
    """checkpoint.async_save=true, saving every 2 iterations on TP=1 x DP=2 with dropout: the
    losses equal those of a run that never saves, through the exit at 4 and the resume from its
    background-written checkpoint. Each save records its timings, blocking below total."""
    straight, resumed = straight_and_resumed(
        gpt_data,
        tmp_path,
        2,
        save_interval=2,
        **{"parallel.tensor_parallel_size": 1, "checkpoint.async_save": True},
    )
    assert resumed == straight
    saves = save_lines(tmp_path / "resumed.jsonl")
    assert [e["iteration"] for e in saves] == [2, 4, 6, 8]
    assert all(0 < e["save_blocking_ms"] <= e["save_total_ms"] for e in saves)
    text = (tmp_path / "resumed.jsonl").read_text().splitlines()
    loads = [e for e in map(json.loads, text) if "load_total_ms" in e]
    assert [e["iteration"] for e in loads] == [4] and loads[0]["load_total_ms"] > 0


def only_checkpoint(save_dir: Path, iteration: int, dest: Path) -> Path:
    """A load directory holding checkpoint ``iteration`` of ``save_dir`` alone."""
    name = checkpoint_name(iteration)
    shutil.copytree(save_dir / name, dest / name)
    (dest / "latest").write_text(f"{iteration}\n")
    return dest


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
def test_resharded_resume_continues_the_loss_curve(gpt_data, tmp_path):
    """TP=2 x DP=2 -> TP=1 x DP=1 (TP and DP both 2 -> 1), then TP=1 x DP=1 -> TP=2 x DP=1.

    The first loss after loading equals the loss of the run that saved at that iteration within
    1e-5 relative: layouts differ only in float reduction order (tests/test_pretrain_gpt.py).
    No dropout: RNG states cannot carry over to another layout.
    """
    common = {"training.train_iters": 4, "training.eval_iters": 0}
    a = tmp_path / "tp2dp2"
    train(gpt_data, a, 4, a / "m.jsonl", **common, **{
        "parallel.tensor_parallel_size": 2,
        "checkpoint.save": a / "ckpt",
        "checkpoint.save_interval": 2,
    })  # fmt: skip
    b = tmp_path / "tp1dp1"
    out = train(gpt_data, b, 1, b / "m.jsonl", **common, **{
        "parallel.tensor_parallel_size": 1,
        "checkpoint.load": only_checkpoint(a / "ckpt", 2, b / "load"),
        "checkpoint.save": b / "ckpt",
        "checkpoint.save_interval": 1,
    })  # fmt: skip
    assert "saved at TP=2 x DP=2" in out
    assert sorted(losses(b / "m.jsonl")) == [3, 4]
    assert rel(losses(b / "m.jsonl")[3], losses(a / "m.jsonl")[3]) <= 1e-5
    c = tmp_path / "tp2dp1"
    out = train(gpt_data, c, 2, c / "m.jsonl", **common, **{
        "parallel.tensor_parallel_size": 2,
        "checkpoint.load": only_checkpoint(b / "ckpt", 3, c / "load"),
    })  # fmt: skip
    assert "saved at TP=1 x DP=1" in out
    assert sorted(losses(c / "m.jsonl")) == [4]
    assert rel(losses(c / "m.jsonl")[4], losses(b / "m.jsonl")[4]) <= 1e-5


# Steps of a save, named like the storage tests' trace: the operation, then file names.
KILL_POINTS = (
    "write_durable rng_",  # the TP shard written, the RNG file not: an incomplete temp directory
    "rename iter_0000004.tmp-",  # complete and fsynced, not yet renamed into place
    "replace latest.tmp-",  # published as iter_0000004, but ``latest`` still names 2
)


def kill_in_save() -> None:
    """Run pretrain_gpt.py in this process and SIGKILL it at one step of one save.

    KILL_SAVE="<iteration>|<step prefix>": the process dies before the first file-system step of
    the save of <iteration> whose trace starts with the prefix (see KILL_POINTS).
    """
    from megatron.checkpoint import streamed_file
    from megatron.checkpoint.async_save import Checkpointer

    iteration, point = os.environ["KILL_SAVE"].split("|")
    armed = {"on": False}
    real_save = Checkpointer.save

    def save(self, save_dir, train, *args):
        armed["on"] = train.progress.iteration == int(iteration)
        return real_save(self, save_dir, train, *args)

    def trap(owner, name):
        real = getattr(owner, name)

        def step(*args, **kwargs):
            paths = [os.path.basename(a) for a in args if isinstance(a, str)]
            if armed["on"] and " ".join([name, *paths]).startswith(point):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        setattr(owner, name, step)

    Checkpointer.save = save
    trap(os, "rename")
    trap(os, "replace")
    trap(streamed_file, "write_durable")
    runpy.run_path(str(ROOT / "pretrain_gpt.py"), run_name="__main__")


@pytest.mark.slow
def test_sigkill_during_a_save_keeps_the_previous_checkpoint_and_a_restart_resumes(
    gpt_data, tmp_path
):
    """Saves every 2 iterations; each run dies inside the save of iteration 4, at another step.
    ``latest`` still names 2, and the next run resumes from 2 (it says so, and its first log line
    equals the first run's: log_interval 3 puts iteration 2 in the middle of a log window). A last
    run resumes from 2 too, saves over what the killed saves left, and finishes."""
    ckpt = tmp_path / "ckpt"
    overrides = tiny_overrides(gpt_data, tmp_path, **{
        "parallel.tensor_parallel_size": 1,
        "training.train_iters": 6,
        "training.eval_iters": 0,
        "logging.log_interval": 3,
        "checkpoint.save": ckpt,
        "checkpoint.save_interval": 2,
    })  # fmt: skip
    code = "from tests.test_resume import kill_in_save; kill_in_save()"
    for i, point in enumerate(KILL_POINTS):
        proc = subprocess.run(
            [sys.executable, "-c", code, "--config", CONFIG, *overrides],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "KILL_SAVE": f"4|{point}"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == -signal.SIGKILL, (point, proc.stderr[-3000:])
        assert find_latest(str(ckpt)) == 2, point
        assert (f"resumed from {ckpt} at iteration 2" in proc.stdout) == (i > 0), point
    out = run_pretrain("pretrain_gpt.py", CONFIG, overrides).stdout
    assert f"resumed from {ckpt} at iteration 2" in out
    lines = metric_lines(tmp_path / "metrics.jsonl")
    assert [e["iteration"] for e in lines] == [3, 3, 3, 3, 6]
    assert all(e == lines[0] for e in lines[:4])
    assert find_latest(str(ckpt)) == 6
    listed = sorted(os.listdir(ckpt))
    assert listed == [
        "iter_0000004",
        "iter_0000006",
        "latest",
        "resolved_config.yaml",
    ]  # keep_last 2
