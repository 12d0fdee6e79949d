"""The JSONL files of the inference tools: inputs of one JSON object per line (blank lines
skipped), and the --output file they write, checked before any work."""

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


def check_output(path: str) -> None:
    """``--output path`` can be written as a file: it is not a directory and its directory
    exists; a ConfigError naming the fix before anything is loaded."""
    if os.path.isdir(path):
        name = os.path.join(path, "out.jsonl")
        raise ConfigError(f"--output {path}: a directory; name a file to write, e.g. {name}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ConfigError(f"--output {path}: its directory does not exist; create it")
