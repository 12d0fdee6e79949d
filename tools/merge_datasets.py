"""Concatenate several .bin/.idx datasets into one, documents in the order given.

    python tools/merge_datasets.py --input data/part1_text_document data/part2_text_document \\
        --output-prefix data/all_text_document
    python tools/merge_datasets.py --input data/parts/ --output-prefix data/all_text_document

Each ``--input`` is a dataset prefix or, as in Megatron, a directory whose every prefix (sorted by
name) is merged. All inputs must share a token dtype, and where they have sidecars
(``{prefix}.json``, ``megatron.data.sidecar``) the same tokenizer, level and end-of-document
setting: a mismatch is refused in one line. The output is written under temporary names and
renamed when complete, with a sidecar when every input has one.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetWriter,
    data_path,
    index_path,
)
from megatron.data.sidecar import merged_sidecar, remove_sidecar, write_sidecar  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402


def directory_prefixes(directory: str) -> list[str]:
    """Every ``prefix`` in ``directory`` with both ``prefix.bin`` and ``prefix.idx``, sorted."""
    stems = {}
    for name in sorted(os.listdir(directory)):
        stem, ext = os.path.splitext(name)
        if ext in (".bin", ".idx") and os.path.isfile(os.path.join(directory, name)):
            stems.setdefault(stem, set()).add(ext)
    for stem, exts in stems.items():
        if len(exts) != 2:
            (present,) = exts
            missing = ".idx" if present == ".bin" else ".bin"
            raise ConfigError(
                f"--input {directory}: {stem}{present} has no {stem}{missing}; "
                "remove it or re-run preprocessing"
            )
    if not stems:
        raise ConfigError(f"--input {directory}: no .bin/.idx pairs in this directory")
    return [os.path.join(directory, stem) for stem in sorted(stems)]


def expand_prefixes(inputs: list[str]) -> list[str]:
    """Dataset prefixes named by ``--input``: prefixes as given, directories expanded."""
    prefixes = []
    for item in inputs:
        prefixes.extend(directory_prefixes(item) if os.path.isdir(item) else [item])
    return prefixes


def merge(
    prefixes: list[str], output_prefix: str, say: Callable[[str], None] = print
) -> IndexedDataset:
    """Write the concatenation of ``prefixes`` to ``output_prefix``; return it opened.

    ``say`` gets the one-line note when some inputs have no sidecar.
    """
    if not prefixes:
        raise ConfigError("--input: no datasets to merge")
    out = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out for p in prefixes):
        raise ConfigError(f"--output-prefix {output_prefix} is also an input; choose a new name")
    sidecar, note = merged_sidecar(prefixes)  # refuses a mismatch before any work
    if note:
        say(note)
    dtype = IndexedDataset(prefixes[0]).dtype  # also validates the first input
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for prefix in prefixes:
            writer.add_dataset(prefix)
        remove_sidecar(output_prefix)  # before the new .bin/.idx replace the data it described
    if sidecar:
        write_sidecar(
            output_prefix,
            "tools/merge_datasets.py",
            sidecar["tokenizer"],
            sidecar["level"],
            sidecar["append_eod"],
        )
    return IndexedDataset(output_prefix)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; a user mistake prints one line and returns 1."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="dataset prefixes (without .bin/.idx) or directories of them",
    )
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    args = p.parse_args(argv)
    try:
        prefixes = expand_prefixes(args.input)
        merged = merge(prefixes, args.output_prefix, lambda note: print(note, file=sys.stderr))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return e.exit_code
    print(
        f"merged {len(prefixes)} datasets: {merged.num_documents:,} documents, {len(merged):,} "
        f"sequences, {merged.num_tokens:,} tokens into {data_path(args.output_prefix)} and "
        f"{index_path(args.output_prefix)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
