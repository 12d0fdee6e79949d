"""Checkpoint save and load as a run sees them, against torch.distributed.checkpoint (DCP).

A ~100M-parameter GPT (12 layers, hidden 832, fp32, one process): ``pretrain_gpt.py`` trains one
iteration and saves (its metrics file's ``save_total_ms``: gather, write, checksums, fsyncs,
publish), then a second run resumes from it (``load_total_ms``: find, verify, read, restore).
DCP then saves the very tensors of that checkpoint (weights and both Adam moments, read from its
files) with its fsyncing writer, and loads them back in place. Rounds alternate (ours, DCP, ...)
and the medians are kept. Every load reads what was just written, from the page cache. Prints
one JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_checkpoint_entrypoint.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.gpt_run import prepare_gpt_data, run_pretrain, tiny_overrides  # noqa: E402

SHAPE = {
    "model.num_layers": 12,
    "model.hidden_size": 832,
    "model.num_attention_heads": 13,
    "model.ffn_hidden_size": 3328,
    "model.seq_length": 32,
    "model.max_position_embeddings": 32,
    "parallel.tensor_parallel_size": 1,
    "training.micro_batch_size": 1,
    "training.global_batch_size": 1,
    "training.eval_iters": 0,
    "optimizer.lr_warmup_iters": 0,
}


def _entry(path: Path, key: str) -> float:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return next(e[key] for e in lines if key in e)


def ours(data: dict[str, str], run: Path) -> tuple[float, float, Path]:
    """(save_total_ms, load_total_ms, the checkpoint) of one run that saves and one resuming."""
    save = run / "ckpt"
    keys = {**SHAPE, "checkpoint.save": save}
    first = tiny_overrides(data, run, **keys, **{"training.train_iters": 1})
    first.append(f"logging.metrics_file={run / 'first.jsonl'}")
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", first, timeout=900)
    again = tiny_overrides(data, run, **keys, **{"training.train_iters": 2})
    again += [f"logging.metrics_file={run / 'again.jsonl'}", "checkpoint.save_interval=1000"]
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", again, timeout=900)
    saved = _entry(run / "first.jsonl", "save_total_ms")
    loaded = _entry(run / "again.jsonl", "load_total_ms")
    return saved, loaded, save / "iter_0000001"


def with_dcp(checkpoint: Path, where: Path) -> tuple[float, float, int]:
    """DCP's (save ms, load ms) of the checkpoint's tensors, and their bytes."""
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(checkpoint)):
        if name.endswith(".safetensors") and not name.startswith("rng"):
            tensors.update({f"{name}/{k}": v for k, v in load_file(checkpoint / name).items()})
    start = time.perf_counter()
    dcp.save(tensors, checkpoint_id=str(where))  # FileSystemWriter fsyncs its files
    saved = time.perf_counter() - start
    start = time.perf_counter()
    dcp.load(tensors, checkpoint_id=str(where))
    loaded = time.perf_counter() - start
    return 1000 * saved, 1000 * loaded, sum(t.nbytes for t in tensors.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # DCP without a process group says, on every call, that it assumes one process: it is one.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    figures: dict[str, list[float]] = {k: [] for k in ("ours_save", "ours_load", "dcp_save",
                                                       "dcp_load")}  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        data = prepare_gpt_data(Path(root) / "data")
        for r in range(args.rounds):
            run = Path(root) / f"run{r}"
            saved, loaded, checkpoint = ours(data, run)
            figures["ours_save"].append(saved)
            figures["ours_load"].append(loaded)
            dcp_save, dcp_load, nbytes = with_dcp(checkpoint, Path(root) / f"dcp{r}")
            figures["dcp_save"].append(dcp_save)
            figures["dcp_load"].append(dcp_load)
            shutil.rmtree(run)
            shutil.rmtree(Path(root) / f"dcp{r}")
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(json.dumps({
        "state_mib": round(nbytes / 2**20, 1),
        "rounds": args.rounds,
        **{f"{k}_ms": round(v, 1) for k, v in med.items()},
        "save_ratio_ours_to_dcp": round(med["ours_save"] / med["dcp_save"], 3),
        "load_ratio_ours_to_dcp": round(med["ours_load"] / med["dcp_load"], 3),
        "each_ms": {k: [round(x, 1) for x in v] for k, v in figures.items()},
        "loadavg": os.getloadavg()[0],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
