"""Process-group setup: one rank grid, sliced into tensor-parallel and data-parallel groups.

The grid is ``arange(world).view(dp, tp)``. Rows are TP groups (adjacent ranks, so a TP group
stays inside a node where NVLink is); columns are DP groups (strided). For 8 ranks at tp=2:

    TP groups (rows):    [0 1] [2 3] [4 5] [6 7]
    DP groups (columns): [0 2 4 6] [1 3 5 7]

``rank // tp`` is the DP index and ``rank % tp`` the TP rank.

``Heartbeat`` names the rank at fault when a collective fails: a dead peer makes gloo fail with
an address, and a frozen one makes the collective time out after ``parallel.timeout_minutes``.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.errors import ConfigError


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

    @property
    def is_first(self) -> bool:
        """True on global rank 0, the one that prints and writes shared files."""
        return self.rank == 0

    @classmethod
    def serial(cls, device: torch.device) -> ParallelState:
        """A world of one without process groups: TP layers and the optimizer then issue no
        collective (offline tools, and the serial reference inside multi-process tests)."""
        return cls(0, 1, 0, 1, 0, None, 1, 0, None, device)


def rank_grid(world_size: int, tp_size: int) -> torch.Tensor:
    """The ``[dp, tp]`` grid of global ranks; a world that tp does not divide is a user error."""
    if tp_size < 1 or world_size % tp_size:
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp_size} does not divide the world size {world_size}; "
            f"use a divisor of {world_size} or launch a multiple of {tp_size} processes"
        )
    return torch.arange(world_size).view(world_size // tp_size, tp_size)


def launcher_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Rank/world/master settings from torchrun, from SLURM srun-per-task, or a world of one.

    torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*. Under ``srun`` with one task per GPU only
    SLURM_* is set; the master is then the first host of the job's node list.
    """
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        out = {k: env[k] for k in ("RANK", "WORLD_SIZE")}
        out["LOCAL_RANK"] = env.get("LOCAL_RANK", "0")
        out["MASTER_ADDR"] = env.get("MASTER_ADDR", "127.0.0.1")
        out["MASTER_PORT"] = env.get("MASTER_PORT", "29500")
        return out
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        master = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", ""))
        return {
            "RANK": env["SLURM_PROCID"],
            "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": master or "127.0.0.1",
            "MASTER_PORT": env.get("MASTER_PORT", "29500"),
        }
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list, via ``scontrol`` when present, else parsed here.

    Handles the compressed forms ``node[01-04,07]`` and ``a1,b2``; ``scontrol`` is preferred
    because it knows every form the scheduler emits.
    """
    if not nodelist:
        return ""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.CalledProcessError):
        pass
    # The first expression (commas inside brackets do not end it), each bracket replaced by its
    # first id: keeps suffixes and later brackets (node[01-02]-ib -> node01-ib,
    # rack[1-2]-gpu[08,10] -> rack1-gpu08).
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist).group(0)
    return re.sub(r"\[([^\]]*)\]", lambda ids: re.split(r"[-,]", ids.group(1))[0], first)


def initialize(tp_size: int, timeout_minutes: float = 10.0) -> ParallelState:
    """Start torch.distributed (nccl on CUDA, else gloo) and build the TP/DP groups.

    With no launcher this makes a world of one over an in-memory store, so the same code path
    (collectives on size-1 groups, barriers) runs everywhere.
    """
    env = launcher_env()
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env["LOCAL_RANK"])
    grid = rank_grid(world_size, tp_size)
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
                rank=rank,
                world_size=world_size,
                timeout=timeout,
                device_id=device if backend == "nccl" else None,
            )
    return build_state(grid, rank, local_rank, device, timeout)


def build_state(
    grid: torch.Tensor, rank: int, local_rank: int, device: torch.device, timeout: timedelta
) -> ParallelState:
    """Create every group from the grid; each rank must create all of them, in the same order."""
    dp_size, tp_size = grid.shape
    tp_group = dp_group = None
    for row in grid.tolist():
        group = dist.new_group(row, timeout=timeout)
        if rank in row:
            tp_group = group
    for col in grid.t().tolist():
        group = dist.new_group(col, timeout=timeout)
        if rank in col:
            dp_group = group
    return ParallelState(
        rank=rank,
        world_size=grid.numel(),
        local_rank=local_rank,
        tp_size=tp_size,
        tp_rank=rank % tp_size,
        tp_group=tp_group,
        dp_size=dp_size,
        dp_rank=rank // tp_size,
        dp_group=dp_group,
        device=device,
    )


def shutdown() -> None:
    """Tear the process group down so the process exits without a warning."""
    if dist.is_initialized():
        dist.destroy_process_group()


class Heartbeat:
    """Each rank's pulse in the rendezvous store, so that a rank whose collective failed can name
    the peer at fault.

    A daemon thread adds 1 to ``beat/<rank>`` every ``interval_s``; it goes on while the main
    thread waits inside a collective, so a rank that is merely blocked stays alive. A rank that
    leaves first writes why to ``left/<rank>``. The store is the torchrun agent's (it outlives
    every worker) or, without torchrun, the one rank 0 hosts. Each thread has its own client.
    """

    def __init__(self, rank: int, world_size: int, interval_s: float = 1.0):
        env = launcher_env()
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self.host, self.port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, args=(self._client(),), name="heartbeat", daemon=True
        )
        self._thread.start()

    def _client(self) -> dist.Store:
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=10))
        return dist.PrefixStore("megatron/heartbeat", store)

    def _beat(self, store: dist.Store) -> None:
        while not self._stop.is_set():
            try:
                store.add(f"beat/{self.rank}", 1)
            except RuntimeError:
                return  # the store's host is gone: the peers find that out for themselves
            self._stop.wait(self.interval_s)

    def lost_peers(self, beats: int = 5) -> tuple[list[str], list[str]]:
        """(stopped, left): the peers that stopped beating (dead or frozen), and those that left,
        each as "rank 3 stopped responding (...)" or "rank 2 left (why)".

        Watches the counters for ``beats`` intervals, long enough for a live rank on a busy host
        to beat at least once. An unreachable store means its host died: rank 0 without torchrun.
        """
        others = [r for r in range(self.world_size) if r != self.rank]
        stopped, left = [], []
        try:
            store = self._client()
            before = {r: store.add(f"beat/{r}", 0) for r in others}
            time.sleep(beats * self.interval_s)
            for r in others:
                if store.check([f"left/{r}"]):
                    left.append(f"rank {r} left ({store.get(f'left/{r}').decode()})")
                elif store.add(f"beat/{r}", 0) == before[r]:
                    silent = beats * self.interval_s
                    stopped.append(f"rank {r} stopped responding (no heartbeat for {silent:.0f} s)")
        except RuntimeError as err:
            host = "the torchrun agent" if _agent_store() else "rank 0"
            stopped.append(
                f"{host} stopped responding (the rendezvous store it hosts at "
                f"{self.host}:{self.port} does not answer: {str(err).splitlines()[0]})"
            )
        return stopped, left

    def blame(self, err: Exception) -> str | None:
        """The error to report if ``err`` (from a collective) comes from a dead or frozen peer;
        None if every peer still beats or left on its own (then ``err`` speaks for itself).

        For the failure path only: it takes a few seconds (``lost_peers``).
        """
        stopped, left = self.lost_peers()
        if not stopped:
            return None
        first_line = str(err).splitlines()[0] if str(err) else ""
        return (
            f"lost a peer, exiting: {'; '.join(stopped + left)}. "
            f"The failed operation: {type(err).__name__}: {first_line}"
        )

    def leave(self, reason: str) -> None:
        """Tell the peers why this rank goes (so none reports it as dead), then stop beating."""
        try:
            self._client().set(f"left/{self.rank}", reason[:300])
        except RuntimeError:
            pass  # nobody is left to tell
        self._stop.set()
        self._thread.join()


def _agent_store() -> bool:
    """True under torchrun, whose agent hosts the store the workers rendezvous through."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
