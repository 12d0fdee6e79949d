"""logging.profile_steps and logging.memory_snapshot_steps (megatron/training/profiling.py) on
the real entrypoint: a torch.profiler trace per rank that torch's own trace loader opens, the
bad windows refused in one line, and nothing written when off. The memory snapshot's window is
checked against stand-ins for torch.cuda.memory's recorder, since it needs a GPU."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from torch.profiler._trace_validator import _load_events, validate_trace

from megatron.config.checks import check_all
from megatron.training.profiling import Profiling
from tests.gpt_run import run_pretrain, tiny_overrides
from tests.test_config import error_of, tiny

CONFIG = "configs/gpt_tiny.yaml"
QUICK = {"training.train_iters": 5, "training.eval_iters": 0}


def _run(gpt_data, run_dir, nproc=1, check=True, **extra):
    keys = {"parallel.tensor_parallel_size": nproc, **QUICK, **extra}
    overrides = tiny_overrides(gpt_data, run_dir, **keys)
    return run_pretrain("pretrain_gpt.py", CONFIG, overrides, nproc, check=check)


def _traces(run_dir, ranks):
    """Each rank's one trace: torch's loader opens it, and it marks only the profiled steps."""
    profile = run_dir / "tb" / "profile"
    files = {r: list(profile.glob(f"rank{r}.*.pt.trace.json.gz")) for r in ranks}
    assert all(len(f) == 1 for f in files.values()), files
    for (path,) in files.values():
        with gzip.open(path, "rt") as f:
            assert "traceEvents" in json.load(f)
        passed, violations = validate_trace(str(path))
        assert passed, violations
        steps = {
            e["name"] for e in _load_events(str(path)) if e["name"].startswith("ProfilerStep#")
        }
        # Iterations 3 and 4: the profiler numbers its steps from 0.
        assert steps == {"ProfilerStep#0", "ProfilerStep#1"}, steps


def test_profile_steps_write_a_trace(gpt_data, tmp_path):
    _run(gpt_data, tmp_path, **{"logging.profile_steps": "[3,4]"})
    _traces(tmp_path, [0])


@pytest.mark.slow
def test_a_run_with_nothing_to_train_says_no_profile_was_recorded(gpt_data, tmp_path):
    """The second run resumes the first's finished checkpoint: one line (not one per rank) says
    its window recorded nothing, and no trace appears."""
    save = {"checkpoint.save": tmp_path / "ckpt", "logging.profile_steps": "[3,4]"}
    _run(gpt_data, tmp_path, nproc=2, **save)
    traces = sorted((tmp_path / "tb" / "profile").glob("*.pt.trace.json.gz"))
    again = _run(gpt_data, tmp_path, nproc=2, **save)
    output = again.stdout + again.stderr
    assert output.count("logging.profile_steps=[3, 4]: nothing was recorded") == 1, output
    assert sorted((tmp_path / "tb" / "profile").glob("*.pt.trace.json.gz")) == traces


@pytest.mark.slow
def test_profile_steps_write_a_trace_per_rank(gpt_data, tmp_path):
    """Each rank's trace, gzipped; Kineto's own profiler_start/stop lines stay out of the log."""
    run = _run(gpt_data, tmp_path, nproc=2, **{"logging.profile_steps": "[3,4]"})
    assert "profiler_st" not in run.stdout + run.stderr
    _traces(tmp_path, [0, 1])


def test_off_by_default_writes_nothing(gpt_data, tmp_path):
    _run(gpt_data, tmp_path, **{"training.train_iters": 3})
    assert (tmp_path / "tb").is_dir()
    assert not (tmp_path / "tb" / "profile").exists()


@pytest.mark.parametrize("key", ["profile_steps", "memory_snapshot_steps"])
@pytest.mark.parametrize("steps", ["[4,3]", "[0,2]", "[3]", "[1,2,3]"])
def test_a_window_is_two_positive_ordered_iterations(key, steps):
    message = error_of(lambda c: check_all(c, None), tiny(f"logging.{key}={steps}"))
    assert message.startswith(f"logging.{key}=") and "start <= end" in message


@pytest.mark.parametrize("key", ["profile_steps", "memory_snapshot_steps"])
def test_a_window_needs_a_directory(key):
    cfg = tiny(f"logging.{key}=[1,2]", "logging.tensorboard_dir=null", "checkpoint.save=null")
    assert "set one of them" in error_of(lambda c: check_all(c, None), cfg)


def test_bad_window_and_cpu_memory_snapshot_exit_2(gpt_data, tmp_path):
    bad = _run(gpt_data, tmp_path / "bad", check=False, **{"logging.profile_steps": "[4,3]"})
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "logging.profile_steps=[4, 3]" in bad.stderr
    cpu = _run(
        gpt_data, tmp_path / "cpu", check=False, **{"logging.memory_snapshot_steps": "[1,2]"}
    )
    assert cpu.returncode == 2
    assert cpu.stderr.count("\n") == 1
    assert cpu.stderr.startswith("error: logging.memory_snapshot_steps")


def test_memory_snapshot_records_its_window(monkeypatch, tmp_path):
    calls: list = []
    memory = torch.cuda.memory
    monkeypatch.setattr(
        memory, "_record_memory_history", lambda enabled="all", **_: calls.append(enabled)
    )
    monkeypatch.setattr(memory, "_dump_snapshot", lambda path: calls.append(path))
    cfg = tiny("logging.memory_snapshot_steps=[2,3]", f"logging.tensorboard_dir={tmp_path}")
    profiling = Profiling(cfg, 1, torch.device("cuda"))
    for iteration in range(1, 6):
        profiling.step(iteration)
        calls.append(iteration)
    profiling.close()
    snapshot = str(tmp_path / "profile" / "rank1.memory_snapshot.pickle")
    assert calls == [1, "all", 2, 3, snapshot, None, 4, 5]
