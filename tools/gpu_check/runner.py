"""Run the check's steps one after another under one deadline, each to its own JSON file.

A step that raises, or whose subprocess outruns its time, is recorded as failed and the next one
still runs: one broken step must not lose the others' figures.
"""

from __future__ import annotations

import json
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Deadline:
    """The wall-clock end of the whole check; steps get the smaller of their own limit and this."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def limit(self, step_seconds: float) -> float:
        """Seconds a step may take: its own limit, cut to what is left of the check."""
        return max(1.0, min(step_seconds, self.end - time.monotonic()))


@dataclass(frozen=True)
class Step:
    """One step: ``run(timeout)`` returns its figures; ``timeout`` is its share of the time."""

    name: str
    timeout: float
    run: Callable[[float], dict[str, Any]]


def run_command(cmd: list[str], timeout: float, log: Path, **kwargs: Any) -> str:
    """Run ``cmd``, appending its output to ``log``; its stdout. Raises on failure or timeout
    with the output's tail in the message, so the step's JSON says why."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        _append(log, cmd, out, "")
        raise TimeoutError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from None
    _append(log, cmd, proc.stdout, proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return proc.stdout


def _append(log: Path, cmd: list[str], stdout: str, stderr: str) -> None:
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{stdout}{stderr}\n")


def run_steps(
    steps: list[Step], out: Path, deadline: Deadline, context: dict[str, Any]
) -> list[dict[str, Any]]:
    """Each step's record (``step``, ``status`` ok/failed, ``seconds``, ``figures``, ``error``)
    written to ``out/<step>.json`` with ``context``; the records in order."""
    records = []
    for step in steps:
        start = time.monotonic()
        record: dict[str, Any] = {"step": step.name, "status": "ok", "figures": {}}
        try:
            record["figures"] = step.run(deadline.limit(step.timeout))
        except Exception as e:  # noqa: BLE001 - a failed step is data; the next step still runs
            record["status"] = "failed"
            record["error"] = f"{type(e).__name__}: {e}"
            record["traceback"] = traceback.format_exc()[-4000:]
        record["seconds"] = round(time.monotonic() - start, 2)
        (out / f"{step.name}.json").write_text(json.dumps({**record, **context}, indent=2))
        print(f"== {step.name}: {record['status']} in {record['seconds']} s", flush=True)
        records.append(record)
    return records
