"""SIGKILL at file-system steps of a save: ``latest`` always names a complete checkpoint.

A child process runs a real save and kills itself at one traced step; the parent then loads and
checks it gets exactly the previous (or the new, once published) checkpoint's weights. A
background save (checkpoint.async_save) is killed from its writer thread while the training
thread goes on changing the weights: what it publishes must still be the state it was given.
"""

import json
import os
import shutil
import signal
import threading

import pytest

from megatron.checkpoint import find_latest, load_checkpoint, save_checkpoint, streamed_file
from megatron.checkpoint.async_save import Checkpointer
from megatron.checkpoint.train_state import Progress, TrainState
from megatron.parallel.state import initialize
from tests.distributed import run_distributed
from tests.test_checkpointing import VOCAB, build, same, snapshot, tiny_config, train


def _trace_save(save_dir, args, kill_at: int | None, background: bool = False) -> list[str]:
    """Save with every file-system step recorded; SIGKILL this process before step ``kill_at``.

    ``background``: an async save, during which this thread takes one more training step.
    """
    trace: list[str] = []

    def hook(owner, name):
        real = getattr(owner, name)

        def step(*a, **k):
            paths = [os.path.basename(x) for x in a if isinstance(x, str)]
            trace.append(" ".join([name, *paths]))
            if len(trace) - 1 == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)

        setattr(owner, name, step)

    for name in ("fsync", "rename", "replace", "remove"):
        hook(os, name)
    hook(shutil, "rmtree")
    hook(streamed_file, "write_durable")
    if not background:
        save_checkpoint(save_dir, *args)
        return trace
    # The writer serialises only after the training step has changed the weights: what it
    # writes must be the host copies taken at the save, not the live tensors.
    stepped, serialize = threading.Event(), streamed_file.serialize
    streamed_file.serialize = lambda *a, **k: stepped.wait() and serialize(*a, **k)
    saves = Checkpointer(True, lambda _: None)
    saves.save(save_dir, *args)
    train(args[0].model, args[0].optimizer, args[0].schedule, 1, seed=9)
    stepped.set()
    saves.wait()
    return trace


