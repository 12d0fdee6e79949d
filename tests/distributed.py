"""Start N real processes on CPU (gloo) and collect what each returns.

Each child gets the caller's environment as of the call, plus the torchrun one (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port), and one intra-op thread, so N
processes fit on few cores. A child's exception is re-raised in the parent with the child's
traceback.

Children are forked from multiprocessing's fork server, one clean single-threaded process per
session that imported torch (with its compiler front end, which every optimizer loads) and
megatron before any test ran: a child starts in milliseconds, where a fresh interpreter spends
seconds importing them, and, like a spawned one, shares no state with the test process.
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_ports() -> Iterator[str]:
    """In a child: the MASTER_PORT of each process group it starts one after another, each
    picked by rank 0 just before its use and shared through a store on the child's own port.

    Ports picked up front for a list of runs stay free only by luck for the minutes the list
    takes: another test's process, or any outgoing connection's ephemeral port, may take one.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(minutes=10))
    for i in itertools.count():
        if rank == 0:
            store.set(f"port{i}", str(free_port()))
        yield store.get(f"port{i}").decode()


# Imported once, in the fork server; a module that is missing is skipped there.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megatron.training.pretrain"]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def fork_server() -> Any:
    """The multiprocessing context whose processes fork from the preloaded server."""
    return _CONTEXT


def _child(
    rank: int, world_size: int, port: int, call: bytes, env: dict[str, str], out: Any
) -> None:
    # The fork server's environment is the one it started with: take the caller's first, then
    # unpickle the call, so that modules it imports read the caller's variables.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(call)
        # Plain pickle copies tensors by value; the queue's own pickler would hand over shared
        # memory that vanishes when this process exits before the parent reads it.
        out.put((rank, None, pickle.dumps(fn(*args))))
    except BaseException:
        out.put((rank, traceback.format_exc(), None))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list:
    """Run ``fn(*args)`` on ``world_size`` processes; return their results ordered by rank.

    ``fn`` must be importable (module level): children import it by name.
    """
    out = _CONTEXT.Queue()
    port = free_port()
    call, env = pickle.dumps((fn, args)), dict(os.environ)
    procs = [
        _CONTEXT.Process(target=_child, args=(r, world_size, port, call, env, out), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, err, result = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"run_distributed: no answer within {timeout:.0f} s") from None
            if err is not None:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            results[rank] = pickle.loads(result)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
