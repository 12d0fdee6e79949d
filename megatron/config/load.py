"""Loading a Config: YAML files (later wins), ``section.key=value`` overrides, type checks, and
the defaults that depend on other keys. Unknown keys get a did-you-mean; errors name file:line.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from megatron.config.schema import ALL_KEYS, FIELDS, HINTS, SECTIONS, Config, as_number
from megatron.errors import ConfigError


def _suggest(name: str, section: str | None = None) -> str:
    """'; did you mean x.y?' for a misspelt or misplaced key, else the valid choices."""
    bare = name.rsplit(".", 1)[-1]
    same = [k for k in ALL_KEYS if k.endswith("." + bare) and k != name]
    close = same or difflib.get_close_matches(name, ALL_KEYS + list(FIELDS), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]}?"
    if section in FIELDS:
        return f"; keys of {section}: {', '.join(FIELDS[section])}"
    return f"; sections: {', '.join(FIELDS)}"


def _check_key(section: str, key: str | None, where: str) -> None:
    if section not in FIELDS:
        raise ConfigError(f"{where}: unknown section '{section}'{_suggest(section)}")
    if key is not None and key not in FIELDS[section]:
        dotted = f"{section}.{key}"
        raise ConfigError(f"{where}: unknown key {dotted}{_suggest(dotted, section)}")


def _match(value: Any, ann: Any) -> tuple[bool, Any]:
    """(True, value converted to ``ann``) when it fits the annotation, else (False, None)."""
    origin = get_origin(ann)
    if origin in (Union, types.UnionType):
        fits = [_match(value, arm) for arm in get_args(ann)]
        return next(((True, v) for ok, v in fits if ok), (False, None))
    if origin is Literal:
        return isinstance(value, str) and value in get_args(ann), value
    if origin is list:
        items = [_match(v, get_args(ann)[0]) for v in value] if isinstance(value, list) else None
        return items is not None and all(ok for ok, _ in items), [v for _, v in items or ()]
    if origin is dict:  # str keys, values of the value annotation
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            return False, None
        items = {k: _match(v, get_args(ann)[1]) for k, v in value.items()}
        return all(ok for ok, _ in items.values()), {k: v for k, (_, v) in items.items()}
    if ann is type(None) or ann is bool or ann is str:
        return isinstance(value, ann), value
    if isinstance(value, bool):  # bool is an int subclass, but `true` is never a number here
        return False, None
    if ann is int:
        return isinstance(value, int), value
    if isinstance(value, str):  # PyYAML reads 1e-4 (no dot in the mantissa) as a string
        return as_number(value) is not None, as_number(value)
    number = isinstance(value, int | float)
    return number, float(value) if number else None


def _read_yaml(path: str) -> tuple[dict, dict[str, int]]:
    """The file's mapping and the line of every ``section`` and ``section.key`` in it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror}); check --config") from None
    try:
        node, data = yaml.compose(text, Loader=yaml.SafeLoader), yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must map sections (model:, training:, ...)")
    return data, _key_lines(node, path)


def _key_lines(node: yaml.Node, path: str, prefix: str = "") -> dict[str, int]:
    """The line of every dotted key under ``node``; a key given twice in one mapping is an error
    (PyYAML would keep the last and silently drop the first, a whole section at the top)."""
    lines: dict[str, int] = {}
    for key_node, value_node in node.value if isinstance(node, yaml.MappingNode) else ():
        dotted, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if dotted in lines:
            raise ConfigError(
                f"{path}:{line}: duplicate key {dotted} (first at line {lines[dotted]}); "
                "merge the two"
            )
        lines[dotted] = line
        lines.update(_key_lines(value_node, path, dotted + "."))
    return lines


# In a config file, the directory that holds it: a directory of files with their config (an
# import's checkpoint and tokenizer) can move as a whole.
CONFIG_DIR = "${config_dir}"


