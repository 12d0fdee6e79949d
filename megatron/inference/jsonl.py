"""The JSONL inputs of the inference tools: one JSON object per line, blank lines skipped."""

from __future__ import annotations

import json
import os
from typing import Any

from megatron.errors import ConfigError


def read_records(path: str, key: str, example: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of ``path``; each must be an object with
    a string ``key``. A missing file or a bad line is a ConfigError naming ``path:line``, with
    ``example`` (one well-formed line) as the fix."""
    if not os.path.isfile(path):
        raise ConfigError(
            f"--input {path}: no such file; give a JSONL file of lines like {example}"
        )
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--input {path}:{number}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise ConfigError(
                    f'--input {path}:{number}: no "{key}" string; lines look like {example}'
                )
            records.append((number, record))
    return records
