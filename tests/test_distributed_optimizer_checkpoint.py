"""Checkpoints of the distributed optimizer through the real entrypoint: saved at TP=2 x DP=2 (in
the background, ``checkpoint.async_save``), each (TP, DP) rank writing its own optimizer shard,
and loaded at the same layout, at TP=2 x DP=1 with the distributed optimizer, at TP=1 x DP=1
without it, and converted by tools/checkpoint_util.py; a missing shard file is one error line.
In one process, bf16 (whose fp32 main params the shards hold) round-trips between the
distributed optimizer and the plain one, both ways.

At the same layout everything is restored (RNG states included), so the resumed run logs the
unbroken run's lines exactly. At another layout the first loss after loading is within 1e-5
relative of the unbroken run's (float reduction order: tests/test_resume.py); no dropout, since
RNG states cannot carry over to another layout.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from megatron.checkpoint import load_checkpoint, save_checkpoint
from megatron.checkpoint.format import checkpoint_name, optim_file, read_meta, shard_file
from megatron.checkpoint.optim_shards import OptimShards
from megatron.checkpoint.train_state import Progress, TrainState
from megatron.config.load import config_from_dict
from megatron.errors import ConfigError
from megatron.interop.ours import serial_model
from megatron.optim.build import build_optimizer
from megatron.parallel.data_parallel import DataParallel
from megatron.parallel.state import ParallelState
from tests.test_checkpointing import VOCAB, build, same, tiny_config
from tests.test_resume import losses, metric_lines, only_checkpoint, rel, save_lines, train
from tools.checkpoint_util import main

pytestmark = pytest.mark.slow

SERIAL = ParallelState.serial(torch.device("cpu"))
SHARDED = {"parallel.distributed_optimizer": True}
COMMON = {"training.eval_iters": 0, "checkpoint.keep_last": 3}


@pytest.fixture(scope="module")
def unbroken(gpt_data, tmp_path_factory):
    """4 iterations at TP=2 x DP=2 with the distributed optimizer, saving every 2 in the
    background: the run directory (metrics in m.jsonl, checkpoints in ckpt/)."""
    run = tmp_path_factory.mktemp("tp2dp2")
    train(gpt_data, run, 4, run / "m.jsonl", **COMMON, **SHARDED, **{
        "parallel.tensor_parallel_size": 2,
        "training.train_iters": 4,
        "checkpoint.save": run / "ckpt",
        "checkpoint.save_interval": 2,
        "checkpoint.async_save": True,
    })  # fmt: skip
    return run


def test_each_rank_writes_its_shard_and_meta_records_the_layouts(unbroken):
    ckpt = unbroken / "ckpt" / checkpoint_name(2)
    meta = read_meta(str(ckpt))
    shards = [optim_file(t, d) for t in range(2) for d in range(2)]
    assert set(shards) <= set(os.listdir(ckpt))
    # Rank (dp * 2 + tp) writes its own shard; the TP files hold the weights alone.
    assert {meta["writers"][optim_file(t, d)] for t in range(2) for d in range(2)} == {0, 1, 2, 3}
    assert all(key.startswith("model/") for key in load_file(str(ckpt / shard_file(1))))
    sharded = meta["distributed_optimizer"]
    assert sharded["step"] == 2 and [lay["dp_size"] for lay in sharded["layouts"]] == [2, 2]
    assert [e["iteration"] for e in save_lines(unbroken / "m.jsonl")] == [2, 4]


def test_resume_at_the_same_layout_is_bit_exact(unbroken, gpt_data, tmp_path):
    """From the background-written checkpoint of iteration 2: iterations 3 and 4 log the
    unbroken run's lines (losses, grad norms, learning rates), == on full-precision floats."""
    load = only_checkpoint(unbroken / "ckpt", 2, tmp_path / "load")
    out = train(gpt_data, tmp_path, 4, tmp_path / "m.jsonl", **COMMON, **SHARDED, **{
        "parallel.tensor_parallel_size": 2,
        "training.train_iters": 4,
        "checkpoint.load": load,
    })  # fmt: skip
    assert "RNG states cannot carry over" not in out
    straight = [e for e in metric_lines(unbroken / "m.jsonl") if e["iteration"] > 2]
    assert metric_lines(tmp_path / "m.jsonl") == straight and len(straight) == 2


@pytest.mark.parametrize(
    ("nproc", "tp", "extra"),
    [(1, 1, {"parallel.distributed_optimizer": False}), (2, 2, SHARDED)],
    ids=["tp1dp1-plain", "tp2dp1-distributed"],
)
def test_loads_at_another_layout_and_continues_the_loss_curve(
    unbroken, gpt_data, tmp_path, nproc, tp, extra
):
    load = only_checkpoint(unbroken / "ckpt", 2, tmp_path / "load")
    out = train(gpt_data, tmp_path, nproc, tmp_path / "m.jsonl", **COMMON, **extra, **{
        "parallel.tensor_parallel_size": tp,
        "training.train_iters": 3,
        "checkpoint.load": load,
    })  # fmt: skip
    assert "saved at TP=2 x DP=2" in out
    resumed = losses(tmp_path / "m.jsonl")
    assert sorted(resumed) == [3]
    assert rel(resumed[3], losses(unbroken / "m.jsonl")[3]) <= 1e-5


def _nonzero_sorted(tensors) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat[flat != 0].sort().values


