"""Mixture of experts: the MoE layer against a dense SwiGLU MLP of the same active parameters,
a training step against transformers' MixtralForCausalLM, and the tokens-per-expert imbalance
that each balancing method leaves after 50 iterations on the sample corpus.

- ``layer``: one MoE layer (8 experts of width 256, top-2, h 256, 2048 tokens; dropless,
  no balancing loss) forward and backward, against ``ParallelMLP`` with SwiGLU of width 512
  (the same active expert parameters; the router's h x E is the difference). Goal: at most 1.3x.
- ``mixtral``: forward, backward, torch AdamW step and zero_grad of a Mixtral-shaped model (4
  layers, h 256, 8 heads in 2 groups, 8 experts of width 256, top-2, vocab 32000, seq 256,
  batch 8), ours (configs/moe_tiny.yaml's options, the shared expert off, every layer MoE) against
  ``MixtralForCausalLM`` of the same shape (weights alike, not equal). Goal: at most 0.9x.
- ``balance``: pretrain_gpt.py on the sample corpus, 50 iterations of moe_tiny's shape (one
  process): the last 10 iterations' mean of each layer's max/mean tokens per expert, with the
  auxiliary loss off, on (1e-2), and with the expert bias instead (sigmoid scores, rate 1e-3,
  and 1e-2).
- ``ep``: expert parallelism 2 against 1 (every rank every expert) at DP 2 and the same global
  batch, through the entrypoint (moe_tiny, h 256, experts of width 256): the median step time,
  each rank's expert parameter bytes against the estimate's (``megatron.estimate``), and the
  bytes the two ranks' one micro-batch hands to all-to-all against the formula.

The two models of a timed row live in this process and their steps alternate, so a busy
neighbour slows both alike; medians after warm-up. Prints one JSON line per row.

    .venv/bin/python benchmarks/bench_moe.py [--row layer|mixtral|balance|all]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gpt_step import Shape, build_ours, make_step, synchronize  # noqa: E402
from megatron.models.moe.dispatch import grouped_mm_runs  # noqa: E402
from megatron.models.moe.layer import MoELayer  # noqa: E402
from megatron.models.moe.stats import RoutingStats  # noqa: E402
from megatron.models.transformer import ParallelMLP, init_methods  # noqa: E402
from megatron.parallel.random import RNGTracker  # noqa: E402
from megatron.parallel.state import ParallelState, initialize, shutdown  # noqa: E402
from tests.gpt_run import prepare_gpt_data, read_metrics, run_pretrain, tiny_overrides  # noqa: E402
from tests.model_config import tiny_model_config  # noqa: E402

SEED = 1234
MIXTRAL = Shape(layers=4, hidden=256, heads=8, vocab=32000, seq=256, batch=8, groups=2, ffn=256)
MOE = {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 256}


def _compare(steps: dict, args: argparse.Namespace, goal: float) -> dict[str, float]:
    """The two ``steps`` (ours first) run interleaved: each one's median ms, and their ratio."""
    times: dict[str, list[float]] = {key: [] for key in steps}
    for i in range(args.warmup + args.steps):
        for key, step in steps.items():
            ms = step()
            if i >= args.warmup:
                times[key].append(ms)
    (ours, ours_ms), (other, other_ms) = ((k, statistics.median(v)) for k, v in times.items())
    ratio = round(ours_ms / other_ms, 3)
    return {f"{ours}_ms": round(ours_ms, 2), f"{other}_ms": round(other_ms, 2), "ratio": ratio,
            "goal": goal}  # fmt: skip


def _timed(fn) -> float:
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return (time.perf_counter() - start) * 1e3


