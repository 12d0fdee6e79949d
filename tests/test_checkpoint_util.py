"""tools/checkpoint_util.py on a real TP=2 checkpoint: merge, reshard, summary, refusals.

Conversion only concatenates and slices, so TP=2 -> 1 -> 2 reproduces every tensor file's
contents exactly; the merged checkpoint loads at TP=1 with the TP=2 run's state bit for bit and
its logits within 1e-6 relative (float reduction order of the split matmuls).
"""

import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from megatron.checkpoint import find_latest, load_checkpoint, save_checkpoint
from megatron.checkpoint.format import read_meta, shard_file, verify_checkpoint
from megatron.checkpoint.train_state import Progress, TrainState
from megatron.errors import ConfigError
from megatron.parallel.state import initialize
from tests.distributed import run_distributed
from tests.test_checkpointing import VOCAB, build, gathered, logits, same, tiny_config, train
from tests.test_layers import close
from tools.checkpoint_util import main

ITER = "iter_0000002"


def _save(cfg, save_dir):
    st = initialize(2)
    model, optimizer, schedule, tracker = build(cfg, st)
    train(model, optimizer, schedule, 2, seed=0)
    train_state = TrainState(model, optimizer, schedule, tracker, Progress(iteration=2))
    save_checkpoint(save_dir, train_state, cfg, st, VOCAB)
    return gathered(model, optimizer, st), logits(model, st)


def _load(cfg, save_dir):
    st = initialize(1)
    model, optimizer, schedule, tracker = build(cfg, st, seed=77)
    load_checkpoint(save_dir, TrainState(model, optimizer, schedule, tracker), st, VOCAB)
    return gathered(model, optimizer, st), logits(model, st)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """A TP=2 checkpoint, the config it was made with, and the saving run's state and logits."""
    root = tmp_path_factory.mktemp("tp2")
    cfg = tiny_config(root)
    state, out = run_distributed(_save, 2, cfg, str(root / "ckpt"))[0]
    return root / "ckpt", cfg, state, out


def tensors(save_dir, tp: int) -> dict[str, torch.Tensor]:
    """Every tensor of every shard file, keyed by (file, key)."""
    out = {}
    for t in range(tp):
        for key, value in load_file(str(save_dir / ITER / shard_file(t))).items():
            out[f"{t}:{key}"] = value
    return out


@pytest.mark.slow
def test_merge_and_reshard_round_trip_exactly(tp2, tmp_path, capsys):
    src, cfg, ref_state, ref_logits = tp2
    merged, back, four, again = (tmp_path / n for n in ("merged", "tp2", "tp4", "merged_again"))
    assert main(["--load", str(src), "--summary"]) == 0  # --load: the other tools' spelling
    assert main(["--input", str(src), "--output", str(merged), "--merge"]) == 0
    assert sorted(os.listdir(merged)) == [ITER, "latest"] and find_latest(str(merged)) == 2
    assert sorted(os.listdir(merged / ITER)) == ["meta.json", shard_file(0)]
    meta = read_meta(str(merged / ITER))
    assert (meta["tp_size"], meta["padded_vocab_size"], meta["rng"]) == (1, 128, False)
    assert meta["tensors"]["model/embedding.word.weight"]["shape"] == [128, 32]
    assert meta["config"]["parallel"]["tensor_parallel_size"] == 1
    assert verify_checkpoint(str(merged / ITER)) is None

    assert main(["--input", str(merged), "--output", str(back), "--target-tp", "2"]) == 0
    assert same(tensors(back, 2), tensors(src, 2))
    assert main(["--input", str(src / ITER), "--output", str(four), "--target-tp", "4"]) == 0
    assert read_meta(str(four / ITER))["padded_vocab_size"] == 512
    assert main(["--input", str(four), "--output", str(again), "--merge"]) == 0
    assert same(tensors(again, 1), tensors(merged, 1))

    capsys.readouterr()
    assert main(["--input", str(src), "--summary", "--tensors"]) == 0
    out = capsys.readouterr().out
    for text in (
        "iteration   2",
        "TP=2 x PP=1 x DP=1",
        "vocab       100 (padded 256)",
        "checksums   ok",
    ):
        assert text in out
    assert "model/embedding.word.weight" in out and "[256, 32]" in out

    state, out_logits = run_distributed(_load, 1, cfg, str(merged))[0]
    assert same(state, ref_state)
    close(out_logits, ref_logits, 1e-6)


