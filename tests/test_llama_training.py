"""configs/llama_tiny.yaml (RoPE with Llama 3.1's scaling, RMSNorm, SwiGLU, 8 heads in 4 query
groups, no biases, untied output), shrunk, through pretrain_gpt's ``training.main`` in real gloo
processes, on packed documents (positions restarting per document, the document mask).

- TP2, TP2+SP, PP2 (plain and interleaved) and TP2xPP2, and TP2xDP2 with the distributed
  optimizer, overlapped parameter gathers and full recomputation, against TP1xPP1: losses
  within 1e-5 relative and gradient norms within 1e-4, as tests/test_pipeline_training.py
  allows (float reduction order only).
- Resume at TP2: 10 iterations, exit, 10 more in a new run write the 20-iteration run's
  metrics lines exactly.
- One host sync per iteration at TP2 with QK norms (their gradients' TP all-reduce included).
- The TP2xPP2 checkpoint of iteration 10 loads at TP4 (reshard on load) and, merged by
  tools/checkpoint_util.py, at TP1: the next loss within 1e-5 of the unbroken TP1 run; the
  merged one then decodes greedily with the KV cache as the uncached forward does.

One spawn per world size runs its layouts one after another (tests/test_pipeline_training.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.gpt_run import read_metrics, tiny_overrides
from tests.test_host_syncs import ITERS, QUIET, _syncs_per_iteration
from tests.test_pipeline_training import _assert_same_run, _spawn
from tests.test_resume import metric_lines
from tools.checkpoint_util import main as checkpoint_util

CONFIG = "configs/llama_tiny.yaml"
SHAPE = {
    "model.num_layers": 4,  # PP=2 x 2 chunks of one layer
    "model.num_attention_heads": 8,
    "model.num_query_groups": 4,  # whole groups at TP=4 too
    "model.ffn_hidden_size": 128,
    "model.rope_scaling": "{factor: 8, low_freq_factor: 1, high_freq_factor: 4, "
    "original_max_position_embeddings: 64}",
    "data.reset_position_ids": "true",
    "data.reset_attention_mask": "true",
    "parallel.tensor_parallel_size": 1,
    "training.eval_interval": 10,
    "training.eval_iters": 1,
    "logging.tensorboard_dir": None,
}
TP2, PP2 = {"parallel.tensor_parallel_size": 2}, {"parallel.pipeline_parallel_size": 2}
LAYOUTS = {  # name: (world size, overrides), each compared with "ref"
    "tp2": (2, TP2),
    "tp2_sp": (2, {**TP2, "parallel.sequence_parallel": True}),
    "pp2": (2, PP2),
    "pp2_v2": (2, {**PP2, "parallel.virtual_pipeline_size": 2}),
    "tp2_dp2": (
        4,
        {
            **TP2,
            "parallel.distributed_optimizer": True,
            "parallel.overlap_param_gather": True,
            "model.recompute": "full",
            "parallel.ddp_bucket_size_mb": 0.01,
        },
    ),  # fmt: skip
}


def _run(gpt_data, tmp_path, name: str, **extra) -> tuple[str, str, list[str]]:
    keys = {**SHAPE, "data.cache_dir": tmp_path / "cache", **extra}
    return ("pretrain_gpt", CONFIG, tiny_overrides(gpt_data, tmp_path / name, **keys))


def _generation(ckpt: str) -> list[tuple[list[int], list[int]]]:
    """Greedy tokens through the KV cache, and the uncached forward's argmax at each of them."""
    from megatron.inference.generation import generate
    from megatron.inference.loading import load_for_inference

    loaded = load_for_inference(ckpt, [])
    prompts = [[5, 6, 7, 8], [40, 41]]
    out = []
    for prompt, gen in zip(prompts, generate(loaded.model, prompts, 6, 0, stop_at_eod=False)):
        with torch.no_grad():
            logits = loaded.model(torch.tensor([prompt + gen.tokens]))[0, len(prompt) - 1 : -1]
        out.append((gen.tokens, logits[:, : loaded.model.vocab_size].argmax(-1).tolist()))
    return out


@pytest.mark.slow
def test_llama_layouts_train_resume_and_reshard_like_one_process(gpt_data, tmp_path):
    saved = tmp_path / "tp2_pp2" / "ckpt"
    exit_at_10 = {"checkpoint.save": tmp_path / "resume" / "ckpt", "training.exit_interval": 10}
    resume = tmp_path / "resume" / "metrics.jsonl"
    two = [_run(gpt_data, tmp_path, n, **o) for n, (w, o) in LAYOUTS.items() if w == 2]
    two += [_run(gpt_data, tmp_path, "resume", **TP2, **exit_at_10)] * 2  # 10, exit; 10 more
    _spawn(2, two)
    after_10 = {"checkpoint.load": saved, "training.exit_interval": 11}
    _spawn(4, [
        _run(gpt_data, tmp_path, "tp2_dp2", **LAYOUTS["tp2_dp2"][1]),
        _run(gpt_data, tmp_path, "tp2_pp2", **TP2, **PP2, **{"checkpoint.save": saved,
                                                             "training.exit_interval": 10}),
        _run(gpt_data, tmp_path, "tp4_load", **after_10, **{"parallel.tensor_parallel_size": 4}),
    ])  # fmt: skip
    merged = tmp_path / "merged"
    assert checkpoint_util(["--input", str(saved), "--output", str(merged), "--merge"]) == 0
    from_merged = {**after_10, "checkpoint.load": merged}
    _spawn(
        1, [_run(gpt_data, tmp_path, "ref"), _run(gpt_data, tmp_path, "tp1_load", **from_merged)]
    )

    ref = tmp_path / "ref" / "metrics.jsonl"
    for name in LAYOUTS:
        _assert_same_run(tmp_path / name / "metrics.jsonl", ref)
    assert metric_lines(resume) == metric_lines(tmp_path / "tp2" / "metrics.jsonl")
    ref_losses = {e["iteration"]: e["lm_loss"] for e in read_metrics(ref)}
    for name, iterations in [("tp2_pp2", range(1, 11)), ("tp4_load", [11]), ("tp1_load", [11])]:
        got = {
            e["iteration"]: e["lm_loss"] for e in read_metrics(tmp_path / name / "metrics.jsonl")
        }
        assert sorted(got) == list(iterations), name
        for i in iterations:
            assert got[i] == pytest.approx(ref_losses[i], rel=1e-5), (name, i)
    for tokens, argmax in run_distributed(_generation, 1, str(merged))[0]:
        assert tokens == argmax


@pytest.mark.slow
def test_one_host_sync_per_iteration(gpt_data, tmp_path):
    """pretrain_gpt's main on two ranks with every decoder option of llama_tiny (over the GPT
    demo config: _syncs_per_iteration reads configs/gpt_tiny.yaml) plus QK norms."""
    llama = {
        "model.position_embedding_type": "rope",
        "model.normalization": "rmsnorm",
        "model.activation": "swiglu",
        "model.num_query_groups": 2,
        "model.add_bias_linear": "false",
        "model.qk_layernorm": "true",
        "model.untie_embeddings_and_output_weights": "true",
    }
    overrides = tiny_overrides(gpt_data, tmp_path, **{**QUIET, **TP2, **llama})
    assert run_distributed(_syncs_per_iteration, 2, "gpt", overrides) == [[1] * ITERS] * 2
