"""configs/moe_tiny.yaml (8 routed SwiGLU experts, top-2, a shared expert, the first layer dense,
auxiliary and z losses on), shrunk, through pretrain_gpt's ``training.main`` in real gloo
processes, 20 iterations in fp32 without dropout.

- TP2, TP2+SP, PP2, CP2, and DP2 with the distributed optimizer, overlapped parameter gathers
  and full recomputation, against one process: the LM and auxiliary losses within 1e-5
  relative and gradient norms within 1e-4 (float reduction order only; the same bounds as
  tests/test_pipeline_training.py), and each layer's tokens-per-expert imbalance identical (the
  same tokens went to the same experts). With the expert bias on, every rank's bias after 20
  steps equals one process's.
- Checkpoints: resume is exact, and a TP2 checkpoint loads at TP1 and at PP2.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.distributed import run_distributed
from tests.gpt_run import read_metrics, tiny_overrides
from tests.test_llama_training import PP2, TP2, _generation
from tests.test_pipeline_training import _assert_same_run, _spawn
from tests.test_resume import metric_lines

CONFIG = "configs/moe_tiny.yaml"
SHAPE = {
    "model.num_layers": 4,
    "model.num_attention_heads": 4,
    "model.num_query_groups": 2,
    "model.ffn_hidden_size": 128,
    "model.moe_ffn_hidden_size": 32,
    "model.moe_shared_expert_intermediate_size": 64,
    "parallel.tensor_parallel_size": 1,
    "training.eval_interval": 10,
    "training.eval_iters": 1,
    "logging.tensorboard_dir": None,
}
LAYOUTS = {  # name: (world size, overrides), each compared with "ref"
    "tp2": (2, TP2),
    "tp2_sp": (2, {**TP2, "parallel.sequence_parallel": True}),
    "pp2": (2, PP2),
    "cp2": (2, {"parallel.context_parallel_size": 2}),
    "dp2": (
        2,
        {
            "parallel.distributed_optimizer": True,
            "parallel.overlap_param_gather": True,
            "model.recompute": "full",
            "parallel.ddp_bucket_size_mb": 0.01,
        },
    ),
}
BIAS = {"model.moe_router_enable_expert_bias": True, "model.moe_router_score_function": "sigmoid"}


def _run(gpt_data, tmp_path, name: str, **extra) -> tuple[str, str, list[str]]:
    keys = {**SHAPE, "data.cache_dir": tmp_path / "cache", **extra}
    return ("pretrain_gpt", CONFIG, tiny_overrides(gpt_data, tmp_path / name, **keys))


def _imbalances(run_dir) -> list[dict[str, float]]:
    return [
        {k: v for k, v in e.items() if k.startswith("moe_imbalance")}
        for e in read_metrics(run_dir / "metrics.jsonl")
    ]


def _biases(ckpt) -> list[tuple[str, list[float]]]:
    """(key, values) of every expert bias in the newest checkpoint, over its files."""
    step = f"iter_{int((ckpt / 'latest').read_text()):07d}"
    return sorted(
        (key, tensor.tolist())
        for path in (ckpt / step).glob("*.safetensors")
        for key, tensor in load_file(path).items()
        if key.endswith("expert_bias")
    )


@pytest.mark.slow
def test_moe_layouts_train_like_one_process(gpt_data, tmp_path):
    runs = [_run(gpt_data, tmp_path, "ref")]
    bias_save = {**BIAS, "checkpoint.save": tmp_path / "bias_ref" / "ckpt"}
    runs.append(_run(gpt_data, tmp_path, "bias_ref", **bias_save))
    _spawn(1, runs)
    two = [_run(gpt_data, tmp_path, n, **o) for n, (_, o) in LAYOUTS.items()]
    bias_tp2 = {**BIAS, **TP2, "parallel.sequence_parallel": True}
    bias_tp2["checkpoint.save"] = tmp_path / "bias_tp2" / "ckpt"
    two.append(_run(gpt_data, tmp_path, "bias_tp2", **bias_tp2))
    _spawn(2, two)

    ref = tmp_path / "ref"
    assert _imbalances(ref)[0], "the metrics carry the routing figures"
    for name in LAYOUTS:
        _assert_same_run(tmp_path / name / "metrics.jsonl", ref / "metrics.jsonl")
        got, want = (read_metrics(d / "metrics.jsonl") for d in (tmp_path / name, ref))
        for key in ("moe_aux_loss", "moe_z_loss"):
            assert [e[key] for e in got] == pytest.approx([e[key] for e in want], rel=1e-5)
        assert _imbalances(tmp_path / name) == _imbalances(ref), name
    want = _biases(tmp_path / "bias_ref" / "ckpt")
    assert len(want) == 3 and all(any(values) for _, values in want)  # moved off zero
    # Each TP rank's file holds its copy of the replicated bias: both equal one process's.
    assert _biases(tmp_path / "bias_tp2" / "ckpt") == sorted(want + want)


@pytest.mark.slow
def test_moe_resume_is_exact_and_checkpoints_reshard(gpt_data, tmp_path):
    """With the expert bias on (saved in checkpoints): a TP2 run stopped at iteration 10 and
    resumed writes the unbroken run's metrics lines exactly; the TP2 checkpoint of iteration 10
    loads at TP1 and at PP2, and the next loss is within 1e-5 of the unbroken TP1 run's; it
    generates at TP1 with the KV cache as the uncached forward does."""
    saved = tmp_path / "half" / "ckpt"
    exit_at_10 = {"checkpoint.save": tmp_path / "resume" / "ckpt", "training.exit_interval": 10}
    after_10 = {"checkpoint.load": saved, "training.exit_interval": 11}
    _spawn(2, [
        _run(gpt_data, tmp_path, "tp2", **BIAS, **TP2),
        *[_run(gpt_data, tmp_path, "resume", **BIAS, **TP2, **exit_at_10)] * 2,
        _run(gpt_data, tmp_path, "half", **BIAS, **TP2,
             **{"checkpoint.save": saved, "training.exit_interval": 10}),
        _run(gpt_data, tmp_path, "pp2_load", **BIAS, **PP2, **after_10),
    ])  # fmt: skip
    _spawn(1, [
        _run(gpt_data, tmp_path, "ref", **BIAS),
        _run(gpt_data, tmp_path, "tp1_load", **BIAS, **after_10),
    ])  # fmt: skip
    resumed = metric_lines(tmp_path / "resume" / "metrics.jsonl")
    assert resumed == metric_lines(tmp_path / "tp2" / "metrics.jsonl")
    ref = {e["iteration"]: e for e in read_metrics(tmp_path / "ref" / "metrics.jsonl")}
    for name in ("pp2_load", "tp1_load"):
        (line,) = read_metrics(tmp_path / name / "metrics.jsonl")
        assert line["iteration"] == 11, name
        for key in ("lm_loss", "moe_aux_loss"):
            assert line[key] == pytest.approx(ref[11][key], rel=1e-5), (name, key)
    # The TP2 checkpoint decodes at TP1: greedy tokens through the KV cache are the uncached
    # forward's argmax at each of them.
    for tokens, argmax in run_distributed(_generation, 1, str(saved))[0]:
        assert tokens == argmax
