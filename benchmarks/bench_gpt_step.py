"""Time one training step of our TP=1 GPT and Llama against plain PyTorch models of the same shape.

A step is forward, backward, AdamW step and zero_grad. Each row pits one of our models against
its plain twin: the GPT (``benchmarks/plain_gpt.py``, same initialisation) and a Llama (RoPE
theta 500000, RMSNorm, SwiGLU, 8 heads in 2 query groups, untied, no biases;
``benchmarks/plain_llama.py``, our weights copied in, so both compute the same function:
tests/test_bench_llama.py checks their losses agree). Both models of a row live in this process
(on the GPU when there is one, each step's clock then stopped after its kernels finish) and their
steps alternate (ours, plain, ours, ...), so a busy neighbour slows both alike; the machine's load
average is printed with the result because on 2 shared cores it moves the times several-fold.
Prints one JSON line per row: {model, ours_ms, plain_ms, ratio, threads, loadavg}; the times are
medians. The "startup" row is the time from a fresh interpreter to the tiny demo's first
iteration, and the imports in it (``benchmarks/startup.py``).

    .venv/bin/python benchmarks/bench_gpt_step.py [--model gpt|llama|startup|all]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.plain_gpt import PlainGPT  # noqa: E402
from benchmarks.plain_llama import PlainLlama  # noqa: E402
from benchmarks.startup import measure as measure_startup  # noqa: E402
from megatron.config.load import load_config  # noqa: E402
from megatron.config.schema import padded_vocab_size  # noqa: E402
from megatron.models.build import build_model  # noqa: E402
from megatron.parallel.random import RNGTracker  # noqa: E402
from megatron.parallel.state import ParallelState, initialize, shutdown  # noqa: E402

SEED = 1234


@dataclass(frozen=True)
class Shape:
    """A row's model and batch shape (``groups``: key/value heads, Llama only)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int
    groups: int | None = None
    ffn: int | None = None


GPT = Shape(layers=4, hidden=256, heads=8, vocab=32000, seq=256, batch=8)
# ffn 704: ~2.75 x hidden, the SwiGLU width of configs/llama_tiny.yaml (three matrices, so about
# the parameters of GPT's two 4 x hidden ones).
LLAMA = Shape(layers=4, hidden=256, heads=8, vocab=32000, seq=256, batch=8, groups=2, ffn=704)


