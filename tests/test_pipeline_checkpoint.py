"""Pipeline checkpoints through the real entrypoint: one file per (TP, PP) rank, loaded at any PP.

A tiny 4-layer GPT (fp32) trains 4 iterations at TP=2 x PP=2, saving at 2, once with the
distributed optimizer and no dropout, once with the plain optimizer and dropout. The first
checkpoint loads at TP=1 x PP=1 and at TP=1 x PP=4 (each stage picking its layers out of the two
saved stages' files, the tied word table from the first), and, merged to PP=1 by
tools/checkpoint_util.py, at TP=1 x PP=1 again. The two losses after each load (the loaded
weights', then after a step with the loaded optimizer state) are within 1e-5 relative of the
unbroken run's: layouts differ only in float reduction order
(tests/test_pipeline_training.py); no dropout there, since RNG states cannot carry over to another
layout. The second resumes at TP=2 x PP=2 and logs the unbroken run's lines exactly, dropout
included (every rank's RNG states are restored). The SIGTERM save of a pipeline run is in
tests/test_pipeline_training.py, whose signal test already pays for a torchrun launch.
"""

from __future__ import annotations

import os

import pytest

from megatron.checkpoint.format import checkpoint_name, optim_file, read_meta, shard_file
from tests.distributed import rendezvous_ports, run_distributed
from tests.gpt_run import tiny_overrides
from tests.test_resume import losses, metric_lines, only_checkpoint, rel
from tools.checkpoint_util import main as checkpoint_util

pytestmark = pytest.mark.slow

CONFIG = "configs/gpt_tiny.yaml"
SHAPE = {
    "model.num_layers": 4,
    "model.hidden_size": 32,
    "model.seq_length": 16,
    "model.max_position_embeddings": 16,
    "training.train_iters": 4,
    "training.eval_iters": 0,
    "logging.tensorboard_dir": None,
}
TP2_PP2 = {"parallel.tensor_parallel_size": 2, "parallel.pipeline_parallel_size": 2}
TP1 = {"parallel.tensor_parallel_size": 1}
DROPOUT = {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}


def _train(runs: list[list[str]]) -> None:
    """In a spawned rank: ``training.main`` of pretrain_gpt.py for each override list, one after
    another, each on its own rendezvous port (one spawn serves several runs)."""
    import pretrain_gpt
    from megatron.training.pretrain import main

    providers = pretrain_gpt.datasets_provider, pretrain_gpt.forward_step
    ports = rendezvous_ports()
    for overrides in runs:
        os.environ["MASTER_PORT"] = next(ports)
        code = main(["--config", CONFIG, *overrides], "", *providers)
        assert code == 0, overrides


def _spawn(world: int, runs: list[list[str]]) -> None:
    run_distributed(_train, world, runs, timeout=600)


def _run(gpt_data, run_dir, **extra) -> list[str]:
    keys = {**SHAPE, "data.cache_dir": run_dir.parent / "cache", **extra}
    return tiny_overrides(gpt_data, run_dir, **keys)


def test_tp2_pp2_checkpoints_load_at_any_layout_and_resume_bit_exact(gpt_data, tmp_path):
    plain, tp2 = tmp_path / "plain", tmp_path / "tp2_pp2"
    saving = {"checkpoint.save_interval": 2, "checkpoint.keep_last": 2}
    # The saved checkpoints are copied into load directories between the spawns.
    _spawn(4, [
        _run(gpt_data, tp2, **TP2_PP2, **saving, **{
            "parallel.distributed_optimizer": True, "checkpoint.save": tp2 / "ckpt",
        }),
        _run(gpt_data, plain, **TP2_PP2, **saving, **DROPOUT, **{
            "checkpoint.save": plain / "ckpt",
        }),
    ])  # fmt: skip

    ckpt = tp2 / "ckpt" / checkpoint_name(2)
    meta = read_meta(str(ckpt))
    assert (meta["tp_size"], meta["pp_size"], meta["dp_size"]) == (2, 2, 1)
    held = [{k.split(".")[2] for k in keys if ".layers." in k} for keys in meta["stages"]]
    assert held == [{"0", "1"}, {"2", "3"}]
    assert all("model/embedding.word.weight" in keys for keys in meta["stages"])  # the tied copy
    names = [shard_file(t, p, 2) for p in range(2) for t in range(2)]
    names += [optim_file(t, 0, p, 2) for p in range(2) for t in range(2)]
    assert set(names) <= set(os.listdir(ckpt)) and shard_file(0) not in os.listdir(ckpt)

    merged = tmp_path / "merged"
    assert checkpoint_util(["--input", str(ckpt), "--output", str(merged), "--merge"]) == 0
    assert read_meta(str(merged / checkpoint_name(2)))["pp_size"] == 1
    assert sorted(os.listdir(merged / checkpoint_name(2))) == ["meta.json", shard_file(0)]

    resumed, pp4, tp1, tp1_merged = (tmp_path / n for n in ("resumed", "pp4", "tp1", "tp1_merged"))
    _spawn(4, [
        _run(gpt_data, resumed, **TP2_PP2, **DROPOUT, **{
            "checkpoint.load": only_checkpoint(plain / "ckpt", 2, resumed / "load"),
        }),
        _run(gpt_data, pp4, **TP1, **{
            "parallel.pipeline_parallel_size": 4,
            "checkpoint.load": only_checkpoint(tp2 / "ckpt", 2, pp4 / "load"),
        }),
    ])  # fmt: skip
    _spawn(1, [
        _run(gpt_data, tp1, **TP1, **{
            "checkpoint.load": only_checkpoint(tp2 / "ckpt", 2, tp1 / "load"),
        }),
        _run(gpt_data, tp1_merged, **TP1, **{"checkpoint.load": merged}),
    ])  # fmt: skip

    unbroken = [e for e in metric_lines(plain / "metrics.jsonl") if e["iteration"] > 2]
    assert len(unbroken) == 2 and metric_lines(resumed / "metrics.jsonl") == unbroken
    want = losses(tp2 / "metrics.jsonl")
    for run in (pp4, tp1, tp1_merged):
        got = losses(run / "metrics.jsonl")
        assert sorted(got) == [3, 4], run
        # 3: the loaded weights; 4: also the loaded optimizer state (moments, main params).
        assert all(rel(got[i], want[i]) <= 1e-5 for i in (3, 4)), (run, got, want)
    # The merged checkpoint holds the same tensors, so the merged load's run is the direct one's.
    assert losses(tp1_merged / "metrics.jsonl") == losses(tp1 / "metrics.jsonl")
