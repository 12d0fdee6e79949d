"""Process-group setup: one rank grid, sliced into tensor-, context-, pipeline- and data-parallel
groups.

The grid is ``arange(world).view(dp, pp, cp, tp)``: TP innermost (adjacent ranks, so a TP group
stays inside a node where NVLink is), context parallelism next (its ring of K/V blocks stays in a
node or spans adjacent ones), pipeline stages next, DP outermost. For 8 ranks at tp=2, pp=2:

    grid[dp=0] = [[0 1]    stage 0        grid[dp=1] = [[4 5]    stage 0
                  [2 3]]   stage 1                      [6 7]]   stage 1

    TP groups (same dp, pp, cp):     [0 1] [2 3] [4 5] [6 7]
    PP groups (same dp, cp, tp):     [0 2] [1 3] [4 6] [5 7]
    DP groups (same pp, cp, tp):     [0 4] [1 5] [2 6] [3 7]
    model-parallel (same dp, cp):    [0 1 2 3] [4 5 6 7]     (the gradient norm's sum)
    embedding (first + last stage):  [0 2] [1 3] [4 6] [5 7] (tied word-embedding gradients)

With cp=2 at tp=2 (and pp=1), ranks [0 1 2 3] are one DP replica: CP groups [0 2] [1 3] each
split every sample's sequence; the weights are replicas over DP x CP (groups [0 2 4 6] [1 3 5 7]
at dp=2), which the gradients are reduced over and the distributed optimizer shards over.

Expert parallelism (``ep``) splits the experts of MoE layers over the DP x CP ranks of each
(stage, TP rank) position: in replica order (DP major, CP minor) each run of ``ep`` consecutive
replicas is an EP group, holding 1/ep of the experts each and exchanging tokens; the replicas at
the same place in their EP groups hold copies of the same experts (the expert-data-parallel
group, DP x CP / ep ranks), over which expert gradients are reduced. At dp=4, ep=2 (tp=pp=cp=1):
EP groups [0 1] [2 3], expert-data-parallel groups [0 2] [1 3].

A rank's place in the grid is its (DP index, stage, CP rank, TP rank). Which ranks hold copies of
the same values (the replicas a loss is averaged over, the one rank of a replica that reports its
metrics) is this module's to say. Peer liveness (the heartbeat) is ``megatron.launch.heartbeat``'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.parallel.launcher import attempt_prefix, launcher_env
from megatron.parallel.pipeline.p2p import PipelineGroup


@dataclass(frozen=True)
class ParallelState:
    """Where this process sits in the grid, and the groups it talks through."""

    rank: int
    world_size: int
    local_rank: int
    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup
    dp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup
    device: torch.device
    pp_size: int = 1
    pp_rank: int = 0  # this process's pipeline stage
    pp_group: dist.ProcessGroup | None = None
    pp_ranks: tuple[int, ...] = (0,)  # global ranks of this pipeline's stages, in stage order
    # TP x PP: the ranks that together hold one replica of the model (the gradient norm's sum).
    mp_group: dist.ProcessGroup | None = None
    # This pipeline's first and last stage (same TP rank): the tied word embedding's two copies.
    # None on the other stages and without pipeline parallelism.
    embedding_group: dist.ProcessGroup | None = None
    # The whole world over gloo, for host values (the memory figures): no device in the way.
    host_group: dist.ProcessGroup | None = None
    cp_size: int = 1
    cp_rank: int = 0  # this process's place in its ring (``megatron.parallel.context_parallel``)
    cp_group: dist.ProcessGroup | None = None
    cp_ranks: tuple[int, ...] = (0,)  # global ranks of this ring, in ring order
    # DP x CP: the ranks holding the same weights (same stage and TP rank), over which gradients
    # are reduced and the distributed optimizer shards. Without CP, the DP group.
    replica_group: dist.ProcessGroup | None = None
    ep_size: int = 1
    ep_rank: int = 0  # which 1/ep of each MoE layer's experts this rank holds
    ep_group: dist.ProcessGroup | None = None  # the ranks that exchange tokens (EP > 1)
    # The replicas holding the same experts (DP x CP / EP ranks), over which expert gradients are
    # reduced; None where that is one rank.
    expert_dp_group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        """True on global rank 0, the one that prints and writes shared files."""
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        """True on the pipeline stage that holds the embeddings (every rank without PP)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the stage that holds the heads and computes the loss (every rank without PP)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def replica_size(self) -> int:
        """The ranks over which the weights are copies: DP x CP."""
        return self.dp_size * self.cp_size

    @property
    def replica_rank(self) -> int:
        """This rank's place among ``replica_size``: DP index major, CP rank minor."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def grad_group(self) -> dist.ProcessGroup | None:
        """The group gradients are reduced over (DP x CP)."""
        return self.dp_group if self.cp_size == 1 else self.replica_group

    @property
    def replicas(self) -> int:
        """The model replicas that train on different data (the DP ranks): the step's losses,
        metrics and gradients are averaged over them."""
        return self.dp_size

    @property
    def expert_dp_size(self) -> int:
        """The replicas holding copies of this rank's experts: DP x CP / EP."""
        return self.replica_size // self.ep_size

    @property
    def expert_dp_rank(self) -> int:
        """This rank's place among ``expert_dp_size`` (0: the copy that counts once)."""
        return self.replica_rank // self.ep_size

    @property
    def reports_metrics(self) -> bool:
        """True on the one rank of each replica whose loss and metrics count in their sum over
        the world: TP rank 0 (the TP ranks hold the same values) of the last stage (the one that
        computes the loss). Every CP rank reports: each holds its share of the sample's loss."""
        return self.tp_rank == 0 and self.is_last_stage

    @property
    def pipeline(self) -> PipelineGroup:
        """This process's pipeline, as the schedules and their p2p see it."""
        return PipelineGroup.from_ranks(list(self.pp_ranks), self.pp_group, self.rank)

    def layer_ranges(self, num_layers: int, chunks: int = 1) -> list[range]:
        """The global indices of the transformer layers this stage holds, one range per chunk.

        Chunk c of stage s is virtual stage ``c * pp + s`` of ``pp * chunks``, each holding
        ``num_layers / (pp * chunks)`` consecutive layers: for 8 layers, pp=2 and 2 chunks,
        stage 0 holds [0, 1] and [4, 5], stage 1 [2, 3] and [6, 7].
        """
        per_chunk = num_layers // (self.pp_size * chunks)
        starts = [(c * self.pp_size + self.pp_rank) * per_chunk for c in range(chunks)]
        return [range(start, start + per_chunk) for start in starts]

    @classmethod
    def serial(cls, device: torch.device) -> ParallelState:
        """A world of one without process groups: TP layers and the optimizer then issue no
        collective (offline tools, and the serial reference inside multi-process tests)."""
        return cls(0, 1, 0, 1, 0, None, 1, 0, None, device)

    @property
    def writes_checkpoint_shard(self) -> bool:
        """Whether this rank writes its (TP, PP) rank's checkpoint shard.

        The shards are identical over DP x CP, so the shard of TP rank t in stage p is written by
        replica ``(p * tp + t) % (dp * cp)``: with several replicas (nodes) the writing spreads
        over them instead of one node pushing everything (rank 0 always writes shard (0, 0)).
        """
        owner = (self.pp_rank * self.tp_size + self.tp_rank) % self.replica_size
        return owner == self.replica_rank

    @property
    def writes_expert_shard(self) -> bool:
        """Whether this rank writes its (TP, PP, EP) rank's expert file (expert parallelism > 1):
        one of the expert-data-parallel copies, spread over them as the (TP, PP) files are."""
        owner = (self.pp_rank * self.tp_size + self.tp_rank) % self.expert_dp_size
        return self.ep_size > 1 and owner == self.expert_dp_rank