def test_checkpoint_util_converts_to_a_plain_checkpoint(unbroken, tmp_path, capsys):
    """At TP=2 the conversion only places the shards' values: each TP file's moments hold the
    same values as that TP rank's two shard files (their bucket padding is zero). Merged to TP=1
    and split again to TP=2, the same files come back bit for bit."""
    src = unbroken / "ckpt" / checkpoint_name(2)
    plain, merged, again = tmp_path / "plain", tmp_path / "merged", tmp_path / "again"
    assert main(["--input", str(src), "--summary"]) == 0
    assert "in 4 shard files (distributed optimizer)" in capsys.readouterr().out
    assert main(["--input", str(src), "--output", str(plain), "--target-tp", "2"]) == 0
    meta = read_meta(str(plain / checkpoint_name(2)))
    assert (meta["distributed_optimizer"], meta["dp_size"]) == (None, 1)
    assert not any(name.startswith("optim_") for name in os.listdir(plain / checkpoint_name(2)))
    files = [load_file(str(plain / checkpoint_name(2) / shard_file(t))) for t in range(2)]
    for t, tensors in enumerate(files):
        shards = [load_file(str(src / optim_file(t, d))) for d in range(2)]
        for field in ("exp_avg", "exp_avg_sq"):
            ours = [v for k, v in tensors.items() if k.endswith(f"/{field}")]
            assert torch.equal(_nonzero_sorted(ours), _nonzero_sorted(s[field] for s in shards))
        assert {int(v) for k, v in tensors.items() if k.endswith("/step")} == {2}
        weights = load_file(str(src / shard_file(t)))
        assert all(torch.equal(tensors[k], v) for k, v in weights.items())
    assert main(["--input", str(src), "--output", str(merged), "--merge"]) == 0
    assert main(["--input", str(merged), "--output", str(again), "--target-tp", "2"]) == 0
    for t in range(2):
        back = load_file(str(again / checkpoint_name(2) / shard_file(t)))
        assert back.keys() == files[t].keys()
        assert all(torch.equal(back[k], files[t][k]) for k in back)


def test_a_missing_shard_file_is_one_line(unbroken, tmp_path, capsys):
    load = only_checkpoint(unbroken / "ckpt", 4, tmp_path / "load")
    ckpt = load / checkpoint_name(4)
    missing = ckpt / optim_file(1, 1)
    os.remove(missing)
    assert main(["--input", str(load), "--output", str(tmp_path / "out"), "--merge"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{missing} is missing" in err

    meta = json.loads((ckpt / "meta.json").read_text())
    cfg = config_from_dict(meta["config"], str(ckpt / "meta.json"))
    model = serial_model("gpt", cfg, meta["vocab_size"])
    serial = ParallelState.serial(torch.device("cpu"))
    with pytest.raises(ConfigError) as error:
        load_checkpoint(str(load), TrainState(model), serial, meta["vocab_size"])
    assert "\n" not in str(error.value) and f"{missing} is missing" in str(error.value)
    shutil.rmtree(load)


def _bf16(cfg, distributed: bool):
    """A bf16 tiny GPT in a world of one; its DataParallel shards the optimizer if asked."""
    model, optimizer, schedule, tracker = build(cfg, SERIAL, seed=77)
    ddp = DataParallel(model, SERIAL, 0.01, shard_optimizer=distributed)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.precision, SERIAL, ddp)
    return model, ddp, optimizer, schedule, tracker


def _state(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    for name, entry in optimizer.state_dict()["params"].items():
        out.update({f"optim/{name}/{field}": value for field, value in entry.items()})
    return out


def test_bf16_round_trips_between_distributed_and_plain(tmp_path, monkeypatch):
    """Two steps with the distributed optimizer, saved; loaded into the plain optimizer, saved
    again; loaded into the distributed one. Every weight, fp32 main param, moment and step is
    the trained state bit for bit at each stage (a world of one: no resharding, only copies);
    and from the first checkpoint straight into another distributed one."""
    cfg = tiny_config(tmp_path, "precision.dtype=bf16", "optimizer.lr_warmup_iters=0")
    model, ddp, optimizer, schedule, tracker = _bf16(cfg, True)
    for i in range(2):
        tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(i))
        model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean().backward()
        ddp.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        ddp.zero_grad_buffer()
    trained = _state(model, optimizer)
    assert "optim/embedding.word.weight/main" in trained
    rest = (cfg, SERIAL, VOCAB)
    at_2 = TrainState(model, optimizer, schedule, tracker, Progress(iteration=2))
    save_checkpoint(str(tmp_path / "a"), at_2, *rest)
    assert read_meta(str(tmp_path / "a" / checkpoint_name(2)))["distributed_optimizer"]["step"] == 2
    for distributed, load, save in [(False, "a", "b"), (True, "b", None)]:
        model, _, optimizer, schedule, tracker = _bf16(cfg, distributed)
        train_state = TrainState(model, optimizer, schedule, tracker)
        load_checkpoint(str(tmp_path / load), train_state, SERIAL, VOCAB)
        assert same(_state(model, optimizer), trained)
        if save:
            save_checkpoint(str(tmp_path / save), train_state, *rest)
    # Distributed to distributed at one layout: the rank's own shard file read as it lies, into
    # the optimizer's flat shard, never reassembled from every DP rank's file.
    monkeypatch.setattr(OptimShards, "get", lambda *_: pytest.fail("the shards were reassembled"))
    model, _, optimizer, schedule, tracker = _bf16(cfg, True)
    given: dict[str, bool] = {}
    restore = optimizer.load_shard

    def load_shard(flat, *rest):
        given.update((k, t is optimizer.shard[k]) for k, t in flat.items())
        restore(flat, *rest)

    monkeypatch.setattr(optimizer, "load_shard", load_shard)
    load_checkpoint(
        str(tmp_path / "a"), TrainState(model, optimizer, schedule, tracker), SERIAL, VOCAB
    )
    assert same(_state(model, optimizer), trained)
    assert given and all(given.values())  # the file's tensors were read into the shard itself
