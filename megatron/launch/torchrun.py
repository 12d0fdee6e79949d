"""torchrun that ends as our entrypoints do: one line and the failed worker's exit code.

    python -m megatron.launch.torchrun [torchrun's arguments] pretrain_gpt.py --config ...

torchrun itself, for any failed worker, prints its own traceback and a failure table and exits 1,
so a config error (2), a full disk (4), a NaN stop (3) and a lost peer (1) look alike to a
script or scheduler. This runs torchrun's own ``parse_args`` and ``run`` in this process (every
flag, signal and log behaviour is torchrun's) and, when a worker fails, prints only the root
cause's message and exits with that worker's code (128 + n for a worker killed by signal n).

The worker's half is ``report``: an entrypoint that fails with a one-line error leaves it in the
error file torchrun gives each worker (``TORCHELASTIC_ERROR_FILE``), where torchrun reads the root
cause; under plain torchrun the line then shows in its failure table instead of a link.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

from megatron.errors import ConfigError
from megatron.parallel.launcher import launcher_env

# Set for the workers this launcher starts: it prints their one line, so they need not.
PRINTS_WORKER_ERRORS = "MEGATRON_LAUNCHER_PRINTS_ERRORS"


def report(message: str) -> bool:
    """Leave ``message`` in this worker's torchrun error file; True when this launcher will print
    it. The form is torch's own ``@record`` (its "callstack" our line): plain torchrun then shows
    the line in its failure table and copies it on without a warning."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")  # "" when torchrun keeps no log directory
    if not path:
        return False
    extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": extra}}, f)
    except OSError:  # e.g. the very disk that is full: the caller prints the line instead
        return False
    return os.environ.get(PRINTS_WORKER_ERRORS) == "1"


def exit_with(err: ConfigError) -> int:
    """An entrypoint's way out of a user mistake: every rank leaves the line for torchrun
    (whichever fails first is its root cause), rank 0 prints it unless this launcher will;
    returns the error's exit code."""
    if not report(str(err)) and int(launcher_env()["RANK"]) == 0:
        print(f"error: {err}", file=sys.stderr)
    return err.exit_code


def _blame(item: tuple[int, ProcessFailure]) -> tuple[bool, int]:
    """Sort key of (rank, failure), the root cause first. torchrun takes the earliest to the
    second, which can be a worker that left its line and was then stopped (SIGTERM) before it
    exited with its code: prefer one that torchrun did not stop. A worker killed by another
    signal (the kernel's OOM killer, an operator) is a cause, before the peers it left."""
    _, failure = item
    return failure.exitcode == -signal.SIGTERM, failure.timestamp


def _message(name: str, rank: int, failure: ProcessFailure, restarts: int) -> str:
    """The failure in one line: the worker's own, else what torchrun knows of it; with the
    restarts spent (``--max-restarts``) when there were any."""
    if os.path.isfile(failure.error_file):  # the worker's own line (ours, or any @record's)
        message = failure.message
        line = message["message"] if isinstance(message, dict) else message
    elif failure.exitcode < 0:
        line = f"{name} rank {rank} was killed by {signal.Signals(-failure.exitcode).name}"
    else:
        line = f"{name} rank {rank} exited with {failure.exitcode}; its output above says why"
    if restarts:
        line += f", after {restarts} restart{'s' * (restarts > 1)} (--max-restarts)"
    return line


def _first_node_hosts(args) -> None:
    """Under SLURM (a job step's ``SLURM_NODEID``), the first node's agent hosts the c10d
    rendezvous store (``--rdzv-conf is_host``, unless given): torchrun's own guess matches the
    endpoint against the machine's addresses, which several nodes can share (``slurmd -N``
    nodes at one NodeAddr, containers), and then whichever agent starts first hosts it, on any
    node, and a crash of that node takes every other rank's store with it."""
    node = os.environ.get("SLURM_NODEID")
    if node is None or args.standalone or args.rdzv_backend != "c10d":
        return
    if "is_host" not in args.rdzv_conf:
        host = f"is_host={int(node == '0')}"
        args.rdzv_conf = f"{args.rdzv_conf},{host}" if args.rdzv_conf else host


def main(argv: list[str]) -> int:
    """torchrun with ``argv``; 0, or the root-cause worker's exit code after its one line."""
    # torchrun's own entry (@record) enables this too: Python stacks if the launcher crashes.
    faulthandler.enable(all_threads=True)
    # Its "failed (exitcode: N) local_rank: ..." log line: the line printed below says it better.
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(lambda record: not str(record.msg).startswith("failed (exitcode"))
    os.environ[PRINTS_WORKER_ERRORS] = "1"
    args = parse_args(argv)
    _first_node_hosts(args)
    try:
        run(args)
    except ChildFailedError as err:
        rank, failure = min(err.failures.items(), key=_blame)
        print(f"error: {_message(err.name, rank, failure, args.max_restarts)}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
