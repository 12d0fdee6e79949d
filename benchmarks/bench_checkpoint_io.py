"""Checkpoint save and load: ours against torch.save and torch.distributed.checkpoint (DCP).

One process (a world of one), one fp32 GPT whose AdamW moments a first step has populated: the
state is its weights and both moments, ~1.2 GB at the default size (``--size-mb`` for smaller
runs; 12 layers, hidden a multiple of 64, vocabulary 40 x hidden). Each round saves and loads it
three ways, alternated (ours, torch, DCP; the next round starts at torch, and so on), after one
untimed save and load of each, and the medians over ``--rounds`` are kept:

    ours   save_checkpoint / load_checkpoint, as the training loop runs them: XXH3-128 of every
           file taken while it is written, verified while it is read, meta.json, renames, fsyncs
    torch  torch.save of the same tensors, then fsync; torch.load(weights_only), copied back in
    dcp    torch.distributed.checkpoint save / load of the same tensors (in place; its writer
           fsyncs; no checksums)

Every load reads what the save before it just wrote, from the page cache. Then the peak resident
memory of one synchronous and one background save (checkpoint.async_save) of ours: the kernel's
high-water mark VmHWM of /proc/self/status, reset through /proc/self/clear_refs just before the
save (exact, where a sampling thread could miss a short peak). It is set against what the
process held just before (VmRSS: the model and its optimizer state, the interpreter, the
libraries) plus, for the background save, the one host copy of the state that it exists to
make. Last, whether our shard file is byte for byte what safetensors.torch.save makes of the
same tensors. On 2 shared cores the times move with the load, which is printed too. Prints one
JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_checkpoint_io.py [--size-mb 50]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save as safetensors_save

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint import Checkpointer, load_checkpoint, save_checkpoint  # noqa: E402
from megatron.checkpoint.format import (  # noqa: E402
    checkpoint_name,
    checksum_text,
    new_digest,
    read_meta,
    shard_file,
)
from megatron.checkpoint.reshard import shard_tensors  # noqa: E402
from megatron.checkpoint.train_state import Progress, TrainState  # noqa: E402
from megatron.config.load import load_config  # noqa: E402
from megatron.models.build import build_model  # noqa: E402
from megatron.optim.build import build_optimizer  # noqa: E402
from megatron.optim.lr_schedule import LRSchedule  # noqa: E402
from megatron.parallel.random import RNGTracker  # noqa: E402
from megatron.parallel.state import initialize, shutdown  # noqa: E402

LAYERS = 12
CONFIG = """
model: {{num_layers: {layers}, hidden_size: {hidden}, num_attention_heads: {heads},
        seq_length: 32, max_position_embeddings: 32, hidden_dropout: 0.0,
        attention_dropout: 0.0}}
tokenizer: {{type: gpt2, vocab_file: vocab.json, merges_file: merges.txt}}
data: {{paths: [corpus]}}
training: {{micro_batch_size: 1, global_batch_size: 1, train_iters: 100, seed: 1234}}
optimizer: {{lr: 1.0e-4}}
"""


def hidden_for(size_mb: float) -> int:
    """The hidden size whose model's state (12 bytes a parameter: weight and two moments in fp32)
    is nearest ``size_mb`` MiB: about (40 + 12 * LAYERS) * hidden^2 parameters."""
    params = size_mb * 2**20 / 12
    return max(64, 64 * round(math.sqrt(params / (40 + 12 * LAYERS)) / 64))


def kib_of(field: str) -> int:
    """A ``/proc/self/status`` field (VmRSS, VmHWM) in KiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


