"""Write a JSONL corpus from this machine's Python standard library docstrings; no download.

    python tools/make_sample_corpus.py --output data/corpus.jsonl --size-mb 4

One document per module, class and function docstring and per block of comment lines, read from
the library's source with ``ast`` (nothing is imported or executed), in sorted file order, so the
output is the same on every run with the same Python. Each line is
``{"id": "module:qualname" or "module:#line", "text": ...}``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.atomic_file import write_atomic  # noqa: E402

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources(root: str | None = None) -> Iterator[tuple[str, str]]:
    """``(module name, path)`` of every ``.py`` file under the standard library, sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
                yield module.removesuffix(".__init__"), path


def documents(module: str, path: str, min_chars: int = 40) -> Iterator[dict]:
    """The docstrings (module, classes, functions) and comment blocks of one file.

    A comment block is a run of lines that start with ``#``, joined without the ``#``; blocks and
    docstrings shorter than ``min_chars`` characters are skipped.
    """
    try:
        with tokenize.open(path) as f:  # honours the file's coding cookie
            source = f.read()
        tree = ast.parse(source, filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return  # the test suite holds deliberately broken files
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, qualname = stack.pop(0)
        text = ast.get_docstring(node, clean=True)
        if text and len(text) >= min_chars:
            yield {"id": f"{module}:{qualname}" if qualname else module, "text": text}
        children = [
            n
            for n in ast.iter_child_nodes(node)
            if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        stack[:0] = [(n, f"{qualname}.{n.name}" if qualname else n.name) for n in children]
    block: list[str] = []
    for lineno, line in enumerate([*source.splitlines(), ""], 1):
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith("#!"):
            block.append(stripped.lstrip("#").strip())
            continue
        text = "\n".join(block).strip()
        if len(text) >= min_chars:
            yield {"id": f"{module}:#{lineno - len(block)}", "text": text}
        block = []


def iter_documents(min_chars: int = 40, root: str | None = None) -> Iterator[dict]:
    """Every document of the standard library, in a fixed order."""
    for module, path in stdlib_sources(root):
        yield from documents(module, path, min_chars)


def write_corpus(output: str, size_mb: float, min_chars: int = 40) -> tuple[int, int, bool]:
    """Write documents until ``size_mb`` MB or the library runs out; return (docs, bytes,
    whether it ran out first)."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    limit = int(size_mb * 1e6)
    count = written = 0
    ran_out = True

    def write(tmp: str) -> None:
        nonlocal count, written, ran_out
        with open(tmp, "wb") as f:
            for doc in iter_documents(min_chars):
                line = (json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8")
                if written + len(line) > limit:
                    ran_out = False
                    break
                f.write(line)
                written += len(line)
                count += 1

    write_atomic(output, write)
    return count, written, ran_out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--output", required=True, help="the JSONL file to write")
    p.add_argument("--size-mb", type=float, default=8.0, help="stop before this many MB")
    p.add_argument("--min-chars", type=int, default=40, help="skip shorter docstrings")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    args = p.parse_args(argv)
    if os.path.exists(args.output) and not args.overwrite:
        print(
            f"error: {args.output} exists; choose another --output or pass --overwrite",
            file=sys.stderr,
        )
        return 2
    count, written, ran_out = write_corpus(args.output, args.size_mb, args.min_chars)
    print(f"wrote {args.output}: {count:,} documents, {written / 1e6:.1f} MB")
    if ran_out:  # the corpus is this Python's standard library and nothing else, by design
        print(f"(the standard library holds no more than {written / 1e6:.1f} MB of documents)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
