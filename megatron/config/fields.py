"""The one way a config field is declared: its default and its help text together."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any


def documented(doc: str, default: Any = MISSING, factory: Any = MISSING) -> Any:
    """A dataclass field whose help text lives in its metadata (read by ``config_reference``)."""
    return field(default=default, default_factory=factory, metadata={"doc": doc})