def peak_rss(fn: Callable[[], None]) -> tuple[float, float]:
    """(resident MiB before ``fn()``, the peak while it ran), from the kernel's high-water mark."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    before = kib_of("VmRSS")
    fn()
    return before / 1024, kib_of("VmHWM") / 1024


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=1174, help="state size to aim for (MiB)")
    parser.add_argument("--rounds", type=int, default=3, help="saves and loads of each kind")
    parser.add_argument("--dir", help="where to save (default: a temporary directory)")
    args = parser.parse_args()
    torch.manual_seed(0)
    hidden = hidden_for(args.size_mb)
    vocab = 40 * hidden
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        config_path = os.path.join(root, "bench.yaml")
        with open(config_path, "w") as f:
            f.write(CONFIG.format(layers=LAYERS, hidden=hidden, heads=hidden // 64))
        cfg = load_config([config_path], [f"checkpoint.save={root}/ckpt"])
        state = initialize(1)
        tracker = RNGTracker(state.device)
        tracker.seed(cfg.training.seed, state.tp_rank)
        model = build_model("gpt", cfg, vocab, vocab, state, tracker).to(state.device)
        optimizer = build_optimizer(model, cfg.optimizer, cfg.precision, state)
        schedule = LRSchedule.from_config(cfg.optimizer)
        tokens = torch.randint(0, vocab, (1, 33), device=state.device)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
        optimizer.scale_loss(loss).backward()
        optimizer.set_lr(schedule.lr)
        optimizer.step()  # the AdamW moments exist from here on: a checkpoint holds them
        train = TrainState(model, optimizer, schedule, tracker, Progress(iteration=1))
        state_bytes = sum(t.nbytes for t in shard_tensors(model, optimizer).values())

        def ours(where: str) -> tuple[Callable[[], None], Callable[[], None]]:
            def load() -> None:
                load_checkpoint(where, train, state, vocab)

            return lambda: save_checkpoint(where, train, cfg, state, vocab), load

        def plain(where: str) -> tuple[Callable[[], None], Callable[[], None]]:
            # Our checkpoint's tensors, live: taken anew, for our load gives the optimizer new
            # moment tensors.
            tensors, path = shard_tensors(model, optimizer), os.path.join(where, "state.pt")

            def save() -> None:
                os.makedirs(where)
                torch.save(tensors, path)
                fsync_file(path)

            def load() -> None:
                for key, value in torch.load(path, map_location="cpu", weights_only=True).items():
                    tensors[key].copy_(value)

            return save, load

        def distributed(where: str) -> tuple[Callable[[], None], Callable[[], None]]:
            tensors = shard_tensors(model, optimizer)
            return (
                lambda: dcp.save(tensors, checkpoint_id=where),
                lambda: dcp.load(tensors, checkpoint_id=where),
            )

        kinds = {"ours": ours, "torch": plain, "dcp": distributed}
        seconds: dict[str, dict[str, list[float]]] = {k: {"save": [], "load": []} for k in kinds}
        order = list(kinds.items())
        # One untimed save and load of each kind first: the process's first save (of any kind)
        # takes several times a later one's, which would otherwise fall on whoever goes first.
        for kind, make in order:
            where = os.path.join(root, f"{kind}-warm")
            save, load = make(where)
            save()
            load()
            shutil.rmtree(where)
        for r in range(args.rounds):
            # Each kind goes first in turn: the first save of a round meets the disk's writeback
            # of the round before.
            for kind, make in order[r % len(order) :] + order[: r % len(order)]:
                where = os.path.join(root, f"{kind}{r}")
                save, load = make(where)
                seconds[kind]["save"].append(timed(save))
                seconds[kind]["load"].append(timed(load))
                shutil.rmtree(where)

        sync_dir, async_dir = os.path.join(root, "sync"), os.path.join(root, "async")
        sync_before, sync_peak = peak_rss(
            lambda: save_checkpoint(sync_dir, train, cfg, state, vocab)
        )
        saves = Checkpointer(True, lambda _: None)

        def background() -> None:
            saves.save(async_dir, train, cfg, state, vocab)
            saves.wait()

        async_before, async_peak = peak_rss(background)
        shard = shard_file(0)
        meta = read_meta(os.path.join(sync_dir, checkpoint_name(1)))
        reference = new_digest()
        reference.update(safetensors_save(shard_tensors(model, optimizer)))
        shutdown()

    def median(kind: str, op: str) -> float:
        return statistics.median(seconds[kind][op])

    mib = state_bytes / 2**20
    result: dict[str, object] = {
        "params": sum(p.numel() for p in model.parameters()),
        "state_mib": round(mib, 1),
        "rounds": args.rounds,
    }
    for kind in kinds:
        for op in ("save", "load"):
            result[f"{kind}_{op}_s"] = round(median(kind, op), 3)
            result[f"{kind}_{op}_mib_per_s"] = round(mib / median(kind, op))
    for op in ("save", "load"):
        result[f"{op}_ratio_ours_to_dcp"] = round(median("ours", op) / median("dcp", op), 3)
    result.update(
        sync_save_rss_before_mib=round(sync_before),
        sync_save_peak_rss_mib=round(sync_peak),
        sync_save_peak_ratio=round(sync_peak / sync_before, 3),
        async_save_rss_before_mib=round(async_before),
        async_save_peak_rss_mib=round(async_peak),
        async_save_peak_ratio=round(async_peak / (async_before + mib), 3),
        safetensors_identical=meta["files"][shard] == checksum_text(reference.hexdigest()),
        each_s={
            k: {op: [round(s, 3) for s in v] for op, v in ops.items()} for k, ops in seconds.items()
        },
        threads=torch.get_num_threads(),
        loadavg=os.getloadavg()[0],
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
