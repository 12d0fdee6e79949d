"""``python -m tools.gpu_check.requirements``: what the check imports is installed, or one line.

scripts/gpu_check.sh runs it before the check, with only the standard library, so a missing
package is one line and exit 2 before any step starts, not a step that fails for a reason found
only in gpu_check.log.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# module -> the package that installs it: what the steps import (pytest runs the tests step).
NEEDED = {
    "pytest": "pytest",
    "torch": "torch",
    "numpy": "numpy",
    "yaml": "pyyaml",
    "safetensors": "safetensors",
}


def missing_line() -> str | None:
    """The one line naming every missing package and the command that installs them; None."""
    missing = [pkg for module, pkg in NEEDED.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    pip = Path(sys.executable).with_name("pip")
    install = str(pip) if pip.exists() else f"{sys.executable} -m pip"
    requirements = Path(__file__).resolve().parents[2] / "requirements-dev.txt"
    are = "is" if len(missing) == 1 else "are"
    return (
        f"gpu_check: {', '.join(missing)} {are} not installed for {sys.executable}; "
        f"run: {install} install -r {requirements}"
    )


if __name__ == "__main__":
    line = missing_line()
    if line:
        print(line, file=sys.stderr)
        sys.exit(2)
