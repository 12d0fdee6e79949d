"""What building one pipeline stage costs, now that a stage draws only the layers it holds.

Stage 0 of a PP=4 GPT (16 layers, hidden 1024, 16 heads, vocabulary 32000, fp32 on CPU) is
built in one process, against the baseline of what a stage drew before each layer had its own
stream: the whole model (all 16 layers, the PP=1 model), from which it kept its 4. Each build
runs in a fresh interpreter (``--child``) that reports its wall and CPU time and its peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``, the imports included, and the build's own increment over
the RSS before it), and a fingerprint (fp64 sum) of every tensor it holds. The runs alternate
(before, after, ...) ``--repeats`` times, so a busy neighbour slows both alike; the medians are
reported, with the machine's load average.

Checks: stage 0 built 4 of the 16 layers; its tensors equal the whole model's (fingerprints);
the build's CPU time and RSS increment fall at least as far as the parameters it holds (the
ratio after / before at most the parameter ratio plus 0.1). CPU time, not wall time, is checked:
on 2 cores shared with other work a build waits for a core as long as it computes.

Prints one JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_init.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS, HIDDEN, HEADS, VOCAB, PP = 16, 1024, 16, 32000, 4
SLACK = 0.1  # allowed excess of the time and memory ratios over the parameter ratio


def rss_kib() -> int:
    """This process's resident set now, KiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def child(pp_size: int) -> dict:
    """Build stage 0 of a ``pp_size``-stage GPT here; its time, memory and fingerprints."""
    import torch

    sys.path.insert(0, ROOT)
    from megatron.config.load import load_config
    from megatron.config.schema import padded_vocab_size
    from megatron.models.build import build_model
    from megatron.parallel.random import RNGTracker
    from megatron.parallel.state import ParallelState

    shape = {"num_layers": LAYERS, "hidden_size": HIDDEN, "num_attention_heads": HEADS}
    overrides = [f"model.{key}={value}" for key, value in shape.items()]
    cfg = load_config([os.path.join(ROOT, "configs", "gpt_tiny.yaml")], overrides)
    state = ParallelState.serial(torch.device("cpu"))
    state = dataclasses.replace(state, pp_size=pp_size, pp_rank=0)
    padded = padded_vocab_size(VOCAB, cfg.model.make_vocab_size_divisible_by, 1)
    rss_start = rss_kib()
    start, cpu_start = time.perf_counter(), time.process_time()
    tracker = RNGTracker(state.device)
    tracker.seed(cfg.training.seed, state.tp_rank)
    model = build_model("gpt", cfg, VOCAB, padded, state, tracker)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "s": seconds,
        "cpu_s": cpu_seconds,
        "peak_rss_mib": peak / 1024,
        "build_rss_mib": (peak - rss_start) / 1024,
        "layers": len(model.transformer.layers),
        "params": sum(p.numel() for p in model.parameters()),
        "sums": {k: v.double().sum().item() for k, v in model.state_dict().items()},
    }


def run_child(pp_size: int) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", str(pp_size)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    return {
        "s": round(statistics.median(r["s"] for r in runs), 3),
        "cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 3),
        "peak_rss_mib": round(statistics.median(r["peak_rss_mib"] for r in runs), 1),
        "build_rss_mib": round(statistics.median(r["build_rss_mib"] for r in runs), 1),
        "layers": runs[0]["layers"],
        "params": runs[0]["params"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.repeats):
        runs["before"].append(run_child(1))
        runs["after"].append(run_child(PP))
    before, after = summary(runs["before"]), summary(runs["after"])
    whole, stage = runs["before"][0]["sums"], runs["after"][0]["sums"]
    param_ratio = after["params"] / before["params"]
    ratio = {
        "s": round(after["s"] / before["s"], 3),
        "cpu_s": round(after["cpu_s"] / before["cpu_s"], 3),
        "build_rss_mib": round(after["build_rss_mib"] / before["build_rss_mib"], 3),
        "peak_rss_mib": round(after["peak_rss_mib"] / before["peak_rss_mib"], 3),
        "params": round(param_ratio, 3),
    }
    checks = {
        "stage_built_its_layers_only": after["layers"] == LAYERS // PP
        and before["layers"] == LAYERS,
        "stage_equals_whole_model": all(whole[k] == v for k, v in stage.items()),
        "time_falls_with_params": ratio["cpu_s"] <= param_ratio + SLACK,
        "memory_falls_with_params": ratio["build_rss_mib"] <= param_ratio + SLACK,
    }
    result = {
        "model": f"gpt {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, vocab {VOCAB}, fp32, cpu",
        "stage": f"0 of PP={PP}",
        "before": before,
        "after": after,
        "after_over_before": ratio,
        "layers_built": f"{after['layers']} of {LAYERS}",
        "repeats": args.repeats,
        "checks": checks,
        "pass": all(checks.values()),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