def layer_row(state: ParallelState, args: argparse.Namespace) -> dict:
    cfg = tiny_model_config(
        hidden_size=256, num_attention_heads=8, ffn_hidden_size=512, activation="swiglu",
        add_bias_linear=False, **MOE,
    )  # fmt: skip
    tracker = RNGTracker(state.device)
    tracker.seed(SEED, 0)
    init, out_init = init_methods(cfg, tracker.init_generator(0))
    moe = MoELayer(cfg, state, tracker, init, out_init, 0, RoutingStats(cfg, state, False))
    dense = ParallelMLP(cfg, state, tracker.init_generator(1))
    x = torch.randn(8, 256, 256, device=state.device, requires_grad=True)
    grad = torch.randn_like(x)
    steps = {
        name: (lambda m=m: _timed(lambda: m(x).backward(grad)))
        for name, m in (("moe", moe.train()), ("dense", dense.train()))
    }
    return {
        "row": "layer",
        **_compare(steps, args, goal=1.3),
        "grouped_gemm": grouped_mm_runs(x.detach().view(-1, 256), moe.experts.fc1),
    }


def mixtral_row(state: ParallelState, args: argparse.Namespace) -> dict:
    from transformers import MixtralConfig, MixtralForCausalLM

    s = MIXTRAL
    mixtral = {"moe_ffn_hidden_size": s.ffn, "moe_shared_expert_intermediate_size": None}
    mixtral |= {"moe_layer_freq": 1, "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 0.0}
    ours = build_ours("moe_tiny", s, state, mixtral)
    hf_cfg = MixtralConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.groups,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=s.seq,
        rope_theta=500000.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(SEED)
    hf = MixtralForCausalLM(hf_cfg).to(state.device)
    g = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=g).to(state.device)
    tokens, labels = data[:, :-1], data[:, 1:]
    steps = {
        "ours": make_step(lambda: ours(tokens, labels=labels).mean(), ours.train()),
        "hf": make_step(lambda: hf(input_ids=tokens, labels=tokens).loss, hf.train()),
    }
    return {
        "row": "mixtral",
        **_compare(steps, args, goal=0.9),
        "params_ours": sum(p.numel() for p in ours.parameters()),
        "params_hf": sum(p.numel() for p in hf.parameters()),
    }


BALANCING = {
    "none": {"model.moe_aux_loss_coeff": 0.0, "model.moe_z_loss_coeff": 0.0},
    "aux_loss": {"model.moe_aux_loss_coeff": 1e-2, "model.moe_z_loss_coeff": 0.0},
    "expert_bias": {
        "model.moe_aux_loss_coeff": 0.0,
        "model.moe_z_loss_coeff": 0.0,
        "model.moe_router_score_function": "sigmoid",
        "model.moe_router_enable_expert_bias": True,
    },
}
# DeepSeek-V3's rate, 1e-3, moves a bias by 0.05 in 50 steps; ten times it shows the mechanism in
# this benchmark's span.
BALANCING["expert_bias_rate_1e-2"] = {
    **BALANCING["expert_bias"],
    "model.moe_router_bias_update_rate": 1e-2,
}


def balance_row() -> dict:
    out: dict = {"row": "balance", "iterations": 50}
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_gpt_data(Path(tmp))
        for name, keys in BALANCING.items():
            run = Path(tmp) / name
            shape = {"model.num_layers": 4, "model.hidden_size": 128, "model.seq_length": 128}
            shape |= {"model.max_position_embeddings": 128, "training.train_iters": 50}
            shape |= {"training.eval_iters": 0, "parallel.tensor_parallel_size": 1, **keys}
            run_pretrain(
                "pretrain_gpt.py", "configs/moe_tiny.yaml", tiny_overrides(data, run, **shape)
            )
            last = read_metrics(run / "metrics.jsonl")[-10:]
            layers = sorted({k for e in last for k in e if k.startswith("moe_imbalance")})
            out[name] = [round(statistics.mean(e[k] for e in last), 3) for k in layers]
    return out


EP_SHAPE = {
    "model.num_layers": 4,
    "model.hidden_size": 256,
    "model.seq_length": 128,
    "model.max_position_embeddings": 128,
    "model.moe_ffn_hidden_size": 256,
    "training.micro_batch_size": 4,
    "training.global_batch_size": 16,
    "training.eval_iters": 0,
    "parallel.tensor_parallel_size": 1,
}


