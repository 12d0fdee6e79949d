"""One host sync per training iteration, for GPT and BERT, in fp32 and fp16, and on two ranks
(with and without the distributed optimizer).

``torch.cuda.set_sync_debug_mode`` has no CPU twin, so the training process counts the calls that
make a host wait for a device: ``Tensor.item``, ``Tensor.tolist``, ``nonzero`` (method and
function) and ``Tensor.__bool__``, through counting wrappers installed on ``torch.Tensor``. The
run is the real entrypoint's ``main`` (spawned ranks: a world of one, or two) with neither
evaluation nor checkpoints, and the count is taken between the starts of consecutive iterations
(setup excluded) with the data loader's own host-side work paused: the loader builds host tensors
on any device, so its calls would never wait for one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.gpt_run import tiny_overrides
from tests.test_pretrain_bert import bert_data, bert_overrides  # noqa: F401  (a fixture)

ITERS = 4
SYNCING = ("item", "tolist", "nonzero", "__bool__")


class SyncCounter:
    """Counts syncing tensor calls while ``on``, between ``install()`` and ``uninstall()``."""

    def __init__(self) -> None:
        self.on = False
        self.count = 0
        self._originals = {name: getattr(torch.Tensor, name) for name in SYNCING}
        self._nonzero = torch.nonzero

    def install(self) -> SyncCounter:
        """Put the counting wrappers on ``torch.Tensor`` (and ``torch.nonzero``)."""
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._wrap(original))
        torch.nonzero = self._wrap(self._nonzero)
        return self

    def uninstall(self) -> None:
        """Put the originals back."""
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = self._nonzero

    def _wrap(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += self.on
            return original(*args, **kwargs)

        return counted

    def paused(self, data: Iterator) -> Iterator:
        """``data`` with counting off while it produces each batch."""
        while True:
            on, self.on = self.on, False
            try:
                batch = next(data)
            except StopIteration:
                return
            finally:
                self.on = on
            yield batch


def _syncs_per_iteration(
    model: str, overrides: list[str], optimizer: str = "MixedPrecisionOptimizer"
) -> list[int]:
    """pretrain_<model>'s ``main`` on this (spawned) rank, counting; each iteration's syncs.
    ``optimizer``: the class the run must be using."""
    import importlib

    from megatron.training import loop as train_loop
    from megatron.training import pretrain as training

    entry = importlib.import_module(f"pretrain_{model}")
    counter = SyncCounter().install()
    marks: list[int] = []
    train_step, run = train_loop.TrainLoop.train_step, train_loop.TrainLoop.run

    def marked_step(self: Any, data: Iterator, policy: Any) -> Any:
        assert type(self.train.optimizer).__name__ == optimizer
        marks.append(counter.count)
        counter.on = True
        return train_step(self, data, policy)

    def counted_run(self: Any, train_iter: Iterator, *args: Any) -> int:
        code = run(self, counter.paused(train_iter), *args)
        marks.append(counter.count)
        return code

    train_loop.TrainLoop.train_step, train_loop.TrainLoop.run = marked_step, counted_run
    argv = ["--config", f"configs/{model}_tiny.yaml", *overrides]
    providers = entry.datasets_provider, entry.forward_step
    assert training.main(argv, "", *providers, model_type=model) == 0
    return [b - a for a, b in zip(marks, marks[1:])]


QUIET = {  # no evaluation, no checkpoint: every iteration is a plain training iteration
    "training.train_iters": ITERS,
    "training.eval_iters": 0,
    "logging.tensorboard_dir": None,
    "parallel.tensor_parallel_size": 1,
}


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_one_host_sync_per_iteration(model, dtype, gpt_data, bert_data, tmp_path):  # noqa: F811
    """Four micro-batches a step (BERT's per-micro-batch masked positions included), a log line
    every iteration, fp16's loss scaler and skip check: exactly one sync, the optimizer's."""
    keys = {**QUIET, "precision.dtype": dtype}
    if model == "gpt":
        overrides = tiny_overrides(gpt_data, tmp_path, **keys)
    else:
        overrides = bert_overrides(bert_data, tmp_path, **keys)
    assert run_distributed(_syncs_per_iteration, 1, model, overrides) == [[1] * ITERS]


@pytest.mark.parametrize("tp, sharded", [(1, False), (2, False), (1, True)])
def test_two_ranks_add_no_sync(tp, sharded, gpt_data, tmp_path):
    """DP=2 (the gradient, metric and exit-flag all-reduces), TP=2 (the layers' and the norm's
    all-reduces) or DP=2 with the distributed optimizer (the gradients' reduce-scatter, the
    parameters' all-gather): collectives, none of which makes the host wait."""
    keys = {
        **QUIET,
        "parallel.tensor_parallel_size": tp,
        "parallel.distributed_optimizer": str(sharded).lower(),
    }
    overrides = tiny_overrides(gpt_data, tmp_path, **keys)
    optimizer = "DistributedOptimizer" if sharded else "MixedPrecisionOptimizer"
    counts = run_distributed(_syncs_per_iteration, 2, "gpt", overrides, optimizer)
    assert counts == [[1] * ITERS] * 2


def test_counter_sees_every_kind_of_sync():
    """The wrappers count the method and function forms, only while on, until uninstalled."""
    counter = SyncCounter().install()
    try:
        x = torch.tensor([0.0, 2.0])
        x.tolist()
        counter.on = True
        x[1].item(), x.tolist(), x.nonzero(), torch.nonzero(x), bool(x[1])
        counter.on = False
        x.tolist()
    finally:
        counter.uninstall()
    counter.on = True
    x.tolist()
    assert counter.count == 5


@pytest.mark.slow
def test_moe_one_host_sync_per_iteration(gpt_data, tmp_path):
    """A mixture of experts at TP2 with sequence parallelism, auxiliary and z losses and the
    expert bias: routing, dispatch (the grouped GEMM, offsets on the device) and the routing
    figures (in the step's all-reduce) add no sync."""
    moe = {
        "model.position_embedding_type": "rope",
        "model.normalization": "rmsnorm",
        "model.activation": "swiglu",
        "model.add_bias_linear": "false",
        "model.num_experts": 4,
        "model.moe_ffn_hidden_size": 32,
        "model.moe_shared_expert_intermediate_size": 64,
        "model.moe_aux_loss_coeff": 0.01,
        "model.moe_z_loss_coeff": 0.001,
        "model.moe_router_enable_expert_bias": "true",
        "parallel.tensor_parallel_size": 2,
        "parallel.sequence_parallel": "true",
    }
    overrides = tiny_overrides(gpt_data, tmp_path, **{**QUIET, **moe})
    assert run_distributed(_syncs_per_iteration, 2, "gpt", overrides) == [[1] * ITERS] * 2