def _strings(value: Any, change: Callable[[str], str]) -> Any:
    """``value`` with ``change`` applied to its strings, in lists and mappings too."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, list):
        return [_strings(v, change) for v in value]
    if isinstance(value, dict):
        return {k: _strings(v, change) for k, v in value.items()}
    return value


def _in_dir(value: Any, directory: str) -> Any:
    """``value`` with ``CONFIG_DIR`` in its strings as ``directory``."""
    return _strings(value, lambda s: s.replace(CONFIG_DIR, directory))


def under_config_dir(value: Any, directory: str) -> Any:
    """The inverse, for a config file to be written into ``directory`` (absolute): its paths
    under it as ``CONFIG_DIR`` paths, so the directory can move as a whole."""

    def relative(s: str) -> str:
        inside = s == directory or s.startswith(directory + os.sep)
        return CONFIG_DIR + s[len(directory) :] if inside else s

    return _strings(value, relative)


def load_config(paths: Sequence[str], overrides: Sequence[str] = ()) -> Config:
    """Merge YAML files (later wins) and ``section.key=value`` overrides into a resolved Config;
    ``${config_dir}`` in a file's values is that file's directory."""
    return _load(
        (
            (path, _in_dir(data, os.path.dirname(os.path.abspath(path))), lines)
            for path in paths
            for data, lines in [_read_yaml(path)]
        ),
        overrides,
    )


def config_from_dict(data: dict[str, Any], where: str, overrides: Sequence[str] = ()) -> Config:
    """A Config from a nested dict (a checkpoint's saved config), then ``overrides``.

    ``where`` names the dict's source in errors (e.g. the checkpoint's meta.json).
    """
    return _load([(where, data, {})], overrides)


def _load(sources: Iterable[tuple[str, dict, dict[str, int]]], overrides: Sequence[str]) -> Config:
    """Layer each source (its path, its mapping, the line of each key) and then ``overrides``."""
    raw: dict[str, dict[str, Any]] = {name: {} for name in FIELDS}
    origin: dict[str, str] = {}  # dotted key -> where its final value came from
    for path, data, lines in sources:
        for section, values in data.items():
            # Keys YAML reads as non-strings (true, 1.0) print differently: fall back to line 1.
            where = f"{path}:{lines.get(str(section), 1)}"
            _check_key(str(section), None, where)
            if not isinstance(values, dict | None):
                raise ConfigError(f"{where}: section '{section}' must map key: value")
            for key, value in (values or {}).items():
                dotted = f"{section}.{key}"
                origin[dotted] = f"{path}:{lines.get(dotted, 1)}"
                _check_key(section, str(key), origin[dotted])
                raw[section][str(key)] = value
    for item in overrides:
        dotted, sep, text = item.partition("=")
        where = f"override '{item}'"
        if not sep or dotted.count(".") != 1:
            raise ConfigError(f"{where}: expected section.key=value, e.g. training.train_iters=100")
        section, key = dotted.split(".")
        _check_key(section, key, where)
        try:
            raw[section][key] = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(f"{where}: the value is not valid YAML; quote it") from None
        origin[dotted] = where
    return resolve(_build(raw, origin))


def _build(raw: dict[str, dict[str, Any]], origin: dict[str, str]) -> Config:
    sections = {}
    for name, cls in SECTIONS.items():
        kwargs = {}
        for key, f in FIELDS[name].items():
            dotted = f"{name}.{key}"
            if key in raw[name]:
                ok, kwargs[key] = _match(raw[name][key], HINTS[name][key])
                if not ok:
                    raise ConfigError(
                        f"{origin[dotted]}: {dotted}={raw[name][key]!r} is not of "
                        f"type {f.type}; fix the value"
                    )
                # inf or nan (.inf in YAML, 1e999) passes every range check, then skips every step
                items = kwargs[key] if isinstance(kwargs[key], list) else [kwargs[key]]
                if any(isinstance(x, float) and not math.isfinite(x) for x in items):
                    raise ConfigError(
                        f"{origin[dotted]}: {dotted}={kwargs[key]} is not a finite number; "
                        "give a finite value"
                    )
            elif f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(
                    f"{dotted} is required and no config sets it; add it under "
                    f"'{name}:' or pass {dotted}=VALUE"
                )
        sections[name] = cls(**kwargs)
    return Config(**sections)


def resolve(cfg: Config) -> Config:
    """Fill the defaults that depend on other keys, so each section is complete on its own."""
    m, t, o, d = cfg.model, cfg.training, cfg.optimizer, cfg.data
    iters = t.train_iters
    if iters is None and t.train_samples is not None and t.global_batch_size > 0:
        iters = -(-t.train_samples // t.global_batch_size)
    first = next((p for p in d.paths if isinstance(p, str)), "")

    def default(value: Any, fallback: Any) -> Any:
        return fallback if value is None else value

    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            m,
            ffn_hidden_size=default(m.ffn_hidden_size, 4 * m.hidden_size),
            max_position_embeddings=default(m.max_position_embeddings, m.seq_length),
        ),
        training=dataclasses.replace(t, train_iters=iters),
        optimizer=dataclasses.replace(o, lr_decay_iters=default(o.lr_decay_iters, iters)),
        data=dataclasses.replace(
            d, cache_dir=default(d.cache_dir, os.path.join(os.path.dirname(first), "index-cache"))
        ),
    )


DRY_RUN_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--gpu-memory-gb", {"type": float, "help": "dry run: memory of one GPU in GB (default: "
                         "the --cluster profile's)"}),
    ("--cluster", {"metavar": "NAME_OR_YAML", "help": "dry run: predict the step time on this "
                   "cluster (dgx2h-v100, dgx-a100-80gb, dgx-h100, dgx-h200, or a profile file)"}),
    ("--nodes", {"type": int, "help": "dry run, --plan: nodes of --cluster (world = nodes x "
                 "GPUs per node)"}),
    ("--json", {"action": "store_true", "help": "dry run: the whole report as one JSON object"}),
    ("--plan", {"action": "store_true", "help": "search the layouts that fit --nodes of "
                "--cluster; print the five fastest"}),
)  # fmt: skip


def parse_args(argv: Sequence[str], description: str = "") -> tuple[Config, argparse.Namespace]:
    """``--config a.yaml [--config b.yaml] [section.key=value ...]`` plus the dry-run flags."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--config",
        action="append",
        required=True,
        metavar="YAML",
        help="config file; repeat to layer files (later wins)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="override one key; the value is YAML (e.g. optimizer.lr=3.0e-4)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate and estimate memory and FLOPs; start nothing",
    )
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="run every check training runs before its first collective (config, paths, data) "
        "for --world-size, then exit: 0 clean, 2 with the one-line error",
    )
    parser.add_argument(
        "--world-size", type=int, help="dry run, preflight: the world size to check for"
    )
    for flag, kwargs in DRY_RUN_FLAGS:
        parser.add_argument(flag, **kwargs)
    args = parser.parse_intermixed_args(list(argv))
    return load_config(args.config, args.overrides), args
