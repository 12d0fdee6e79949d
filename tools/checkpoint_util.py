"""Inspect a checkpoint, or convert it offline to another TP size or into one unsharded file.

    python tools/checkpoint_util.py --input runs/gpt/checkpoints --summary [--tensors]
    python tools/checkpoint_util.py --input runs/gpt/checkpoints --output runs/gpt/tp4 --target-tp 4
    python tools/checkpoint_util.py --input runs/gpt/checkpoints --output runs/gpt/merged --merge \
        [--weights-only]

``--input`` is a save directory (the checkpoint its ``latest`` names, or ``--iteration N``) or one
``iter_*`` directory. ``--summary`` counts tensors, elements and bytes per group (the embedding,
each kind of sublayer over all layers, each kind of optimizer state); ``--tensors`` lists every
tensor instead. ``--output`` (new, or an empty directory) becomes a save directory holding one
complete checkpoint (meta.json with checksums, ``latest``), to be used as ``checkpoint.load`` at
the target TP size; ``--merge`` is ``--target-tp 1``: a single tensor file. A checkpoint of
several pipeline stages (one file per (TP, PP) rank) is always merged across them: the output is
at PP = 1, each tensor read from the stage that saved it, as training's load reads it
(megatron.checkpoint.stages; the tied word table from the first stage); training loads either at
any PP size. Model weights and optimizer state are converted exactly; RNG states belong to the
old world, so a run resuming from the output reseeds them from (seed, iteration), with a
warning. ``--weights-only`` drops the optimizer state (meta.json says ``weights_only``): the
output is a starting point for ``checkpoint.finetune=true`` and for inference and export
(tools/generate.py, tools/export_hf.py), and a full resume refuses it.

A checkpoint of the distributed optimizer (``parallel.distributed_optimizer``: one optimizer
shard file per TP, PP and DP rank) is read through the same path as training's load: each TP rank's
state is rebuilt from its DP shards. The output is a plain checkpoint (the optimizer state in the
TP files, meta.json without ``distributed_optimizer``), which loads with the distributed optimizer
or without it, at any DP size.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint import (
    find_checkpoint,  # noqa: E402
    save_offline,  # noqa: E402
)
from megatron.checkpoint.format import (  # noqa: E402
    pp_size_of,
    read_meta,
    shard_file,
    verify_checkpoint,
)
from megatron.checkpoint.optim_shards import all_optim_layout  # noqa: E402
from megatron.checkpoint.stages import open_checkpoint  # noqa: E402
from megatron.config.schema import padded_vocab_size  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from megatron.interop.staging import check_output  # noqa: E402
from megatron.launch.torchrun import exit_with  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--input",
        "--load",
        dest="input",
        required=True,
        help="a save directory or one iter_* directory (--load, as the other tools spell it)",
    )
    p.add_argument("--iteration", type=int, help="with a save directory: this checkpoint")
    p.add_argument(
        "--output",
        help="save directory for the converted checkpoint (a plain one, also from a checkpoint "
        "of the distributed optimizer)",
    )
    action = p.add_mutually_exclusive_group()
    action.add_argument("--target-tp", type=int, help="reshard to this tensor-parallel size")
    action.add_argument("--merge", action="store_true", help="one unsharded file (TP=1)")
    p.add_argument("--summary", action="store_true", help="print what the checkpoint holds")
    p.add_argument("--tensors", action="store_true", help="summary: every tensor, not per group")
    p.add_argument(
        "--weights-only", action="store_true", help="conversion: drop the optimizer state"
    )
    return p


def _numel(info: dict) -> int:
    numel = 1
    for n in info["shape"]:
        numel *= n
    return numel


def _nbytes(info: dict) -> int:
    return _numel(info) * getattr(torch, info["dtype"]).itemsize


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def tensor_group(key: str) -> str:
    """The summary group of a checkpoint key: the module of a weight, with the layers folded into
    one group per kind of sublayer (``transformer.layers.*.attention``), or the kind of an
    optimizer state (``optimizer exp_avg``)."""
    kind, rest = key.split("/", 1)
    if kind == "optim":
        return f"optimizer {rest.rsplit('/', 1)[1]}"
    head, sep, tail = _LAYER.sub(".layers.*.", rest, count=1).partition(".layers.*.")
    return f"{head}.layers.*.{tail.split('.')[0]}" if sep else rest.rsplit(".", 1)[0]


def _group_lines(layout: dict[str, dict]) -> list[str]:
    """One line per ``tensor_group``, in checkpoint order: tensors, elements, bytes, layers."""
    groups: dict[str, list[str]] = {}
    for key in layout:
        groups.setdefault(tensor_group(key), []).append(key)
    width = max(len(g) for g in groups)
    lines = [f"  {'group':<{width}}  {'tensors':>7}  {'elements':>13}  {'bytes':>15}"]
    for name, keys in groups.items():
        layers = {m.group(1) for k in keys if (m := _LAYER.search(k))}
        lines.append(
            f"  {name:<{width}}  {len(keys):>7}  {sum(_numel(layout[k]) for k in keys):>13,}  "
            f"{sum(_nbytes(layout[k]) for k in keys):>15,}"
            + (f"  over {len(layers)} layers" if layers and "layers.*" in name else "")
        )
    return lines


def summary(ckpt: str, tensors: bool = False) -> str:
    """Iteration, sizes, progress, checksum status, and the tensors per group (``tensors``:
    every tensor's full shape, dtype, split and bytes)."""
    problem = verify_checkpoint(ckpt)
    meta = read_meta(ckpt)
    files = sorted(meta["files"])
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in files if not problem)
    sharded = meta.get("distributed_optimizer")
    layout = {**meta["tensors"], **(all_optim_layout(meta) if sharded else {})}
    pp = pp_size_of(meta)
    where = (
        f"in {meta['tp_size'] * pp * meta['dp_size']} shard files (distributed optimizer)"
        if sharded
        else "in the TP files"
    )
    model = {k: v for k, v in layout.items() if k.startswith("model/")}
    lines = [
        f"checkpoint  {ckpt}",
        f"iteration   {meta['iteration']}  (format {meta['format_version']}, "
        f"torch {meta['torch_version']})",
        f"parallel    TP={meta['tp_size']} x PP={pp} x DP={meta['dp_size']} "
        f"(world {meta['world_size']}, "
        f"{meta['device_type']}); RNG states: {'yes' if meta['rng'] else 'no'}",
        f"vocab       {meta['vocab_size']} (padded {meta['padded_vocab_size']})",
        f"progress    {json.dumps(meta['progress'])}",
        f"files       {len(files)} + meta.json, {size} bytes",
        f"checksums   {'ok' if problem is None else 'FAILED: ' + problem}",
        f"parameters  {sum(_numel(v) for v in model.values())} (vocab padding included) in "
        f"{len(model)} model tensors; "
        f"{len(layout) - len(model)} optimizer tensors"
        + (" (weights only)" if meta.get("weights_only") else f" {where}"),
    ]
    if not tensors:
        return "\n".join(lines + _group_lines(layout))
    width = max(len(k) for k in layout)
    for key, info in layout.items():
        split = "-" if info["split_dim"] is None else info["split_dim"]
        lines.append(
            f"  {key:<{width}}  {str(info['shape']):<14} {info['dtype']:<8} split {split}"
            f"{' vocab' if info['vocab'] else ''}  {_nbytes(info)} B"
        )
    return "\n".join(lines)


