"""parallel.overlap_param_gather: the distributed optimizer's parameter all-gathers run on into
the next forward, and every read of a parameter waits for its bucket first.

Every all-gather here is lazy: its values land only when it is waited for. A parameter read
before its bucket's wait would hold the previous step's values in the other DP ranks' slices, and
the run would leave the blocking one's path. So losses and parameters bit-identical to overlap
off show that each read waited: in-process at DP=2 (fp32, where the step updates the parameter
buffer in place, and bf16, where it copies the main shard back), and through the entrypoint at
PP=2 x DP=2, where the last stage reads its copy of the tied word table in the LM head without
calling the embedding, and the checkpoints it writes hold the same tensors.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megatron.launch.preflight import validate
from tests.distributed import rendezvous_ports, run_distributed
from tests.gpt_run import tiny_overrides
from tests.test_config import error_of, tiny
from tests.test_distributed_optimizer import train_tiny_gpt
from tests.test_resume import metric_lines

VOCAB, ITERS = 100, 6
# A bucket per parameter: a read is then covered only by a wait for its own parameter's bucket,
# not by another parameter's that happens to share it.
ONE_PARAMETER_BUCKETS = 4 / 2**20


class _LazyGather:
    """An all-gather that happens when waited for."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, group, gather):
        self.args, self.gather = (output, input, group), gather

    def wait(self) -> bool:
        output, input, group = self.args
        self.gather(output, input, group=group)
        return True


def _make_all_gathers_lazy() -> None:
    """From now on in this process, an asynchronous all-gather runs when waited for. (Every
    DP rank must then wait at the same points, as the forward's hooks do: a wait on some ranks
    only, such as a checkpoint writer's, would block there.)"""
    gather = dist.all_gather_single

    def lazy(output, input, group=None, async_op=False):
        if not async_op:
            return gather(output, input, group=group)
        return _LazyGather(output, input, group, gather)

    dist.all_gather_single = lazy


def _model_child() -> dict:
    from megatron.parallel.state import initialize

    _make_all_gathers_lazy()
    state = initialize(tp_size=1)
    return {
        (dtype, overlap): train_tiny_gpt(state, dtype, True, overlap, ONE_PARAMETER_BUCKETS, ITERS)
        for dtype in ("fp32", "bf16")
        for overlap in (False, True)
    }


@pytest.mark.slow
def test_overlapped_gathers_train_bit_identically_and_wait_on_first_use():
    for rank in run_distributed(_model_child, 2):
        for dtype in ("fp32", "bf16"):
            blocking, overlapped = rank[dtype, False], rank[dtype, True]
            assert overlapped["loss"] == blocking["loss"], dtype
            for name, value in blocking["params"].items():
                assert torch.equal(overlapped["params"][name], value), (dtype, name)
            assert set(blocking["pending"]) == {0}
            # Every bucket still gathering after the step; none after the next first forward
            # (every parameter of the GPT is read in it).
            assert min(overlapped["pending"]) > 1
            assert set(overlapped["left"]) == {0}


def _entrypoint_child(runs: list[list[str]]) -> None:
    import pretrain_gpt
    from megatron.training.pretrain import main

    _make_all_gathers_lazy()
    providers = pretrain_gpt.datasets_provider, pretrain_gpt.forward_step
    ports = rendezvous_ports()
    for overrides in runs:
        os.environ["MASTER_PORT"] = next(ports)
        code = main(
            ["--config", "configs/gpt_tiny.yaml", *overrides],
            "",
            *providers,
        )
        assert code == 0, overrides


@pytest.mark.slow
def test_pp2_dp2_entrypoint_runs_and_checkpoints_like_the_blocking_gather(gpt_data, tmp_path):
    shape = {
        "model.num_layers": 4,
        "model.hidden_size": 32,
        "model.seq_length": 16,
        "model.max_position_embeddings": 16,
        "parallel.tensor_parallel_size": 1,
        "parallel.pipeline_parallel_size": 2,
        "parallel.distributed_optimizer": True,
        "parallel.ddp_bucket_size_mb": ONE_PARAMETER_BUCKETS,
        "training.train_iters": ITERS,
        "training.eval_interval": 3,
        "logging.tensorboard_dir": None,
        "data.cache_dir": tmp_path / "cache",
    }
    runs = []
    for overlap in (False, True):
        run = tmp_path / f"overlap_{overlap}"
        extra = {"parallel.overlap_param_gather": overlap, "checkpoint.save": run / "ckpt"}
        runs.append(tiny_overrides(gpt_data, run, **shape, **extra))
    run_distributed(_entrypoint_child, 4, runs, timeout=120)
    blocking, overlapped = (tmp_path / f"overlap_{o}" for o in (False, True))
    lines = metric_lines(blocking / "metrics.jsonl")
    assert len(lines) > ITERS and lines == metric_lines(overlapped / "metrics.jsonl")
    files = sorted(p.name for p in (blocking / "ckpt").glob("iter_*/model*.safetensors"))
    assert len(files) == 2  # one per stage
    for name in files:
        [a] = (blocking / "ckpt").glob(f"iter_*/{name}")
        [b] = (overlapped / "ckpt").glob(f"iter_*/{name}")
        want, got = load_file(a), load_file(b)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), name


def test_overlap_without_the_distributed_optimizer_is_one_line():
    message = error_of(validate, tiny("parallel.overlap_param_gather=true"), 2, check_files=False)
    assert message.startswith("parallel.overlap_param_gather=true overlaps the distributed")
    assert "set parallel.distributed_optimizer=true too" in message