def _exchange(ep: int, shape: dict) -> dict:
    """In a rank of a 2-process world: its expert parameter bytes at ``ep``, and the bytes one
    micro-batch's forward and backward hand to all-to-all, counted and by the formula."""
    import torch.distributed as dist

    from megatron.config.load import load_config
    from megatron.estimate.parameters import count_parameters
    from megatron.models.build import build_model
    from megatron.parallel.experts import is_expert
    from megatron.parallel.state import initialize

    overrides = [f"{k}={v}" for k, v in shape.items()] + [f"parallel.expert_parallel_size={ep}"]
    cfg = load_config([str(ROOT / "configs" / "moe_tiny.yaml")], overrides)
    m = cfg.model
    st = initialize(1, ep_size=ep)
    tracker = RNGTracker(st.device)
    tracker.seed(SEED, 0)
    model = build_model("gpt", cfg, 512, 512, st, tracker)
    expert_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if is_expert(p))
    b, s = cfg.training.micro_batch_size, m.seq_length
    tokens = torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(st.rank))
    sent = [0]
    real = dist.all_to_all_single

    def counted(out, x, *args, **kwargs):
        sent[0] += x.numel() * x.element_size()
        return real(out, x, *args, **kwargs)

    dist.all_to_all_single = counted
    try:
        model(tokens, labels=tokens).mean().backward()
    finally:
        dist.all_to_all_single = real
    layers = sum(m.moe_layers)
    rows = b * s * m.moe_router_topk * m.hidden_size * 4  # one exchange of every routed row
    counts = m.num_experts * 8  # int64 counts per expert
    formula = layers * (counts + 4 * rows) if ep > 1 else 0  # two ways forward, two backward
    held = count_parameters(m, 512, 1, ep_size=ep).experts_per_gpu * 4  # fp32
    return {"expert_bytes": expert_bytes, "expert_bytes_estimate": held,
            "all_to_all_bytes": sent[0], "all_to_all_formula": formula}  # fmt: skip


def ep_row() -> dict:
    """EP2 against EP1 (every rank all experts) at DP 2 and the same global batch: the
    entrypoint's median step time, each rank's expert bytes, the group's all-to-all bytes."""
    from tests.distributed import run_distributed

    out: dict = {"row": "ep", "world": 2}
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_gpt_data(Path(tmp))
        for ep in (1, 2):
            run = Path(tmp) / f"ep{ep}"
            keys = {**EP_SHAPE, "training.train_iters": 25, "parallel.expert_parallel_size": ep}
            overrides = tiny_overrides(data, run, **keys)
            run_pretrain("pretrain_gpt.py", "configs/moe_tiny.yaml", overrides, nproc=2)
            times = [e["ms_per_iter"] for e in read_metrics(run / "metrics.jsonl")[5:]]
            out[f"ep{ep}_ms"] = round(statistics.median(times), 1)
            ranks = run_distributed(_exchange, 2, ep, EP_SHAPE)
            # A rank sends its n routed rows and returns the m it received: over the EP group
            # the m add up to the n, so the group's bytes are the formula's, a rank's are not.
            out[f"ep{ep}"] = {
                "expert_bytes_per_rank": [r["expert_bytes"] for r in ranks],
                "expert_bytes_estimate": ranks[0]["expert_bytes_estimate"],
                "all_to_all_bytes": sum(r["all_to_all_bytes"] for r in ranks),
                "all_to_all_formula": sum(r["all_to_all_formula"] for r in ranks),
            }
    out["ratio"] = round(out["ep2_ms"] / out["ep1_ms"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    rows = ["layer", "mixtral", "balance", "ep", "all"]
    parser.add_argument("--row", choices=rows, default="all")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    state = initialize(1)
    load = {"threads": args.threads, "loadavg": [round(x, 2) for x in os.getloadavg()]}
    if args.row in ("layer", "all"):
        print(json.dumps({**layer_row(state, args), **load}), flush=True)
    if args.row in ("mixtral", "all"):
        print(json.dumps({**mixtral_row(state, args), **load}), flush=True)
    shutdown()
    if args.row in ("balance", "all"):
        print(json.dumps(balance_row()), flush=True)
    if args.row in ("ep", "all"):
        print(json.dumps(ep_row()), flush=True)


if __name__ == "__main__":
    main()
