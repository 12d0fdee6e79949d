"""Expert parallelism: moe_tiny with its experts split over EP ranks, through pretrain_gpt's
``training.main`` in real gloo processes (20 iterations, fp32, no dropout, auxiliary and z losses
on), against one process: EP 1, 2 and 4 within DP 4, EP2 at DP2, EP2 x PP2, EP2 x TP2 (with sequence
parallelism: the experts split over TP inside each EP rank), EP2 x CP2 (EP carved from the CP
ranks), EP2 with the distributed optimizer, overlapped parameter gathers and recomputation. The
LM and auxiliary losses within 1e-5 relative, gradient norms within 1e-4 (float reduction order:
tests/test_pipeline_training.py's bounds), each layer's tokens-per-expert imbalance identical.

The exchange is counted: per MoE layer one all-to-all of the counts and two of the token rows
forward, two of the gradient rows backward, over the EP group, and no other collective.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.gpt_run import read_metrics
from tests.model_config import tiny_model_config
from tests.test_moe_training import _imbalances, _run
from tests.test_pipeline_training import _assert_same_run, _spawn
from tests.test_sequence_parallel import recorded_collectives

EP2, EP4 = {"parallel.expert_parallel_size": 2}, {"parallel.expert_parallel_size": 4}
LAYOUTS = {  # name: (world size, overrides)
    "ep2": (2, EP2),
    "ep2_cp2": (2, {**EP2, "parallel.context_parallel_size": 2}),
    "ep2_distopt": (
        2,
        {
            **EP2,
            "parallel.distributed_optimizer": True,
            "parallel.overlap_param_gather": True,
            "parallel.ddp_bucket_size_mb": 0.01,
            "model.recompute": "full",
        },
    ),
    "ep1_dp4": (4, {}),  # every rank every expert: the DP 4 the EP sizes below split
    "ep4_dp4": (4, EP4),
    "ep2_dp4": (4, EP2),
    "ep2_pp2": (4, {**EP2, "parallel.pipeline_parallel_size": 2}),
    "ep2_tp2": (
        4,
        {**EP2, "parallel.tensor_parallel_size": 2, "parallel.sequence_parallel": True},
    ),
}


@pytest.mark.slow
def test_expert_parallel_layouts_train_like_one_process(gpt_data, tmp_path):
    _spawn(1, [_run(gpt_data, tmp_path, "ref")])
    for world in (2, 4):
        runs = [_run(gpt_data, tmp_path, n, **o) for n, (w, o) in LAYOUTS.items() if w == world]
        _spawn(world, runs)
    ref = tmp_path / "ref"
    want = read_metrics(ref / "metrics.jsonl")
    for name in LAYOUTS:
        _assert_same_run(tmp_path / name / "metrics.jsonl", ref / "metrics.jsonl")
        got = read_metrics(tmp_path / name / "metrics.jsonl")
        for key in ("moe_aux_loss", "moe_z_loss"):
            assert [e[key] for e in got] == pytest.approx([e[key] for e in want], rel=1e-5), name
        assert _imbalances(tmp_path / name) == _imbalances(ref), name


def _exchange_collectives() -> tuple[list, list, int]:
    """One EP2 MoE layer's collectives forward and backward, and the EP group's size."""
    from megatron.models.moe.layer import MoELayer
    from megatron.models.moe.stats import RoutingStats
    from megatron.parallel.layers import normal_init
    from megatron.parallel.random import RNGTracker
    from megatron.parallel.state import initialize

    st = initialize(1, ep_size=2)
    tracker = RNGTracker(st.device)
    tracker.seed(0, st.tp_rank)
    cfg = tiny_model_config(
        num_experts=4, moe_ffn_hidden_size=16, activation="swiglu", add_bias_linear=False,
        moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
    )  # fmt: skip
    init = normal_init(0.1, tracker.init_generator(0))
    layer = MoELayer(cfg, st, tracker, init, init, 0, RoutingStats(cfg, st, False))
    x = torch.randn(2, 8, 32, requires_grad=True, generator=torch.Generator().manual_seed(st.rank))
    with recorded_collectives() as calls:
        y = layer(x)
        forward = [name for name, _ in calls]
        calls.clear()
        y.sum().backward()
        backward = [name for name, _ in calls]
    return forward, backward, torch.distributed.get_world_size(st.ep_group)


@pytest.mark.slow
def test_each_moe_layer_exchanges_twice_each_way():
    for forward, backward, ep in run_distributed(_exchange_collectives, 2):
        assert ep == 2
        assert forward == ["all_to_all_single"] * 3  # the counts, the rows out, the rows back
        assert backward == ["all_to_all_single"] * 2  # the gradients' two exchanges


@pytest.mark.slow
def test_expert_parallel_checkpoints_resume_and_load_at_any_ep(gpt_data, tmp_path):
    """With the expert bias on: an EP2 run stopped at iteration 10 and resumed writes the
    unbroken run's metrics lines exactly; its checkpoint of iteration 10 (expert files per EP
    rank) loads at EP4 within DP4 and at EP1 x TP2, and merged by tools/checkpoint_util.py at
    one process, and the next losses equal the unbroken run's within 1e-5. The same with the
    distributed optimizer at EP2 within DP4 (resumed exactly; loaded at one process)."""
    from tests.test_moe_training import BIAS
    from tests.test_resume import metric_lines
    from tools.checkpoint_util import main as checkpoint_util

    saved = tmp_path / "half" / "ckpt"
    exit_at_10 = {"checkpoint.save": tmp_path / "resume" / "ckpt", "training.exit_interval": 10}
    after_10 = {**BIAS, "checkpoint.load": saved, "training.exit_interval": 11}
    _spawn(2, [
        _run(gpt_data, tmp_path, "ep2", **BIAS, **EP2),
        *[_run(gpt_data, tmp_path, "resume", **BIAS, **EP2, **exit_at_10)] * 2,
        _run(gpt_data, tmp_path, "half", **BIAS, **EP2,
             **{"checkpoint.save": saved, "training.exit_interval": 10}),
        _run(gpt_data, tmp_path, "tp2_load", **after_10, **{"parallel.tensor_parallel_size": 2}),
    ])  # fmt: skip
    # The distributed optimizer at EP2 within DP4: expert states sharded over their two copies.
    dist_opt = {**BIAS, **EP2, "parallel.distributed_optimizer": True}
    dist_opt.update({"parallel.overlap_param_gather": True, "parallel.ddp_bucket_size_mb": 0.01})
    dist_saved = tmp_path / "dist_half" / "ckpt"
    exit_dist = {"checkpoint.save": tmp_path / "dist_resume" / "ckpt", "training.exit_interval": 10}
    _spawn(4, [
        _run(gpt_data, tmp_path, "ep4_load", **after_10, **EP4),
        _run(gpt_data, tmp_path, "dist", **dist_opt),
        *[_run(gpt_data, tmp_path, "dist_resume", **dist_opt, **exit_dist)] * 2,
        _run(gpt_data, tmp_path, "dist_half", **dist_opt,
             **{"checkpoint.save": dist_saved, "training.exit_interval": 10}),
    ])  # fmt: skip
    dist_after_10 = {**after_10, "checkpoint.load": dist_saved}
    _spawn(1, [_run(gpt_data, tmp_path, "dist_ep1_load", **dist_after_10)])
    dist_lines = metric_lines(tmp_path / "dist_resume" / "metrics.jsonl")
    assert dist_lines == metric_lines(tmp_path / "dist" / "metrics.jsonl")
    merged = tmp_path / "merged"  # tools/checkpoint_util.py gathers the experts into one file
    assert checkpoint_util(["--input", str(saved), "--output", str(merged), "--merge"]) == 0
    _spawn(1, [_run(gpt_data, tmp_path, "ep1_load", **{**after_10, "checkpoint.load": merged})])
    resumed = metric_lines(tmp_path / "resume" / "metrics.jsonl")
    assert resumed == metric_lines(tmp_path / "ep2" / "metrics.jsonl")
    files = sorted(p.name for p in (saved / "iter_0000010").glob("experts_*"))
    assert files == ["experts_tp00_ep000.safetensors", "experts_tp00_ep001.safetensors"]
    full = {e["iteration"]: e for e in read_metrics(tmp_path / "ep2" / "metrics.jsonl")}
    for name in ("ep1_load", "ep4_load", "tp2_load", "dist_ep1_load"):
        (line,) = read_metrics(tmp_path / name / "metrics.jsonl")
        assert line["iteration"] == 11, name
        for key in ("lm_loss", "moe_aux_loss", "grad_norm"):
            assert line[key] == pytest.approx(full[11][key], rel=1e-5), (name, key)


@pytest.mark.parametrize("tp, pp, cp, dp, ep", [(1, 1, 1, 4, 2), (2, 2, 1, 2, 2), (1, 1, 2, 4, 4)])
def test_each_checkpoint_file_has_one_writer(tp, pp, cp, dp, ep):
    """Over every rank of the grid, the files written (``files_written_by``) are disjoint and
    are each (TP, PP) file and each (TP, PP, EP) expert file once."""
    from megatron.checkpoint.format import expert_file, shard_file
    from megatron.checkpoint.save import files_written_by
    from megatron.parallel.state import ParallelState

    grid = torch.arange(dp * pp * cp * tp).view(dp, pp, cp, tp)
    written: list[str] = []
    for rank in range(grid.numel()):
        d, p, c, t = (grid == rank).nonzero()[0].tolist()
        st = ParallelState(
            rank, grid.numel(), rank, tp, t, None, dp, d, None, torch.device("cpu"), pp, p,
            cp_size=cp, cp_rank=c, ep_size=ep, ep_rank=(d * cp + c) % ep,
        )  # fmt: skip
        written += [n for n in files_written_by(st) if not n.startswith("rng_")]
    want = [shard_file(t, p, pp) for t in range(tp) for p in range(pp)]
    want += [expert_file(t, e, p, pp) for t in range(tp) for p in range(pp) for e in range(ep)]
    assert sorted(written) == sorted(want)
