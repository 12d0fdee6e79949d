"""What looking after a long run costs a step: ms/iteration of pretrain_gpt.py with the spike
guard, per-source losses and straggler judging on, against the same run with them off.

On: a two-source blend (the sample corpus twice, so both runs read alike data), so every step
totals each source's loss and tokens in its all-reduce; ``training.spike_threshold`` (high enough
never to fire) judges every step; ``logging.straggler_threshold`` gathers and judges the phase
times on every logged step (log_interval 1: the most often it can). Off: the corpus as one
prefix, no guard, no straggler judging. Both: a 4-layer GPT (hidden 256, seq 256, batch 8, fp32)
as 2 DP processes of one thread, checkpoint.save set (one save at the end, outside the timed
steps). The rounds alternate on and off; each run's figure is its median ms/iteration after
warm-up, the report the median over rounds. Prints one JSON line; the goal is a ratio within
1.02.

    .venv/bin/python benchmarks/bench_long_run.py [--iters 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_pretrain import SHAPE as MODEL_SHAPE  # noqa: E402
from tests.gpt_run import prepare_gpt_data, read_metrics, run_pretrain, tiny_overrides  # noqa: E402

SHAPE = {
    **MODEL_SHAPE,
    "parallel.tensor_parallel_size": 1,
    "training.micro_batch_size": 4,
    "training.global_batch_size": 8,
    "training.eval_iters": 0,
}
WARMUP = 5


def run_ms(data: dict, run_dir: Path, on: bool, iters: int) -> float:
    corpus = data["data"]
    keys = {**SHAPE, "training.train_iters": iters, "checkpoint.save": run_dir / "ckpt"}
    if on:
        keys |= {
            "data.paths": f"[0.5, {corpus}, 0.5, {corpus}]",
            "training.spike_threshold": 100.0,
            "training.spike_skip_batches": 1,
            "checkpoint.save_interval": 10 * iters,
            "logging.straggler_threshold": 100.0,
        }
    overrides = tiny_overrides(data, run_dir, **keys)
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", overrides, nproc=2, timeout=900)
    times = [e["ms_per_iter"] for e in read_metrics(run_dir / "metrics.jsonl")]
    return statistics.median(times[WARMUP:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    on, off = [], []
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_gpt_data(Path(tmp) / "data")
        for r in range(args.rounds):
            off.append(run_ms(data, Path(tmp) / f"off{r}", False, args.iters))
            on.append(run_ms(data, Path(tmp) / f"on{r}", True, args.iters))
    ms_on, ms_off = statistics.median(on), statistics.median(off)
    print(
        json.dumps(
            {
                "ms_per_iter_on": round(ms_on, 2),
                "ms_per_iter_off": round(ms_off, 2),
                "ratio_on_vs_off": round(ms_on / ms_off, 3),
                "rounds_on": [round(x, 2) for x in on],
                "rounds_off": [round(x, 2) for x in off],
                "loadavg": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
