"""``python script.py ARGS`` and ``torchrun --standalone --nproc-per-node N script.py ARGS``, as
the suite's entrypoint runs start them, without a fresh interpreter per process.

A fresh interpreter spends about 4 CPU seconds importing torch and the compiler front end that
every torch optimizer loads, several times what a tiny model's run itself costs, and a 4-process
run starts five. Here the command runs in a child of the suite's fork server (tests/distributed.py),
which has imported them: the script runs as ``__main__`` with its argv, the caller's environment
and working directory, its stdout and stderr in files, and its exit status as the child's. With
N > 1 the child is torchrun's agent itself, with torchrun's own parser, rendezvous and error
handling; its workers are forked from it (torchrun's ``--start-method fork``) and run the script
likewise. What the command line adds beyond that, the interpreter start, is what the tests of the
launchers and the documented commands (tests/test_torchrun_errors.py,
tests/test_documented_commands.py) run as real command lines.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from tests.distributed import fork_server


def _run_script(script: str, argv: list[str]) -> None:
    """One process of the command: the script as ``__main__``."""
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def _torchrun(nproc: int, script: str, argv: list[str]) -> None:
    """torchrun's ``run`` with the script as a function entrypoint: its workers fork from this
    process instead of each starting an interpreter."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    flags = ["--standalone", "--nproc-per-node", str(nproc), "--start-method", "fork"]
    args = parse_args([*flags, script, *argv])
    # What torchrun's ``run`` sets for --standalone.
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", os.urandom(8).hex()
    args.master_port = 29500
    config, _, _ = config_from_args(args)
    elastic_launch(config=config, entrypoint=_run_script)(script, argv)


def _child(nproc: int, script: str, argv: list[str], env: dict, cwd: str, out: str, err: str):
    os.setpgid(0, 0)  # its own process group: a timeout kills the workers with it
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    code = 0
    try:
        if nproc == 1:
            _run_script(script, argv)
        else:
            _torchrun(nproc, script, argv)
    except SystemExit as e:  # what the interpreter would exit with
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_entrypoint(
    script: str, argv: list[str], nproc: int, env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess:
    """The command's exit status (negative: killed by that signal), stdout and stderr, as
    ``subprocess.run(..., capture_output=True, text=True)`` returns them; TimeoutExpired after
    ``timeout`` seconds, the command's processes killed."""
    shown = [sys.executable, script, *argv]
    if nproc > 1:
        shown = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(nproc), script, *argv]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        args = (nproc, script, argv, env, str(cwd), out, err)
        proc = fork_server().Process(target=_child, args=args)
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.join()
            raise subprocess.TimeoutExpired(shown, timeout)
        read = {path: Path(path).read_text(errors="replace") for path in (out, err)}
        return subprocess.CompletedProcess(shown, proc.exitcode, read[out], read[err])
