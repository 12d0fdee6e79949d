"""Loading at another TP/DP size: saved at TP=2 x DP=2 (its two shards written by two DP ranks)
and read at TP=1 and TP=2 x DP=1, saved at TP=1 and read at TP=2 (fp32, and bf16 with fp32 main
params).

Resharding only concatenates and slices, so weights and optimizer state (gathered over TP,
vocabulary padding dropped) must equal the saving run's bit for bit, and the padding rows must
be zero. Logits go through matmuls split differently across ranks, so they agree within 1e-6
relative (float reduction order), and exactly when the TP size is unchanged.
"""

import os

import pytest
import torch

from megatron.checkpoint import load_checkpoint, save_checkpoint
from megatron.checkpoint.format import read_meta
from megatron.checkpoint.reshard import merge_shards, take_shard
from megatron.checkpoint.train_state import Progress, TrainState
from megatron.parallel.state import initialize
from tests.distributed import run_distributed
from tests.test_checkpointing import (
    VOCAB,
    Records,
    build,
    gathered,
    logits,
    same,
    tiny_config,
    train,
)
from tests.test_layers import close, gather_param


def _save(cfgs, dirs, tp):
    st = initialize(tp)
    out = []
    for cfg, save_dir in zip(cfgs, dirs):
        model, optimizer, schedule, tracker = build(cfg, st)
        # The same batches on every DP rank: replicas stay equal without a DP wrapper.
        train(model, optimizer, schedule, 2, seed=0)
        progress = Progress(iteration=2, consumed_train_samples=4)
        train_state = TrainState(model, optimizer, schedule, tracker, progress)
        save_checkpoint(save_dir, train_state, cfg, st, VOCAB)
        out.append((gathered(model, optimizer, st), logits(model, st)))
    return out


def _load(cfgs, dirs, tp):
    st = initialize(tp)
    log = Records()
    out = []
    for cfg, save_dir in zip(cfgs, dirs):
        model, optimizer, schedule, tracker = build(cfg, st, seed=77)
        loaded = TrainState(model, optimizer, schedule, tracker)
        load_checkpoint(save_dir, loaded, st, VOCAB)
        progress = loaded.progress
        word = gather_param(model.embedding.word.weight.detach(), 0, st.tp_group)
        padding = [word[VOCAB:]] + [
            gather_param(entry[f].detach(), 0, st.tp_group)[VOCAB:]
            for name, entry in optimizer.state_dict()["params"].items()
            if name == "embedding.word.weight"
            for f in ("exp_avg", "exp_avg_sq", "main")
            if f in entry
        ]
        assert all(p.shape[0] > 0 and not p.any() for p in padding)
        out.append(
            (progress, gathered(model, optimizer, st), logits(model, st), schedule.num_steps)
        )
    return out, log.messages


def _check(saved, loaded, logits_tol: float | None):
    """Progress, schedule and every tensor bit-exact; logits within ``logits_tol`` (0: exact)."""
    (ref_state, ref_logits), (progress, state, out, steps) = saved, loaded
    assert progress == Progress(iteration=2, consumed_train_samples=4) and steps == 2
    assert same(state, ref_state)
    if logits_tol == 0:
        assert torch.equal(out, ref_logits)
    elif logits_tol is not None:
        close(out, ref_logits, logits_tol)


@pytest.mark.slow
def test_tp2_dp2_loads_at_tp1_and_at_tp2_dp1(tmp_path):
    cfg = tiny_config(tmp_path)
    save_dir = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 4, [cfg], [save_dir], 2)
    for rank_out in saved[1:]:
        assert same(rank_out[0][0], saved[0][0][0])  # all four ranks hold one model
    files = sorted(os.listdir(os.path.join(save_dir, "iter_0000002")))
    rng = [f"rng_rank{r:05d}.safetensors" for r in range(4)]
    assert (
        files == ["meta.json", "model_optim_tp00.safetensors", "model_optim_tp01.safetensors"] + rng
    )
    # The writes spread over DP: TP shard t comes from DP rank t % 2 (global rank dp * 2 + tp).
    writers = read_meta(os.path.join(save_dir, "iter_0000002"))["writers"]
    shards = {"model_optim_tp00.safetensors": 0, "model_optim_tp01.safetensors": 3}
    assert writers == {**shards, **{name: r for r, name in enumerate(rng)}}
    assert {writers[name] // 2 for name in shards} == {0, 1}  # two DP ranks, i.e. two nodes
    for tp in (1, 2):
        results = run_distributed(_load, tp, [cfg], [save_dir], tp)
        for loaded, _ in results:
            _check(saved[0][0], loaded[0], 0 if tp == 2 else 1e-6)
        warnings = "\n".join(results[0][1])
        assert "RNG states cannot carry over" in warnings  # DP 2 -> 1 changes the world


@pytest.mark.slow
def test_tp1_loads_at_tp2_fp32_and_bf16(tmp_path):
    cfgs = [tiny_config(tmp_path), tiny_config(tmp_path, "precision.dtype=bf16")]
    dirs = [str(tmp_path / "fp32"), str(tmp_path / "bf16")]
    saved = run_distributed(_save, 1, cfgs, dirs, 1)[0]
    assert "optim/embedding.word.weight/main" in saved[1][0]  # bf16 keeps fp32 main params
    for loaded, _ in run_distributed(_load, 2, cfgs, dirs, 2):
        _check(saved[0], loaded[0], 1e-6)
        _check(saved[1], loaded[1], None)  # bf16 logits: only the state is compared


def test_merge_and_take_shard_fix_the_vocabulary_padding():
    """100 real rows: padded to 256 at TP=2, re-split at TP=4 with 512 rows, zero past row 100."""
    real = torch.randn(100, 3)
    padded = torch.cat([real, torch.zeros(156, 3)])
    shards = list(padded.chunk(2))
    full = merge_shards(shards, 0, vocab_size=100)
    assert torch.equal(full, real)
    four = [take_shard(full, 0, 4, r, padded_rows=512) for r in range(4)]
    assert [s.shape for s in four] == [torch.Size([128, 3])] * 4
    assert torch.equal(torch.cat(four)[:100], real) and not torch.cat(four)[100:].any()
    cols = torch.randn(4, 6)
    assert torch.equal(merge_shards(list(cols.chunk(3, dim=1)), 1, None), cols)
    assert torch.equal(take_shard(cols, 1, 2, 1, None), cols[:, 3:])
    assert torch.equal(take_shard(cols, None, 2, 1, None), cols)
    with pytest.raises(ValueError, match="does not split"):
        take_shard(cols, 0, 3, 0, None)
