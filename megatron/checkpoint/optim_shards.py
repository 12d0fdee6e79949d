"""Checkpoints of the distributed optimizer: every (TP, DP) rank's optimizer shard in its own file.

With ``parallel.distributed_optimizer`` each DP rank holds 1/DP of its TP rank's fp32 main params
and Adam moments (megatron/optim/distributed_optimizer.py). A save writes them as they lie, with
no gather over DP::

    iter_0000100/
      model_optim_tp00.safetensors          TP rank 0's weights only (no optim/ entries)
      optim_tp00_dp000.safetensors          flat main, exp_avg, exp_avg_sq of (TP 0, DP 0)
      optim_tp00_dp001.safetensors          ... of (TP 0, DP 1), written by that rank
      ...
      meta.json                             "distributed_optimizer": {"step": the one step
                                            count, "layouts": [TP rank t's shard layout, ...]}

A layout is ``DistributedOptimizer.layout()``: parameter names, TP-local shapes and offsets in
the flat buffer, the buckets' spans and the DP size; with PP > 1 the files carry the stage
(``optim_tp{t:02d}_pp{p:03d}_dp{d:03d}``) and ``layouts`` lists one per (PP, TP) rank, stage-major
(entry ``p * tp_size + t``). Loading turns TP rank t's DP shards back into per-parameter entries
with ``assemble`` (what a plain checkpoint's TP file holds under ``optim/<param>/<field>``) and
serves them under those keys: one reshard-on-load path, with the distributed optimizer or without.
With expert parallelism the expert buckets are sharded over their expert-data-parallel copies:
``assemble`` builds each EP rank's experts from its copies' shards, and the entries are served
with every EP rank's experts concatenated, as the expert files serve the weights.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor

from megatron.checkpoint.format import (
    cp_size_of,
    ep_size_of,
    open_safetensors,
    optim_file,
    pp_size_of,
)
from megatron.errors import ConfigError
from megatron.optim.distributed_optimizer import FIELDS, DistributedOptimizer, assemble
from megatron.parallel.state import ParallelState


def optim_layout(meta: dict[str, Any], pp_rank: int = 0) -> dict[str, dict[str, Any]]:
    """meta.json ``tensors`` entries for the ``optim/`` keys pipeline stage ``pp_rank``'s shards
    rebuild.

    They are the keys ``assemble`` returns: ``main`` only where the model is not fp32 (an fp32
    model's weights are its main params), the moments and ``step`` only after a step was taken.
    Each follows its parameter's weight entry (split dim, full shape, vocabulary rows), in fp32.
    """
    sharded, tensors = meta["distributed_optimizer"], meta["tensors"]
    first, step = sharded["layouts"][pp_rank * meta["tp_size"]], sharded["step"]
    fields = [f for f in FIELDS if (f != "main" or not first["main_is_param"])]
    fields = [f for f in fields if f == "main" or step > 0]
    layout: dict[str, dict[str, Any]] = {}
    for param in first["params"]:
        weight = dict(tensors[f"model/{param['name']}"])
        weight.pop("experts", None)  # served whole here, every EP rank's experts at once
        for field in fields:
            layout[f"optim/{param['name']}/{field}"] = {**weight, "dtype": "float32"}
        if step > 0:
            step_info = {"split_dim": None, "shape": [], "dtype": "int64", "vocab": False}
            layout[f"optim/{param['name']}/step"] = step_info
    return layout


def all_optim_layout(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``optim_layout`` over every saved stage (a tied parameter's entries appear once)."""
    layout: dict[str, dict[str, Any]] = {}
    for p in range(pp_size_of(meta)):
        layout.update(optim_layout(meta, p))
    return layout


def own_shard_file(meta: dict[str, Any], optimizer: Any, state: ParallelState) -> str | None:
    """The optimizer shard file this rank wrote, when the checkpoint was saved by a distributed
    optimizer at this very layout (every parallel size, and this rank's buckets and parameters):
    its flat tensors are then this rank's shard as it lies, read with no other rank's file. None
    otherwise (``OptimShards`` then reassembles and reslices)."""
    if not isinstance(optimizer, DistributedOptimizer) or not meta.get("distributed_optimizer"):
        return None
    saved = (meta["tp_size"], pp_size_of(meta), meta["dp_size"], cp_size_of(meta))
    here = (state.tp_size, state.pp_size, state.dp_size, state.cp_size)
    if saved + (ep_size_of(meta),) != here + (state.ep_size,):
        return None
    layout = meta["distributed_optimizer"]["layouts"][state.pp_rank * state.tp_size + state.tp_rank]
    if layout != json.loads(json.dumps(optimizer.layout())):
        return None
    return optim_file(state.tp_rank, state.replica_rank, state.pp_rank, state.pp_size)


class OptimShards:
    """The optimizer shard files of one saved pipeline stage of a distributed-optimizer
    checkpoint, read as a plain checkpoint's per-TP-rank ``optim/<param>/<field>`` tensors
    (``reshard.ShardedTensors`` asks for them by key and saved TP rank).

    A TP rank's entries are assembled from all its DP shards at its first read and kept: a rank
    loading at the saved TP size reads only its own TP rank's files.
    """

    def __init__(self, ckpt_dir: str, meta: dict[str, Any], pp_rank: int = 0):
        self.ckpt_dir, self.meta, self.pp_rank = ckpt_dir, meta, pp_rank
        self.layout = optim_layout(meta, pp_rank)
        self._entries: dict[int, dict[str, dict[str, Any]]] = {}

    def _read(self, tp_rank: int, dp_rank: int) -> dict[str, Any]:
        name = optim_file(tp_rank, dp_rank, self.pp_rank, pp_size_of(self.meta))
        path = os.path.join(self.ckpt_dir, name)
        if not os.path.isfile(path):
            raise ConfigError(
                f"{path} is missing: the distributed-optimizer checkpoint {self.ckpt_dir} lacks "
                f"the optimizer shard of TP rank {tp_rank}, PP rank {self.pp_rank}, DP rank "
                f"{dp_rank}; restore the file or load another checkpoint"
            )
        f = open_safetensors(path)
        try:
            shard: dict[str, Any] = {key: f.get_tensor(key) for key in FIELDS}
        except SafetensorError as e:
            raise ConfigError(f"{path}: cannot read it ({e}); the checkpoint is damaged") from None
        return {**shard, "step": self.meta["distributed_optimizer"]["step"]}

    def get(self, key: str, tp_rank: int) -> Tensor:
        """Tensor ``key`` (an ``optim/`` key of ``layout``) as saved TP rank ``tp_rank`` held it."""
        if tp_rank not in self._entries:
            index = self.pp_rank * self.meta["tp_size"] + tp_rank
            layout = self.meta["distributed_optimizer"]["layouts"][index]
            shards = [self._read(tp_rank, d) for d in range(layout["dp_size"])]
            per_ep = [assemble(layout, shards, e) for e in range(layout.get("ep_size", 1))]
            entries = per_ep[0]
            for param in layout["params"]:  # every EP rank's experts, in order
                if param.get("experts"):
                    entry = entries[param["name"]]
                    for field in set(entry) - {"step"}:
                        entry[field] = torch.cat([e[param["name"]][field] for e in per_ep])
            self._entries[tp_rank] = entries
        name, field = key.removeprefix("optim/").rsplit("/", 1)
        value = self._entries[tp_rank][name][field]
        return torch.tensor(value, dtype=torch.int64) if field == "step" else value
