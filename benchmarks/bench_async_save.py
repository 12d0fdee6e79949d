"""Time the training loop's checkpoint saves: synchronous (the baseline) against background.

One process, one model of ~60M parameters (fp32, AdamW moments populated by a first step), the
loop's own ``Checkpointer`` and ``MetricsLogger``: ``--saves`` synchronous saves, then as many
with ``checkpoint.async_save``, each followed by one training step (which, for a background
save, runs while the checkpoint is written) and by waiting for the save to finish, so that no
save's blocking time includes the previous one's. The figures are read back from the metrics
file (``save_blocking_ms``, ``save_total_ms``); the medians are compared. On 2 shared cores the
times move with the load, which is printed too. Prints one JSON line.

    .venv/bin/python benchmarks/bench_async_save.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint.async_save import Checkpointer  # noqa: E402
from megatron.checkpoint.train_state import Progress, TrainState  # noqa: E402
from megatron.config.load import load_config  # noqa: E402
from megatron.estimate.workload import Workload  # noqa: E402
from megatron.models.build import build_model  # noqa: E402
from megatron.optim.build import build_optimizer  # noqa: E402
from megatron.optim.lr_schedule import LRSchedule  # noqa: E402
from megatron.parallel.random import RNGTracker  # noqa: E402
from megatron.parallel.state import initialize, shutdown  # noqa: E402
from megatron.training.metrics import MetricsLogger  # noqa: E402

VOCAB = 32000
CONFIG = """
model: {num_layers: 8, hidden_size: 640, num_attention_heads: 10, seq_length: 32,
        max_position_embeddings: 32, hidden_dropout: 0.0, attention_dropout: 0.0}
tokenizer: {type: gpt2, vocab_file: vocab.json, merges_file: merges.txt}
data: {paths: [corpus]}
training: {micro_batch_size: 1, global_batch_size: 1, train_iters: 100, seed: 1234}
optimizer: {lr: 1.0e-4}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=3, help="saves per mode")
    parser.add_argument("--dir", help="where to save (default: a temporary directory)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        config_path = os.path.join(root, "bench.yaml")
        with open(config_path, "w") as f:
            f.write(CONFIG)
        cfg = load_config([config_path], [f"checkpoint.save={root}/ckpt", "checkpoint.keep_last=1"])
        state = initialize(1)
        tracker = RNGTracker(state.device)
        tracker.seed(cfg.training.seed, state.tp_rank)
        model = build_model("gpt", cfg, VOCAB, VOCAB, state, tracker).to(state.device)
        optimizer = build_optimizer(model, cfg.optimizer, cfg.precision, state)
        schedule = LRSchedule.from_config(cfg.optimizer)
        params = sum(p.numel() for p in model.parameters())
        tokens = torch.randint(0, VOCAB, (1, 33), device=state.device)

        def step() -> float:
            start = time.perf_counter()
            loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
            optimizer.scale_loss(loss).backward()
            optimizer.set_lr(schedule.lr)
            optimizer.step()
            schedule.step()
            return 1000 * (time.perf_counter() - start)

        step()  # the AdamW moments exist from here on: a checkpoint holds them
        metrics_file = os.path.join(root, "metrics.jsonl")
        work = Workload.of(cfg, VOCAB, 1)
        metrics = MetricsLogger(None, metrics_file, True, "", work)
        steps: dict[bool, list[float]] = {False: [], True: []}
        iteration = 0
        for background in (False, True):
            saves = Checkpointer(background, metrics.record)
            for _ in range(args.saves):
                iteration += 1
                train = TrainState(model, optimizer, schedule, tracker, Progress(iteration))
                saves.save(cfg.checkpoint.save, train, cfg, state, VOCAB)
                steps[background].append(step())
                saves.wait()
        metrics.close()
        shutdown()
        with open(metrics_file) as f:
            lines = [json.loads(line) for line in f]
    sync, bg = lines[: args.saves], lines[args.saves :]

    def median(entries: list[dict], key: str) -> float:
        return statistics.median(e[key] for e in entries)

    sync_ms = median(sync, "save_total_ms")
    result = {
        "params": params,
        "checkpoint_mb": round(params * 3 * 4 / 2**20),  # weights and two moments, fp32
        "sync_save_ms": round(sync_ms, 1),
        "async_blocking_ms": round(median(bg, "save_blocking_ms"), 1),
        "async_total_ms": round(median(bg, "save_total_ms"), 1),
        "blocking_ratio": round(median(bg, "save_blocking_ms") / sync_ms, 4),
        "async_blocking_each_ms": [round(e["save_blocking_ms"], 1) for e in bg],
        "step_ms_after_sync_save": round(statistics.median(steps[False]), 1),
        "step_ms_during_async_save": round(statistics.median(steps[True]), 1),
        "threads": torch.get_num_threads(),
        "loadavg": os.getloadavg()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