def _attempt_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """Under torchrun, the agent's store with this attempt's own prefix (None elsewhere: env://):
    without it a restarted attempt's workers read the gloo/NCCL addresses the dead ones
    published and never connect."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=False, timeout=timeout,
    )  # fmt: skip
    return dist.PrefixStore(attempt_prefix("process_groups"), agent)


def initialize(
    tp_size: int,
    timeout_minutes: float = 10.0,
    pp_size: int = 1,
    cp_size: int = 1,
    ep_size: int = 1,
) -> ParallelState:
    """Start torch.distributed (nccl on CUDA, else gloo) and build the TP/CP/PP/DP groups, for a
    world that tp * cp * pp divide (the callers' config checks tell a user who asks for another).

    With no launcher this makes a world of one over an in-memory store, so the same code path
    (collectives on size-1 groups, barriers) runs everywhere.
    """
    env = launcher_env()
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env["LOCAL_RANK"])
    grid = torch.arange(world_size).view(-1, pp_size, cp_size, tp_size)  # [dp, pp, cp, tp]
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        if world_size == 1 and "MASTER_ADDR" not in env:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            os.environ.setdefault("MASTER_ADDR", env["MASTER_ADDR"])
            os.environ.setdefault("MASTER_PORT", env["MASTER_PORT"])
            dist.init_process_group(
                backend,
                store=_attempt_store(world_size, timeout),
                rank=rank,
                world_size=world_size,
                timeout=timeout,
                device_id=device if backend == "nccl" else None,
            )
    return build_state(grid, rank, local_rank, device, timeout, ep_size)


def build_state(
    grid: torch.Tensor,
    rank: int,
    local_rank: int,
    device: torch.device,
    timeout: timedelta,
    ep_size: int = 1,
) -> ParallelState:
    """Create every group from the ``[dp, pp, cp, tp]`` grid; each rank must create all of them,
    in the same order (torch requires it of ``new_group``). ``ep_size`` divides DP x CP."""
    dp_size, pp_size, cp_size, tp_size = grid.shape
    mine: dict[str, dist.ProcessGroup | None] = {}
    ranks: dict[str, list[int]] = {}
    slicings = {
        "tp": grid.reshape(-1, tp_size),  # rows: same (dp, pp, cp)
        "pp": grid.permute(0, 2, 3, 1).reshape(-1, pp_size),  # same (dp, cp, tp)
        "dp": grid.permute(1, 2, 3, 0).reshape(-1, dp_size),  # same (pp, cp, tp)
        "mp": grid.permute(0, 2, 1, 3).reshape(dp_size * cp_size, -1),  # same (dp, cp)
    }
    if cp_size > 1:
        slicings["cp"] = grid.permute(0, 1, 3, 2).reshape(-1, cp_size)  # same (dp, pp, tp)
        # same (pp, tp), DP major and CP minor: a rank's place is its replica_rank
        slicings["replica"] = grid.permute(1, 3, 0, 2).reshape(-1, dp_size * cp_size)
    if pp_size > 1:
        slicings["embedding"] = grid[:, [0, -1]].permute(0, 2, 3, 1).reshape(-1, 2)
    replicas = grid.permute(1, 3, 0, 2).reshape(pp_size * tp_size, -1, ep_size)  # [., R / ep, ep]
    if ep_size > 1:
        slicings["ep"] = replicas.reshape(-1, ep_size)  # consecutive replicas
    if replicas.shape[1] > 1 and ep_size > 1:
        slicings["expert_dp"] = replicas.transpose(1, 2).reshape(-1, replicas.shape[1])
    for name, members in slicings.items():
        for row in members.tolist():
            group = dist.new_group(row, timeout=timeout)
            if rank in row:
                mine[name], ranks[name] = group, row
    host_group = dist.new_group(timeout=timeout, backend="gloo")
    dp_rank, pp_rank, cp_rank, tp_rank = (grid == rank).nonzero()[0].tolist()  # this rank's place
    return ParallelState(
        rank=rank,
        world_size=grid.numel(),
        local_rank=local_rank,
        tp_size=tp_size,
        tp_rank=tp_rank,
        tp_group=mine["tp"],
        dp_size=dp_size,
        dp_rank=dp_rank,
        dp_group=mine["dp"],
        device=device,
        pp_size=pp_size,
        pp_rank=pp_rank,
        pp_group=mine["pp"],
        pp_ranks=tuple(ranks["pp"]),
        mp_group=mine["mp"],
        embedding_group=mine.get("embedding"),
        host_group=host_group,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_group=mine.get("cp"),
        cp_ranks=tuple(ranks.get("cp", [rank])),
        replica_group=mine.get("replica"),
        ep_size=ep_size,
        ep_rank=(dp_rank * cp_size + cp_rank) % ep_size,
        ep_group=mine.get("ep"),
        expert_dp_group=mine.get("expert_dp"),
    )


def shutdown() -> None:
    """Tear the process group down so the process exits without a warning."""
    if dist.is_initialized():
        dist.destroy_process_group()