def _in_child(fn) -> int:
    """Run ``fn`` in a forked child; its wait status (the child never returns into pytest)."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


def _kill_each_step(
    save_dir: str, args: tuple, expect, probe: TrainState, st, points: int | None = None
) -> list[str]:
    """Trace one save of ``args``; then, from the same starting directory, kill a save before each
    of its steps and check what ``latest`` names and what loads: ``expect(trace, kill_at)`` gives
    (iteration, weights). ``points``: a background save, killed before that many of its steps
    spread evenly over it."""
    pristine, trace_file = f"{save_dir}.pristine", f"{save_dir}.trace.json"
    shutil.copytree(save_dir, pristine)

    def record():
        with open(trace_file, "w") as f:
            json.dump(_trace_save(save_dir, args, None, points is not None), f)

    assert _in_child(record) == 0
    with open(trace_file) as f:
        trace = json.load(f)
    steps = range(len(trace))
    if points is not None:
        steps = sorted({round(i * (len(trace) - 1) / (points - 1)) for i in range(points)})
        assert len(steps) == points, trace
    for kill_at in steps:
        shutil.rmtree(save_dir)
        shutil.copytree(pristine, save_dir)
        status = _in_child(lambda k=kill_at: _trace_save(save_dir, args, k, points is not None))
        where = f"killed before {trace[kill_at]}"
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, where
        iteration, weights = expect(trace, kill_at)
        assert find_latest(save_dir) == iteration, where
        load_checkpoint(save_dir, probe, st, VOCAB)
        assert probe.progress.iteration == iteration, where
        assert same(snapshot(probe.model), weights), where
    shutil.rmtree(pristine)
    return trace


def _step(trace: list[str], prefix: str, suffix: str) -> int:
    return next(i for i, s in enumerate(trace) if s.startswith(prefix) and s.endswith(suffix))


def _kill_during_save(cfg, root):
    st = initialize(1)
    model, optimizer, schedule, tracker = build(cfg, st)
    probe = TrainState(*build(cfg, st, seed=7))
    save_dir = os.path.join(root, "ckpt")
    at = {
        it: TrainState(model, optimizer, schedule, tracker, Progress(iteration=it)) for it in (1, 2)
    }
    rest = (cfg, st, VOCAB)
    states = {}
    train(model, optimizer, schedule, 1, seed=1)
    states[1] = snapshot(model)
    save_checkpoint(save_dir, at[1], *rest)
    train(model, optimizer, schedule, 1, seed=2)
    states[2] = snapshot(model)

    def over_1(trace, kill_at):  # saving 2 over 1; keep_last=1 then deletes 1
        new = kill_at > _step(trace, "replace", " latest")
        return (2, states[2]) if new else (1, states[1])

    traces = [_kill_each_step(save_dir, (at[2], *rest), over_1, probe, st)]
    save_checkpoint(save_dir, at[2], *rest)
    train(model, optimizer, schedule, 1, seed=3)
    states[3] = snapshot(model)

    def over_2(trace, kill_at):  # saving 2 again: the old copy steps aside, the new one moves in
        new = kill_at > _step(trace, "rename iter_0000002.tmp-", " iter_0000002")
        return 2, states[3] if new else states[2]

    traces.append(_kill_each_step(save_dir, (at[2], *rest), over_2, probe, st))
    # The next complete save clears whatever the killed ones left behind.
    save_checkpoint(save_dir, at[2], *rest)
    return traces, sorted(os.listdir(save_dir))


@pytest.mark.slow
def test_sigkill_at_every_step_of_a_save_keeps_the_previous_checkpoint(tmp_path):
    """The process is killed before each file-system step of a save (writes, fsyncs, renames,
    deletions): ``latest`` names the old checkpoint until its own replace has happened, and
    loading always yields exactly the checkpoint it names. Twice: saving iteration 2 over 1
    (keep_last=1, so 1 is deleted too), and saving iteration 2 again with newer weights."""
    cfg = tiny_config(tmp_path, "checkpoint.keep_last=1")
    traces, listing = run_distributed(_kill_during_save, 1, cfg, str(tmp_path))[0]
    kinds = [s.split()[0] for s in traces[0]]
    assert kinds.count("write_durable") == 2 and "rmtree" in kinds and len(kinds) >= 12
    assert any(s.startswith("rename iter_0000002 iter_0000002.old-") for s in traces[1])
    assert listing == ["iter_0000002", "latest"]


def _kill_background_save(cfg, root):
    st = initialize(1)
    model, optimizer, schedule, tracker = build(cfg, st)
    probe = TrainState(*build(cfg, st, seed=7))
    save_dir = os.path.join(root, "ckpt")
    at = {
        it: TrainState(model, optimizer, schedule, tracker, Progress(iteration=it)) for it in (1, 2)
    }
    rest = (cfg, st, VOCAB)
    train(model, optimizer, schedule, 1, seed=1)
    before = snapshot(model)
    save_checkpoint(save_dir, at[1], *rest)
    train(model, optimizer, schedule, 1, seed=2)
    saved = snapshot(model)

    def over_1(trace, kill_at):
        new = kill_at > _step(trace, "replace", " latest")
        return (2, saved) if new else (1, before)

    return _kill_each_step(save_dir, (at[2], *rest), over_1, probe, st, points=10)


@pytest.mark.slow
def test_sigkill_at_10_points_of_a_background_save_keeps_the_previous_checkpoint(tmp_path):
    """checkpoint.async_save: the writer thread is killed before 10 of its steps, spread from the
    first write to the deletion keep_last makes, while the training thread steps on. Each time
    ``latest`` names a checkpoint that loads, with exactly the weights it was saved with."""
    cfg = tiny_config(tmp_path, "checkpoint.keep_last=1", "checkpoint.async_save=true")
    trace = run_distributed(_kill_background_save, 1, cfg, str(tmp_path))[0]
    assert trace[0].startswith("write_durable") and trace[-1].startswith("rmtree")
