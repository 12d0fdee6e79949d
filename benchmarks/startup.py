"""Time to the first iteration: the tiny demo model (configs/gpt_tiny.yaml at TP 1, one process)
from a fresh interpreter to its first iteration line, and the imports in it.

Each figure is a new process, as a user's run is: ``first_iteration_s`` runs pretrain_gpt.py for
one iteration on a small corpus prepared beforehand (its index caches built by an untimed run
first, as a rerun finds them), and stops the clock at the first iteration line on stdout;
``import_torch_s`` and ``import_dynamo_s`` time ``import torch`` and then ``import
torch._dynamo``, the compiler front end that ``torch.optim`` imports in every optimizer's
``add_param_group`` and in its first ``step`` (``torch._disable_dynamo``, ``_use_grad``): a cost
of torch's optimizers, not of this code. Medians over ``repeats`` runs.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_IMPORTS = (
    "import time; t = time.perf_counter(); import torch; a = time.perf_counter(); "
    "import torch._dynamo; print(a - t, time.perf_counter() - a)"
)


def _first_iteration(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from starting ``argv`` to its first iteration line; the run is then ended."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("iteration:"):
                return time.perf_counter() - start
    finally:
        proc.kill()
        proc.wait()
    raise RuntimeError(f"{' '.join(argv)} printed no iteration line")


def measure(repeats: int = 3) -> dict:
    """The start-up figures, in seconds."""
    from tests.gpt_run import prepare_gpt_data, tiny_overrides

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_gpt_data(Path(tmp))
        overrides = tiny_overrides(data, Path(tmp) / "run", **{"parallel.tensor_parallel_size": 1})
        argv = [sys.executable, "pretrain_gpt.py", "--config", "configs/gpt_tiny.yaml", *overrides]
        _first_iteration(argv, env)  # builds the index caches a rerun then finds
        first = [_first_iteration(argv, env) for _ in range(repeats)]
    imports = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", _IMPORTS], env=env, capture_output=True)
        imports.append([float(x) for x in out.stdout.split()])
    return {
        "first_iteration_s": round(statistics.median(first), 2),
        "import_torch_s": round(statistics.median(t for t, _ in imports), 2),
        "import_dynamo_s": round(statistics.median(d for _, d in imports), 2),
        "repeats": repeats,
    }
