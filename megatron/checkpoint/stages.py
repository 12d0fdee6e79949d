"""A checkpoint's tensors across its pipeline stages: any key, read from the stage that saved it.

A stage's state dict uses the whole model's names (transformer layers keep their global index),
so the stages of a checkpoint saved at PP = a hold disjoint parts of one key space, with one
exception: the last stage's copy of the tied word table (``embedding.word.weight``, and its
optimizer state), equal to the first stage's at every step. meta.json's ``stages`` lists the
keys of each stage's files; a key is read from the first saved stage that holds it, so the tied
copy is always loaded from the first stage's word embedding and the saved last-stage copy is
never read. A rank of any PP size then asks for the keys its own stage holds, through the same
TP-reshard path (``reshard.ShardedTensors``) as at PP = 1::

    saved PP=2:  stage 0 {embedding.*, layers.0-1}      stage 1 {layers.2-3, final norm, word*}
    load  PP=4:  stage 0 <- embedding.*, layers.0 from saved stage 0; ...; stage 3 <- layers.3,
                 final norm from saved stage 1, word* (the tied copy) from saved stage 0
"""

from __future__ import annotations

import os
from typing import Any

from torch import Tensor

from megatron.checkpoint.format import pp_size_of, stage_expert_files, stage_files
from megatron.checkpoint.optim_shards import OptimShards
from megatron.checkpoint.read_through import FileClaims
from megatron.checkpoint.reshard import ShardedTensors


class StagedTensors:
    """Every saved stage's ``ShardedTensors``, read by key: ``read`` goes to the key's holder."""

    def __init__(
        self,
        stages: list[ShardedTensors],
        checksums: dict[str, str] | None = None,
        claims: FileClaims | None = None,
    ):
        self.stages = stages
        self.checksums, self.claims = checksums, claims  # for ``plan``: meta.json's ``files``
        self.holder: dict[str, int] = {}
        self.layout: dict[str, dict[str, Any]] = {}
        for p, stage in enumerate(stages):  # in saved order; the first stage holding a key wins
            for key, info in stage.layout.items():
                if key not in self.holder:
                    self.holder[key], self.layout[key] = p, info

    def read(self, key: str, tp_size: int, tp_rank: int, padded_rows: int | None) -> Tensor:
        """Tensor ``key`` as rank ``tp_rank`` of ``tp_size`` holds it (``ShardedTensors.read``)."""
        return self.stages[self.holder[key]].read(key, tp_size, tp_rank, padded_rows)

    def plan(
        self, wanted: dict[str, Tensor | None], tp_size: int, tp_rank: int, padded: int | None
    ) -> None:
        """``ShardedTensors.plan`` on each saved stage for the keys it holds; then the hashing
        thread waiting on ``claims`` may start on the files no read verifies."""
        try:
            for p, stage in enumerate(self.stages):
                mine = {k: t for k, t in wanted.items() if self.holder.get(k) == p}
                stage.plan(mine, tp_size, tp_rank, padded, self.checksums, self.claims)
        finally:
            if self.claims is not None:
                self.claims.planned.set()


def open_checkpoint(
    ckpt_dir: str, meta: dict[str, Any], with_optim: bool, claims: FileClaims | None = None
) -> StagedTensors:
    """The tensors of checkpoint ``ckpt_dir``; ``with_optim``: a distributed-optimizer
    checkpoint's ``optim/`` keys too, rebuilt from its shard files (a plain checkpoint's TP files
    hold them already). Opens nothing yet: files are opened at their first read, or by ``plan``,
    which checks the files ``claims`` grants it against meta.json as it reads them."""
    stages = []
    # Each saved stage's keys; saved before PP: one stage, all of ``tensors``.
    saved_keys = meta.get("stages") or [list(meta["tensors"])]
    sharded = with_optim and meta.get("distributed_optimizer")
    for p, keys in zip(range(pp_size_of(meta)), saved_keys):
        shards = OptimShards(ckpt_dir, meta, p) if sharded else None
        layout = {k: meta["tensors"][k] for k in keys}
        layout.update(shards.layout if shards is not None else {})
        paths = [os.path.join(ckpt_dir, name) for name in stage_files(meta, p)]
        experts = [
            ShardedTensors([os.path.join(ckpt_dir, n) for n in names], layout, meta["vocab_size"])
            for names in stage_expert_files(meta, p)
        ]
        stages.append(ShardedTensors(paths, layout, meta["vocab_size"], shards, experts))
    return StagedTensors(stages, meta["files"], claims)
