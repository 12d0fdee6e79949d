"""What ran the check: device, library versions and the commit, so each JSON file stands alone."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def git_commit() -> str | None:
    """HEAD of the checkout, with ``-dirty`` when the work tree has changes; None without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None  # a copy of the tree without its .git (the device machine may get one)
    return head + ("-dirty" if dirty else "")


def device_name() -> str:
    """``torch.cuda.get_device_name()`` of GPU 0, or ``cpu``."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def describe() -> dict[str, Any]:
    """The environment block every step file carries."""
    info: dict[str, Any] = {
        "device": device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "git_commit": git_commit(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu_memory_gib"] = props.total_memory / 2**30
        info["compute_capability"] = f"{props.major}.{props.minor}"
    return info
