"""The CUDA subset of the tests (tests/test_cuda_paths.py) on the plan's device; counts by name."""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from tools.gpu_check.environment import ROOT
from tools.gpu_check.runner import run_command

TESTS = "tests/test_cuda_paths.py"


def run_tests(device: str, scratch: Path, timeout: float, log: Path) -> dict[str, Any]:
    """pytest on ``TESTS`` with ``MEGATRON_TEST_DEVICE=device``; passed/failed/skipped counts.

    A failing test makes the step fail (after the counts are read), so the summary shows it.
    """
    report = scratch / "tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        TESTS,
        f"--junitxml={report}",
    ]
    env = {**os.environ, "MEGATRON_TEST_DEVICE": device}
    error = None
    try:
        run_command(cmd, timeout, log, cwd=ROOT, env=env)
    except RuntimeError as e:  # pytest exits 1 on a failed test: the report still says which
        error = e
    if error is not None and not report.exists():  # pytest stopped before any test ran
        raise error
    cases = ET.parse(report).getroot().iter("testcase")
    outcome: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for case in cases:
        name = case.get("name", "?")
        if case.find("failure") is not None or case.find("error") is not None:
            outcome["failed"].append(name)
        elif case.find("skipped") is not None:
            outcome["skipped"].append(name)
        else:
            outcome["passed"].append(name)
    figures = {
        "tests": TESTS,
        "device": device,
        **{k: len(v) for k, v in outcome.items()},
        "names": outcome,
    }
    if error is not None or outcome["failed"] or not outcome["passed"]:
        raise RuntimeError(f"{len(outcome['failed'])} failed: {outcome['failed']}; {figures}")
    return figures
