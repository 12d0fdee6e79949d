"""Which scaled-dot-product-attention backend runs GPT's causal and BERT's padded attention.

Two views. ``backends``: the attention call the models make (causal with dropout; an additive
padding mask [b, 1, 1, s] with dropout), restricted to one backend at a time with
``sdpa_kernel``, forward and backward: which backends accept it. ``ran``: the attention operators
and kernels the profiler sees in a forward and backward of each real model (2 layers of the
plan's heads and head width), which is what training uses by default.

    python -m tools.gpu_check.sdpa --batch 8 --heads 16 --seq 1024 --head-dim 96
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from megatron.config.load import load_config
from megatron.models.build import build_model
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState
from tools.gpu_check.environment import ROOT

BACKENDS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
# Profiler names that say which attention ran: aten's per-backend operators (the CPU's
# "_flash_attention_for_cpu" too) and the CUDA kernels behind them (flash, cutlass fmha, cuDNN).
_ATTENTION = re.compile(r"scaled_dot_product|flash|fmha|efficient_attention|cudnn|sdpa", re.I)
_VOCAB = 1000


def _qkv(shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    b, a, s, d = shape["batch"], shape["heads"], shape["seq"], shape["head_dim"]
    return [torch.randn(b, a, s, d, device=device, dtype=dtype, requires_grad=True) for _ in "qkv"]


def _padding_mask(shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """BERT's mask: 0 on real keys, -inf on padding (the last quarter of every other sample)."""
    b, s = shape["batch"], shape["seq"]
    hidden = torch.zeros(b, 1, 1, s, dtype=torch.bool, device=device)
    hidden[::2, ..., 3 * s // 4 :] = True
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, -torch.inf)


def probe_backends(shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> dict:
    """For each case and backend: ``ok``, or the first line of the error it raised."""
    cases = {
        "gpt_causal": {"is_causal": True},
        "bert_padding_mask": {"attn_mask": _padding_mask(shape, device, dtype)},
    }
    results: dict[str, dict[str, str]] = {}
    for case, kwargs in cases.items():
        results[case] = {}
        for name in BACKENDS:
            q, k, v = _qkv(shape, device, dtype)
            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    F.scaled_dot_product_attention(
                        q, k, v, dropout_p=0.1, **kwargs
                    ).sum().backward()
                results[case][name] = "ok"
            except RuntimeError as e:
                results[case][name] = str(e).strip().splitlines()[0][:300]
    return results


def _models(shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    heads, head_dim, seq = shape["heads"], shape["head_dim"], shape["seq"]
    # The tiny GPT config at the plan's shape: its other model keys are the defaults (dropout
    # 0.1, as in the probe), and BERT's heads too.
    shaped = {"num_layers": 2, "hidden_size": heads * head_dim, "num_attention_heads": heads}
    shaped |= {"seq_length": seq, "max_position_embeddings": seq}
    overrides = [f"model.{key}={value}" for key, value in shaped.items()]
    cfg = load_config([str(ROOT / "configs" / "gpt_tiny.yaml")], overrides)
    state = ParallelState.serial(device)
    tracker = RNGTracker(device)
    tracker.seed(1234, 0)
    padded = -(-_VOCAB // 128) * 128
    gpt = build_model("gpt", cfg, _VOCAB, padded, state, tracker).to(dtype)
    bert = build_model("bert", cfg, _VOCAB, padded, state, tracker).to(dtype)
    return {"gpt": gpt, "bert": bert}


def profile_models(shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> dict:
    """The attention operator and kernel names in one training forward and backward of each."""
    b, s = shape["batch"], shape["seq"]
    tokens = torch.randint(0, _VOCAB, (b, s), device=device)
    positions = torch.arange(s, device=device)[None].expand(b, s)
    padding = torch.ones(b, s, dtype=torch.long, device=device)
    padding[::2, 3 * s // 4 :] = 0
    labels = torch.where(torch.rand(b, s, device=device) < 0.15, tokens, -1)
    labels[:, 1] = tokens[:, 1]  # at least one masked position per sample
    calls = {
        "gpt": lambda m: m(tokens, positions, None, labels=tokens).sum(),
        "bert": lambda m: m(tokens, torch.zeros_like(tokens), padding, labels=labels)[0].sum(),
    }
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    ran = {}
    for name, model in _models(shape, device, dtype).items():
        model.train()
        calls[name](model).backward()  # warm-up: first-call autotuning is not what training runs
        with profile(activities=activities) as prof:
            calls[name](model).backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
        ran[name] = sorted({e.key for e in prof.key_averages() if _ATTENTION.search(e.key)})
    return ran


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key in ("batch", "heads", "seq", "head-dim"):
        parser.add_argument(f"--{key}", type=int, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    shape = {"batch": args.batch, "heads": args.heads, "seq": args.seq, "head_dim": args.head_dim}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    figures = {
        "device_type": device.type,
        "dtype": args.dtype,
        "shape": shape,
        "dropout_p": 0.1,
        "backends": probe_backends(shape, device, dtype),
        "ran": profile_models(shape, device, dtype),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
