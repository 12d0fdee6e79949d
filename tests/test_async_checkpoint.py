"""Background saves in a real world of two (gloo): what they write, and how their errors surface.

Bit-exact losses and resume with checkpoint.async_save run through the entrypoint in
tests/test_resume.py; kills of the writer thread in tests/test_checkpoint_kill.py.
"""

import os

import pytest

from megatron.checkpoint import find_latest, load_checkpoint, streamed_file
from megatron.checkpoint.async_save import Checkpointer
from megatron.checkpoint.train_state import Progress, TrainState
from megatron.parallel.state import initialize
from tests.distributed import run_distributed
from tests.test_checkpointing import VOCAB, build, same, snapshot, tiny_config, train


def _save_then_fail(cfg, save_dir):
    st = initialize(1)  # TP=1 x DP=2
    model, optimizer, schedule, tracker = build(cfg, st)
    rest = (cfg, st, VOCAB)

    def at(iteration: int) -> TrainState:
        return TrainState(model, optimizer, schedule, tracker, Progress(iteration=iteration))

    lines = []
    saves = Checkpointer(True, lines.append)
    train(model, optimizer, schedule, 1, seed=1)
    saved = snapshot(model)
    saves.save(save_dir, at(1), *rest)
    train(model, optimizer, schedule, 1, seed=2)  # while iteration 1 is being written
    saves.wait()
    probe = TrainState(*build(cfg, st, seed=5))
    load_checkpoint(save_dir, probe, st, VOCAB)
    loaded_ok = same(snapshot(probe.model), saved)

    real_write = streamed_file.write_durable
    if st.rank == 1:  # this rank's disk is full for saves 2 and 3, in the background thread

        def full(path, data):
            raise OSError(28, "No space left on device", path)

        streamed_file.write_durable = full
    errors = []
    for it, surface in ((2, saves.wait), (3, lambda: saves.save(save_dir, at(4), *rest))):
        saves.save(save_dir, at(it), *rest)
        try:
            surface()
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        errors.append((find_latest(save_dir), sorted(os.listdir(save_dir))))
    streamed_file.write_durable = real_write
    saves.save(save_dir, at(5), *rest)
    saves.wait()
    return lines, loaded_ok, errors, find_latest(save_dir), sorted(os.listdir(save_dir))


@pytest.mark.slow
def test_a_background_error_surfaces_on_every_rank_and_latest_stays(tmp_path):
    """Save 1 in the background while training goes on: it holds the weights of the save and
    records its timings. Saves 2 and 3 fail on rank 1's disk: each is raised on both ranks as
    the same one-line StorageError by the next wait or the next save, ``latest`` stays at 1 and
    the temporary directory is gone. Save 5 goes through."""
    cfg = tiny_config(tmp_path, "checkpoint.async_save=true")  # keep_last: 2
    save_dir = str(tmp_path / "ckpt")
    results = run_distributed(_save_then_fail, 2, cfg, save_dir)
    assert results[0][2] == results[1][2]  # every rank takes the same way out
    for rank, (lines, loaded_ok, errors, latest, listing) in enumerate(results):
        assert loaded_ok
        # latest still names the last complete checkpoint; nothing of the failed saves is left
        assert errors[1] == errors[3] == (1, ["iter_0000001", "latest"])
        for it, error in ((2, errors[0]), (3, errors[2])):
            assert error.startswith(
                f"StorageError: checkpoint.save: cannot write {save_dir}/iter_{it:07d} (no space "
                "left on device: needs about "
            )
            assert error.endswith(
                "; iter_0000001 is still the latest; free space or set checkpoint.save elsewhere"
            )
        assert latest == 5 and listing == ["iter_0000001", "iter_0000005", "latest"]
        if rank == 0:  # the metrics are rank 0's: one line per completed save
            assert [line["iteration"] for line in lines] == [1, 5]
            assert all(0 < e["save_blocking_ms"] <= e["save_total_ms"] for e in lines)