def reshard(src: str, out: str, tp_size: int, weights_only: bool = False) -> str:
    """Write checkpoint ``src`` at TP=``tp_size`` (and PP = EP = 1) into the save directory
    ``out``; its path.

    ``weights_only``: without the optimizer state, and marked so in meta.json.
    """
    problem = verify_checkpoint(src)
    if problem:
        raise ConfigError(f"--input: {problem}; pick an intact checkpoint with --iteration")
    meta = read_meta(src)
    heads = meta["config"]["model"]["num_attention_heads"]
    if tp_size < 1 or heads % tp_size:
        raise ConfigError(
            f"--target-tp {tp_size} does not divide model.num_attention_heads={heads}; "
            "use a divisor of it"
        )
    source = open_checkpoint(src, meta, not weights_only)
    layout = source.layout
    if weights_only:
        layout = {k: v for k, v in layout.items() if k.startswith("model/")}
    for key, info in layout.items():
        split = info["split_dim"]
        if split is not None and not info["vocab"] and info["shape"][split] % tp_size:
            raise ConfigError(f"--target-tp {tp_size} does not divide {key} {info['shape']}")
    if os.path.realpath(out) == os.path.realpath(os.path.dirname(src)):
        raise ConfigError(f"--output {out} holds the input; choose another directory")
    check_output(out)  # a checkpoint or files of the user's there would be replaced or mixed in
    divisible_by = meta["config"]["model"]["make_vocab_size_divisible_by"]
    padded = padded_vocab_size(meta["vocab_size"], divisible_by, tp_size)
    new_layout = copy.deepcopy(layout)
    for info in new_layout.values():
        if info["vocab"]:
            info["shape"][0] = padded
        info.pop("experts", None)  # every expert in the one file of each TP rank (EP 1)
    config = copy.deepcopy(meta["config"])
    config["parallel"]["tensor_parallel_size"] = tp_size
    config["parallel"].update(pipeline_parallel_size=1, virtual_pipeline_size=None)
    config["parallel"]["expert_parallel_size"] = 1
    converted = {
        **meta,
        "tp_size": tp_size,
        "pp_size": 1,
        "ep_size": 1,
        "dp_size": 1,
        "world_size": tp_size,
        "distributed_optimizer": None,
        "padded_vocab_size": padded if meta["padded_vocab_size"] is not None else None,
        "rng": False,
        "tensors": new_layout,
        "stages": [list(new_layout)],
        "config": config,
        "converted_from": {
            "path": os.path.abspath(src),
            "tp_size": meta["tp_size"],
            "pp_size": pp_size_of(meta),
        },
    }
    if weights_only:
        converted.update(lr_schedule=None, grad_scaler=None, weights_only=True)
    files = (
        (shard_file(rank), {key: source.read(key, tp_size, rank, padded) for key in layout})
        for rank in range(tp_size)
    )
    return save_offline(out, converted, files)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; a user mistake prints one line and returns 2 (4: the output's
    disk refused a write)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    target = 1 if args.merge else args.target_tp
    if target is None and not (args.summary or args.tensors):
        parser.error("nothing to do: pass --summary, --target-tp N or --merge")
    if target is not None and not args.output:
        parser.error("--target-tp/--merge need --output")
    if args.weights_only and target is None:
        parser.error("--weights-only needs --merge or --target-tp N (and --output)")
    try:
        src, _ = find_checkpoint(args.input, args.iteration, "--input")
        if args.summary or args.tensors:
            print(summary(src, args.tensors))
        if target is not None:
            path = reshard(src, args.output, target, args.weights_only)
            use = " checkpoint.finetune=true" if args.weights_only else ""
            print(f"wrote {path} (TP={target}, PP=1); use it as checkpoint.load={args.output}{use}")
    except ConfigError as err:
        return exit_with(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
