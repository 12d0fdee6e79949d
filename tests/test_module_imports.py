"""Every module imports on its own, as a program's first project import.

An import cycle shows only when a module of the cycle is the first one imported (the others are
then half-initialised), so each module is imported in a process of its own. One fresh interpreter
imports the heavy third-party libraries (torch above all: a second per interpreter) and then
forks a child per module: each child starts with no project module imported. The scripts
(tools/, the entrypoints) are imported by path without running their main.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Run in the fresh interpreter: argv[1] is a JSON list of targets; prints {target: last error
# line} for those that fail.
FORK_EACH = """
import importlib, json, os, runpy, sys, traceback
import numpy, safetensors.torch, torch, yaml  # shared by every child; no project module
failed = {}
for target in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            if target.endswith(".py"):
                runpy.run_path(target, run_name="_script")  # a module not named __main__
            else:
                importlib.import_module(target)
            code = 0
        except BaseException:
            os.write(write, traceback.format_exc().strip().splitlines()[-1].encode())
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        error = pipe.read()
    if os.waitpid(pid, 0)[1] != 0:
        failed[target] = error or "the child died"
print(json.dumps(failed))
"""


def _packages() -> list[str]:
    modules = []
    for path in sorted((ROOT / "megatron").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules.append(name.removesuffix(".__init__"))
    return modules


def _scripts() -> list[str]:
    scripts = sorted((ROOT / "tools").glob("*.py")) + sorted(ROOT.glob("pretrain_*.py"))
    return [str(p) for p in scripts]


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_interpreter():
    targets = _packages() + _scripts()
    assert "megatron.config.load" in targets and str(ROOT / "tools/checkpoint_util.py") in targets
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # Another directory than the repository's: only PYTHONPATH makes the project importable.
    run = subprocess.run(
        [sys.executable, "-c", FORK_EACH, json.dumps(targets)],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert not failed, failed