def build_ours(
    config: str, shape: Shape, state: ParallelState, extra: dict[str, object] | None = None
) -> nn.Module:
    """Our model of ``configs/<config>.yaml`` at ``shape`` on a world of one, dropout off (the
    plain models have none); the config's other model keys are kept (Llama's options) unless
    ``extra`` (model keys) sets them."""
    keys = {"num_layers": shape.layers, "hidden_size": shape.hidden}
    keys |= {"num_attention_heads": shape.heads, "num_query_groups": shape.groups}
    keys |= {"ffn_hidden_size": shape.ffn, "seq_length": shape.seq}
    keys |= {"max_position_embeddings": shape.seq, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    keys |= extra or {}
    overrides = [f"model.{key}={'null' if v is None else v}" for key, v in keys.items()]
    overrides.append("parallel.tensor_parallel_size=1")
    cfg = load_config([os.path.join(ROOT, "configs", f"{config}.yaml")], overrides)
    tracker = RNGTracker(state.device)
    tracker.seed(SEED, state.tp_rank)
    padded = padded_vocab_size(shape.vocab, cfg.model.make_vocab_size_divisible_by, 1)
    return build_model("gpt", cfg, shape.vocab, padded, state, tracker)


@torch.no_grad()
def copy_llama_weights(ours: nn.Module, plain: PlainLlama, shape: Shape) -> None:
    """Our fused layouts into the plain model's separate matrices: QKV rows [group, (q x heads /
    groups, k, v), head_dim], fc1 rows [ffn, (gate, up)]; vocabulary rows past ``shape.vocab``
    (padding, never scored) dropped."""
    groups, head_dim = shape.groups, shape.hidden // shape.heads
    per = shape.heads // groups  # query heads per group
    ours_sd = ours.state_dict()
    plain.embed.weight.copy_(ours_sd["embedding.word.weight"][: shape.vocab])
    plain.lm_head.weight.copy_(ours_sd["output_layer.weight"][: shape.vocab])
    plain.norm.weight.copy_(ours_sd["transformer.final_ln.weight"])
    for i, block in enumerate(plain.blocks):
        o = f"transformer.layers.{i}."
        qkv = ours_sd[o + "attention.qkv.weight"].view(groups, per + 2, head_dim, shape.hidden)
        block.q.weight.copy_(qkv[:, :per].flatten(0, 2))  # query head g * per + j: group g's
        block.k.weight.copy_(qkv[:, per].flatten(0, 1))
        block.v.weight.copy_(qkv[:, per + 1].flatten(0, 1))
        block.o.weight.copy_(ours_sd[o + "attention.dense.weight"])
        block.attn_norm.weight.copy_(ours_sd[o + "ln1.weight"])
        block.mlp_norm.weight.copy_(ours_sd[o + "ln2.weight"])
        fc1 = ours_sd[o + "mlp.fc1.weight"]
        block.gate.weight.copy_(fc1[0::2])
        block.up.weight.copy_(fc1[1::2])
        block.down.weight.copy_(ours_sd[o + "mlp.fc2.weight"])


def gpt_pair(state: ParallelState, shape: Shape = GPT) -> tuple[nn.Module, nn.Module]:
    """Our GPT and the plain one, each initialised from SEED (alike, not equal)."""
    ours = build_ours("gpt_tiny", shape, state)
    torch.manual_seed(SEED)
    plain = PlainGPT(shape.vocab, shape.seq, shape.layers, shape.hidden, shape.heads)
    return ours, plain.to(state.device)


def llama_pair(state: ParallelState, shape: Shape = LLAMA) -> tuple[nn.Module, nn.Module]:
    """Our Llama and the plain one holding the same weights (llama_tiny's RoPE theta 500000 and
    RMSNorm epsilon 1e-5 are the plain model's defaults)."""
    ours = build_ours("llama_tiny", shape, state)
    s = shape
    plain = PlainLlama(s.vocab, s.layers, s.hidden, s.heads, s.groups, s.ffn).to(state.device)
    copy_llama_weights(ours, plain, shape)
    return ours, plain


ROWS = {"gpt": (gpt_pair, GPT), "llama": (llama_pair, LLAMA)}


def synchronize() -> None:
    """Wait for the GPU's queued kernels (if any), so that a clock read next has timed them."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_step(loss_fn: Callable[[], torch.Tensor], model: nn.Module) -> Callable[[], float]:
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


def time_row(name: str, state: ParallelState, args: argparse.Namespace) -> dict:
    """Median step times of row ``name``'s two models, steps interleaved."""
    pair, shape = ROWS[name]
    ours, plain = (m.train() for m in pair(state))
    g = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
    data = data.to(state.device)
    tokens, labels = data[:, :-1], data[:, 1:]
    steps = {
        "ours": make_step(lambda: ours(tokens, labels=labels).mean(), ours),
        "plain": make_step(lambda: plain(tokens, labels), plain),
    }
    times: dict[str, list[float]] = {key: [] for key in steps}
    for i in range(args.warmup + args.steps):
        for key, step in steps.items():  # interleaved: ours, plain, ours, plain, ...
            ms = step()
            if i >= args.warmup:
                times[key].append(ms)
    ours_ms, plain_ms = statistics.median(times["ours"]), statistics.median(times["plain"])
    return {
        "model": name,
        "ours_ms": round(ours_ms, 1),
        "plain_ms": round(plain_ms, 1),
        "ratio": round(ours_ms / plain_ms, 3),
        "threads": torch.get_num_threads(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    rows = [*ROWS, "startup"]
    parser.add_argument("--model", choices=[*rows, "all"], default="all", help="which row(s)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per model first")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chosen = rows if args.model == "all" else [args.model]
    state = initialize(1)
    for name in [n for n in chosen if n in ROWS]:
        print(json.dumps(time_row(name, state, args)), flush=True)
    shutdown()
    if "startup" in chosen:
        row = {"model": "startup", **measure_startup(), "loadavg": os.getloadavg()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