def _group_rows(out: str) -> dict[str, list[str]]:
    """The summary's group table: group name -> its tensors, elements, bytes (and layers)."""
    table = [re.split(r"\s{2,}", row.strip()) for row in out.split("  group ", 1)[1].splitlines()]
    return {cells[0]: cells[1:] for cells in table[1:]}


@pytest.mark.slow
def test_summary_is_per_group_and_weights_only_merge_drops_the_optimizer(tp2, tmp_path, capsys):
    src, cfg, ref_state, _ = tp2
    layout = read_meta(str(src / ITER))["tensors"]
    capsys.readouterr()
    assert main(["--input", str(src), "--summary"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 25 and "model/" not in out and "optim/" not in out
    rows = _group_rows(out)
    assert rows["embedding.word"] == ["1", "8,192", "32,768"]  # [256, 32] fp32
    attention = [k for k in layout if k.startswith("model/") and ".attention." in k]
    assert rows["transformer.layers.*.attention"][0] == str(len(attention))
    assert rows["transformer.layers.*.attention"][-1] == "over 2 layers"
    assert {"optimizer exp_avg", "optimizer exp_avg_sq", "optimizer step"} <= rows.keys()
    assert sum(int(r[0]) for r in rows.values()) == len(layout)

    merged = tmp_path / "weights"
    argv = ["--input", str(src), "--output", str(merged), "--merge", "--weights-only"]
    assert main(argv) == 0
    assert "checkpoint.finetune=true" in capsys.readouterr().out
    meta = read_meta(str(merged / ITER))
    assert meta["weights_only"] and meta["tp_size"] == 1
    assert verify_checkpoint(str(merged / ITER)) is None
    assert all(k.startswith("model/") for k in meta["tensors"])
    assert sorted(load_file(str(merged / ITER / shard_file(0)))) == sorted(meta["tensors"])
    assert main(["--input", str(merged), "--summary"]) == 0
    assert "0 optimizer tensors (weights only)" in capsys.readouterr().out
    weights = run_distributed(_load_weights, 1, cfg, str(merged))[0]
    assert same(weights, {k: v for k, v in ref_state.items() if k.startswith("model")})


def _load_weights(cfg, save_dir):
    """A fine-tune's load (weights only), then the full resume that must refuse the file."""
    st = initialize(1)
    model, optimizer, schedule, tracker = build(cfg, st, seed=77)
    train_state = TrainState(model, optimizer, schedule, tracker)
    load_checkpoint(save_dir, train_state, st, VOCAB, finetune=True)
    with pytest.raises(ConfigError, match="holds weights only, no optimizer state"):
        load_checkpoint(save_dir, train_state, st, VOCAB)
    return {k: v for k, v in gathered(model, optimizer, st).items() if k.startswith("model")}


@pytest.mark.slow
def test_refuses_damaged_input_and_impossible_targets(tp2, tmp_path, capsys):
    src = tp2[0]
    damaged = tmp_path / "damaged"
    shutil.copytree(src, damaged)
    with open(damaged / ITER / shard_file(1), "r+b") as f:
        f.seek(100)
        f.write(b"\0\1\2\3")
    capsys.readouterr()
    assert main(["--input", str(damaged), "--summary"]) == 0
    assert "checksums   FAILED" in capsys.readouterr().out
    taken, a_file = tmp_path / "outputs" / "taken", tmp_path / "outputs" / "a_file"
    taken.mkdir(parents=True)
    (taken / "notes.txt").write_text("the user's\n")
    a_file.write_text("")
    cases = {
        ("--input", str(src), "--output", str(taken), "--merge"): "already exists",
        ("--input", str(src), "--output", str(a_file), "--merge"): "already exists",
        ("--input", str(damaged), "--output", str(tmp_path / "o1"), "--merge"): "xxh3_128 checksum",
        ("--input", str(src), "--output", str(tmp_path / "o2"), "--target-tp", "3"): "divide",
        ("--input", str(src), "--output", str(src), "--merge"): "holds the input",
        ("--input", str(tmp_path / "nowhere"), "--summary"): "no such directory",
        ("--input", str(tmp_path), "--summary"): "holds no checkpoint (it holds damaged/",
        ("--input", str(src), "--iteration", "7", "--summary"): "no checkpoint of iteration 7",
    }
    for argv, message in cases.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert os.listdir(taken) == ["notes.txt"]
    with pytest.raises(SystemExit):
        main(["--input", str(src)])
    with pytest.raises(SystemExit):
        main(["--input", str(src), "--summary", "--weights-only"])
