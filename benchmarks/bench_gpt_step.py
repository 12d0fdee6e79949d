"""Time one training step of our TP=1 GPT against a plain PyTorch GPT of the same shape.

A step is forward, backward, AdamW step and zero_grad. Both models live in this process (on the
GPU when there is one, each step's clock then stopped after its kernels finish) and their steps
alternate (ours, plain, ours, ...), so a busy neighbour slows both alike; the machine's load
average is printed with the result because on 2 shared cores it moves the times several-fold.
Prints one JSON line: {ours_ms, plain_ms, ratio, threads, loadavg}; the times are medians.

    .venv/bin/python benchmarks/bench_gpt_step.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.plain_gpt import PlainGPT  # noqa: E402
from megatron.config.load import load_config  # noqa: E402
from megatron.config.schema import padded_vocab_size  # noqa: E402
from megatron.models.build import build_model  # noqa: E402
from megatron.parallel.random import RNGTracker  # noqa: E402
from megatron.parallel.state import initialize, shutdown  # noqa: E402

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 4, 256, 8, 32000, 256, 8
SEED = 1234


def build_ours() -> torch.nn.Module:
    """Our GPT on a world of one, dropout off (the plain model has none)."""
    state = initialize(1)
    shape = {"num_layers": LAYERS, "hidden_size": HIDDEN, "num_attention_heads": HEADS}
    shape |= {"seq_length": SEQ, "max_position_embeddings": SEQ}
    shape |= {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    # The tiny config's other model keys are the defaults: only this shape is set.
    overrides = [f"model.{key}={value}" for key, value in shape.items()]
    cfg = load_config([os.path.join(ROOT, "configs", "gpt_tiny.yaml")], overrides)
    tracker = RNGTracker(state.device)
    tracker.seed(SEED, state.tp_rank)
    padded = padded_vocab_size(VOCAB, cfg.model.make_vocab_size_divisible_by, 1)
    return build_model("gpt", cfg, VOCAB, padded, state, tracker)


def synchronize() -> None:
    """Wait for the GPU's queued kernels (if any), so that a clock read next has timed them."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_step(loss_fn: Callable[[], torch.Tensor], model: torch.nn.Module) -> Callable[[], float]:
    """A closure running one full training step and returning its wall time in ms."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        synchronize()  # the previous step's kernels are not this one's
        start = time.perf_counter()
        loss_fn().backward()
        opt.step()
        opt.zero_grad()
        synchronize()
        return (time.perf_counter() - start) * 1e3

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per model first")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    ours = build_ours().train()
    torch.manual_seed(SEED)
    device = next(ours.parameters()).device
    plain = PlainGPT(VOCAB, SEQ, LAYERS, HIDDEN, HEADS).to(device).train()
    g = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(device)
    tokens, labels = data[:, :-1], data[:, 1:]

    steps = {
        "ours": make_step(lambda: ours(tokens, labels=labels).mean(), ours),
        "plain": make_step(lambda: plain(tokens, labels), plain),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.warmup + args.steps):
        for name, step in steps.items():  # interleaved: ours, plain, ours, plain, ...
            ms = step()
            if i >= args.warmup:
                times[name].append(ms)
    shutdown()

    ours_ms = statistics.median(times["ours"])
    plain_ms = statistics.median(times["plain"])
    result = {
        "ours_ms": round(ours_ms, 1),
        "plain_ms": round(plain_ms, 1),
        "ratio": round(ours_ms / plain_ms, 3),
        "threads": torch.get_num_threads(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
