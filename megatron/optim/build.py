"""The optimizer a run asks for: the plain mixed-precision AdamW, or the distributed one when the
data-parallel wrapper shards the optimizer state (parallel.distributed_optimizer)."""

from __future__ import annotations

from torch import nn

from megatron.config.schema import OptimizerConfig, PrecisionConfig
from megatron.optim.distributed_optimizer import DistributedOptimizer
from megatron.optim.grad_scaler import build_grad_scaler
from megatron.optim.optimizer import MainParamOptimizer, MixedPrecisionOptimizer
from megatron.parallel.data_parallel import DataParallel
from megatron.parallel.state import ParallelState


def build_optimizer(
    model: nn.Module,
    opt_cfg: OptimizerConfig,
    precision_cfg: PrecisionConfig,
    state: ParallelState,
    ddp: DataParallel | None = None,
) -> MainParamOptimizer:
    """AdamW over ``model``'s parameters with the loss scaler ``precision_cfg`` asks for: over
    this DP rank's shard when ``ddp`` shards the optimizer (parallel.distributed_optimizer)."""
    scaler = build_grad_scaler(precision_cfg)
    if ddp is not None and ddp.shard_optimizer:
        return DistributedOptimizer(ddp, opt_cfg, scaler, state)
    return MixedPrecisionOptimizer(list(model.named_parameters()), opt_cfg, scaler, state)
