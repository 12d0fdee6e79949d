"""Every module imports on its own, as a program's first import, in a fresh interpreter.

An import cycle shows only when a module of the cycle is the first one imported (the others are
then half-initialised), so each module gets an interpreter of its own; they run in parallel.
The scripts (tools/, the entrypoints) are imported by path without running their main.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Executes a script's module body (imports, definitions) as a module not named __main__.
BY_PATH = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='_script')"


def _packages() -> list[str]:
    modules = []
    for path in sorted((ROOT / "megatron").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules.append(name.removesuffix(".__init__"))
    return modules


def _scripts() -> list[str]:
    scripts = sorted((ROOT / "tools").glob("*.py")) + sorted(ROOT.glob("pretrain_*.py"))
    return [str(p) for p in scripts]


def _import(target: str) -> tuple[str, subprocess.CompletedProcess]:
    code = ["-c", BY_PATH, target] if target.endswith(".py") else ["-c", f"import {target}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # Another directory than the repository's: only PYTHONPATH makes the project importable.
    run = subprocess.run(
        [sys.executable, *code], cwd="/", env=env, capture_output=True, text=True, timeout=120
    )
    return target, run


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_interpreter():
    targets = _packages() + _scripts()
    assert "megatron.config_load" in targets and str(ROOT / "tools/checkpoint_util.py") in targets
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(_import, targets))
    failed = {t: r.stderr.strip().splitlines()[-1] for t, r in results if r.returncode}
    assert not failed, failed
