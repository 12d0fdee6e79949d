"""A dataset's sidecar ``{prefix}.json``: which tokenizer made its ids, at which level, with what.

tools/preprocess_data.py and tools/merge_datasets.py write one beside each ``.bin``/``.idx``::

    {"format": "megatron-mini dataset sidecar", "format_version": 1,
     "tool": "tools/preprocess_data.py", "tool_version": "0.1.0",
     "level": "document" | "sentence", "append_eod": true,
     "tokenizer": {"type": "GPT2BPETokenizer", "family": "gpt2", "vocab_size": 50257,
                   "eod": 50256, "files_sha256": "...", "options": {...}}}

``files_sha256`` hashes the contents of the tokenizer's files (not their paths), so copies of
the same vocabulary match. Megatron never reads it: the ``.bin``/``.idx`` stay its format, and
data made by Megatron simply has none (then nothing is checked). Merging refuses datasets whose
sidecars disagree; training warns when the configured tokenizer is not the data's.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

from megatron.atomic_file import write_atomic
from megatron.config.schema import DataConfig, weighted_paths
from megatron.config.tokenizer import TokenizerConfig
from megatron.data.tokenizers.base import Tokenizer
from megatron.data.tokenizers.factory import build_tokenizer, family
from megatron.errors import ConfigError

FORMAT = "megatron-mini dataset sidecar"
FORMAT_VERSION = 1
# Options that change how text became ids but not what the ids mean: compared when merging
# (two encodings should not mix), not against a training config (which does not encode text).
ENCODING_ONLY = frozenset({"keep_extra_whitespaces", "hf_include_special_tokens"})
# The identity fields, in the order a difference is reported.
IDENTITY = ("family", "vocab_size", "eod", "files_sha256", "options")


def sidecar_path(prefix: str) -> str:
    """The sidecar of dataset ``prefix``: ``{prefix}.json``."""
    return prefix + ".json"


@cache
def tool_version() -> str:
    """This project's version (pyproject.toml), written into every sidecar."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        with open(os.path.join(root, "pyproject.toml"), "rb") as f:
            return tomllib.load(f)["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


def files_sha256(paths: Iterable[str]) -> str:
    """One SHA-256 over the contents of ``paths``, in order."""
    total = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            total.update(hashlib.file_digest(f, "sha256").digest())
    return total.hexdigest()


def tokenizer_record(type: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a sidecar says about the tokenizer of type name ``type``."""
    return {
        "type": type,
        "family": family(type),
        "vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "files_sha256": files_sha256(tokenizer.files),
        "options": dict(tokenizer.options),
    }


def write_sidecar(prefix: str, tool: str, tokenizer: dict, level: str, append_eod: bool) -> None:
    """Write ``{prefix}.json`` atomically (deterministic: no paths, no times)."""
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tool": tool,
        "tool_version": tool_version(),
        "level": level,
        "append_eod": append_eod,
        "tokenizer": tokenizer,
    }
    # One line per key: a tokenizer's 100 sentinel tokens should not take 100 lines.
    lines = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in record.items()]
    text = "{\n" + ",\n".join(lines) + "\n}\n"

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_atomic(sidecar_path(prefix), write)


def remove_sidecar(prefix: str) -> None:
    """Remove ``{prefix}.json`` if present (before its dataset is replaced)."""
    try:
        os.remove(sidecar_path(prefix))
    except FileNotFoundError:
        pass


def read_sidecar(prefix: str) -> dict[str, Any] | None:
    """The sidecar of ``prefix``, or None when it has none (e.g. made by Megatron)."""
    path = sidecar_path(prefix)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{path}: unreadable dataset sidecar ({e}); delete it or re-run"
        ) from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a dataset sidecar of this project; move it aside")
    tokenizer = record.get("tokenizer")
    if record.get("format_version") != FORMAT_VERSION or not (
        isinstance(tokenizer, dict) and {"type", *IDENTITY} <= tokenizer.keys()
    ):
        raise ConfigError(
            f"{path}: sidecar format_version {record.get('format_version')} is not "
            f"{FORMAT_VERSION} or lacks tokenizer fields; re-run tools/preprocess_data.py"
        )
    return record


def describe(tokenizer: dict) -> str:
    """``GPT2BPETokenizer (vocab 50257, eod 50256, files 1a2b3c4d)``."""
    return (
        f"{tokenizer['type']} (vocab {tokenizer['vocab_size']}, eod {tokenizer['eod']}, "
        f"files {tokenizer['files_sha256'][:8]})"
    )


def difference(a: dict, b: dict, ignore: frozenset = frozenset()) -> str | None:
    """The first identity field in which tokenizer records ``a`` and ``b`` differ, or None."""
    for key in IDENTITY:
        x, y = a.get(key), b.get(key)
        if key == "options":
            x = {k: v for k, v in (x or {}).items() if k not in ignore}
            y = {k: v for k, v in (y or {}).items() if k not in ignore}
        if x != y:
            return f"{key} {x} vs {y}" if key != "files_sha256" else "the tokenizer files differ"
    return None


def merged_sidecar(prefixes: list[str]) -> tuple[dict | None, str | None]:
    """The sidecar fields a merge of ``prefixes`` keeps, and a note when some have none.

    ConfigError (one line) when two inputs' sidecars disagree on tokenizer, level or EOD.
    """
    records = {p: read_sidecar(p) for p in prefixes}
    known = {p: r for p, r in records.items() if r is not None}
    if not known:
        return None, None
    first, ref = next(iter(known.items()))
    for prefix, record in known.items():
        why = difference(ref["tokenizer"], record["tokenizer"])
        for key in ("level", "append_eod"):
            if why is None and ref.get(key) != record.get(key):
                why = f"{key} {ref.get(key)} vs {record.get(key)}"
        if why:
            raise ConfigError(
                f"--input {prefix}: made with {describe(record['tokenizer'])}, {first} with "
                f"{describe(ref['tokenizer'])} ({why}); merge only datasets made alike"
            )
    if len(known) < len(records):
        unknown = next(p for p, r in records.items() if r is None)
        return None, (
            f"note: {unknown} has no sidecar ({unknown}.json: made elsewhere, e.g. by Megatron), "
            "so the merged dataset gets none"
        )
    return ref, None


def check_data_tokenizer(
    tokenizer_cfg: TokenizerConfig,
    data_cfg: DataConfig,
    warn: Callable[[str], None],
    tokenizer: Tokenizer | None = None,
) -> None:
    """``warn`` one line when a dataset's sidecar names another tokenizer than the config's.

    Datasets without a sidecar (made by Megatron) and hdf5 data are not checked. ``tokenizer``
    is the config's, built here when not given.
    """
    if data_cfg.format != "indexed":
        return
    found = [(p, r) for _, p in weighted_paths(data_cfg.paths) if (r := read_sidecar(p))]
    if not found:
        return
    if tokenizer is None:
        tokenizer = build_tokenizer(**vars(tokenizer_cfg))
    ours = tokenizer_record(tokenizer_cfg.type, tokenizer)
    differing = [
        (p, r, why) for p, r in found if (why := difference(r["tokenizer"], ours, ENCODING_ONLY))
    ]
    if differing:
        prefix, record, why = differing[0]
        more = f" (and {len(differing) - 1} more datasets)" if len(differing) > 1 else ""
        warn(
            f"data.paths: {prefix} was tokenized with {describe(record['tokenizer'])} but the "
            f"tokenizer section builds {describe(ours)}: {why}{more}; set tokenizer.type="
            f"{record['tokenizer']['type']} with the data's files, or re-run "
            "tools/preprocess_data.py with this tokenizer"
        )
