"""Context parallelism through the real entrypoints: CP (x TP, x PP, x DP) trains like one process.

Every layout runs ``training.main`` of pretrain_gpt.py / pretrain_bert.py in real gloo processes
on a tiny fp32 model without dropout at seq 256, for 20 iterations, against the CP 1 run:
losses within 1e-5 relative and gradient norms within 1e-4 (float reduction order only: the
ring merges attention blocks in another order, the CP ranks' loss shares add up in another).

- CP 2 and 4; TP2 x CP2 with sequence parallelism; CP2 x PP2 plain and interleaved; CP2 x DP2
  with the distributed optimizer, overlapped parameter gathers and full recomputation: each for
  GPT with learned positions on whole samples, and for configs/llama_tiny.yaml's decoder (RoPE,
  RMSNorm, SwiGLU, grouped-query attention) on packed documents (positions restarting per
  document, attention stopping at their ends: masks across chunk boundaries); then the other
  data for each model at one layout (GPT's documents at CP 4, Llama's whole samples at CP 2),
  which keeps the suite's time in bounds;
- BERT (bidirectional: every block pair full; padding is masked around the ring) at CP 2;
- checkpoints: a CP2 run resumed from iteration 10 writes the unbroken run's lines exactly, and
  its iteration-10 checkpoint loads at CP 1 and at CP 4 with the next loss within 1e-5, and
  decodes (generation runs at CP 1) as the uncached forward does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.checkpoint.save import files_written_by
from megatron.parallel.state import ParallelState
from tests.distributed import run_distributed
from tests.gpt_run import read_metrics, tiny_overrides
from tests.test_llama_training import _generation
from tests.test_pipeline_training import _assert_same_run, _spawn
from tests.test_pretrain_bert import bert_data, bert_overrides  # noqa: F401 (fixture)
from tests.test_resume import metric_lines

SEQ = {"model.seq_length": 256, "model.max_position_embeddings": 256}
COMMON = {
    **SEQ,
    "model.num_layers": 4,  # PP 2 x 2 chunks of one layer
    "parallel.tensor_parallel_size": 1,
    "training.micro_batch_size": 2,
    "training.global_batch_size": 4,  # 2 micro-batches at DP 1, 1 at DP 2
    "training.eval_interval": 10,
    "training.eval_iters": 1,
    "logging.tensorboard_dir": None,
}
MODELS = {
    "gpt": ("configs/gpt_tiny.yaml", {"model.hidden_size": 32}),
    "llama": (
        "configs/llama_tiny.yaml",
        {"model.hidden_size": 64, "model.ffn_hidden_size": 128, "model.num_attention_heads": 8,
         "model.num_query_groups": 4},
    ),
}  # fmt: skip
DOCUMENTS = {"data.reset_position_ids": "true", "data.reset_attention_mask": "true"}
CP2, CP4 = {"parallel.context_parallel_size": 2}, {"parallel.context_parallel_size": 4}
PP2 = {"parallel.pipeline_parallel_size": 2}
LAYOUTS = {  # name: (world size, overrides), each against the CP 1 run of its model and data
    "cp2": (2, CP2),
    "cp4": (4, CP4),
    "tp2_cp2_sp": (
        4, {**CP2, "parallel.tensor_parallel_size": 2, "parallel.sequence_parallel": True}
    ),
    "cp2_pp2": (4, {**CP2, **PP2}),
    "cp2_pp2_v2": (4, {**CP2, **PP2, "parallel.virtual_pipeline_size": 2}),
    "cp2_dp2": (
        4,
        {**CP2, "parallel.distributed_optimizer": True, "parallel.overlap_param_gather": True,
         "parallel.ddp_bucket_size_mb": 0.01, "model.recompute": "full"},
    ),
}  # fmt: skip


def _run(data, tmp_path, model: str, name: str, **extra) -> tuple[str, str, list[str]]:
    config, shape = MODELS[model]
    keys = {**COMMON, **shape, "data.cache_dir": tmp_path / "cache", **extra}
    return ("pretrain_gpt", config, tiny_overrides(data, tmp_path / name, **keys))


# (model, data name, data overrides): the layouts each family runs
FAMILIES = {
    ("gpt", "plain", ()): list(LAYOUTS),
    ("llama", "docs", tuple(DOCUMENTS.items())): list(LAYOUTS),
    ("gpt", "docs", tuple(DOCUMENTS.items())): ["cp4"],
    ("llama", "plain", ()): ["cp2"],
}


@pytest.mark.slow
def test_context_parallel_layouts_train_like_one_process(gpt_data, tmp_path):
    runs: dict[int, list] = {1: [], 2: [], 4: []}
    for (model, data, keys), layouts in FAMILIES.items():
        runs[1].append(_run(gpt_data, tmp_path, model, f"{model}_{data}_ref", **dict(keys)))
        for layout in layouts:
            world, overrides = LAYOUTS[layout]
            name = f"{model}_{data}_{layout}"
            runs[world].append(_run(gpt_data, tmp_path, model, name, **dict(keys), **overrides))
    for world, group in runs.items():
        _spawn(world, group)
    for (model, data, _), layouts in FAMILIES.items():
        ref = tmp_path / f"{model}_{data}_ref" / "metrics.jsonl"
        for layout in layouts:
            _assert_same_run(tmp_path / f"{model}_{data}_{layout}" / "metrics.jsonl", ref)


@pytest.mark.slow
def test_context_parallel_checkpoints_resume_exactly_and_load_at_any_cp(gpt_data, tmp_path):
    saved = tmp_path / "cp2_save" / "ckpt"
    exit_at_10 = {**CP2, "checkpoint.save": tmp_path / "resume" / "ckpt"}
    exit_at_10["training.exit_interval"] = 10
    after_10 = {"checkpoint.load": saved, "training.exit_interval": 11}
    _spawn(2, [
        _run(gpt_data, tmp_path, "llama", "cp2", **CP2),
        *[_run(gpt_data, tmp_path, "llama", "resume", **exit_at_10)] * 2,  # 10, exit; 10 more
        _run(gpt_data, tmp_path, "llama", "cp2_save", **CP2, **{"checkpoint.save": saved,
                                                                "training.exit_interval": 10}),
    ])  # fmt: skip
    _spawn(4, [_run(gpt_data, tmp_path, "llama", "cp4_load", **CP4, **after_10)])
    _spawn(1, [
        _run(gpt_data, tmp_path, "llama", "ref"),
        _run(gpt_data, tmp_path, "llama", "cp1_load", **after_10),
    ])  # fmt: skip
    assert metric_lines(tmp_path / "resume" / "metrics.jsonl") == metric_lines(
        tmp_path / "cp2" / "metrics.jsonl"
    )
    ref = {e["iteration"]: e["lm_loss"] for e in read_metrics(tmp_path / "ref" / "metrics.jsonl")}
    for name in ("cp4_load", "cp1_load"):
        got = read_metrics(tmp_path / name / "metrics.jsonl")
        assert [e["iteration"] for e in got] == [11], name
        assert got[0]["lm_loss"] == pytest.approx(ref[11], rel=1e-5), name
    for tokens, argmax in run_distributed(_generation, 1, str(saved))[0]:
        assert tokens == argmax


@pytest.mark.slow
def test_bert_at_cp2_trains_like_one_process(bert_data, tmp_path):  # noqa: F811 (fixture)
    def run(name, **extra):
        keys = {**SEQ, "parallel.tensor_parallel_size": 1, "training.train_iters": 20, **extra}
        keys["training.eval_interval"] = 10
        return (
            "pretrain_bert",
            "configs/bert_tiny.yaml",
            bert_overrides(bert_data, tmp_path / name, **keys),
        )

    _spawn(1, [run("ref")])
    _spawn(2, [run("cp2", **CP2)])
    _assert_same_run(
        tmp_path / "cp2" / "metrics.jsonl", tmp_path / "ref" / "metrics.jsonl",
        ("lm_loss", "sop_loss"),
    )  # fmt: skip


@pytest.mark.parametrize("distributed", [False, True])
def test_one_writer_per_checkpoint_file(distributed):
    """Over a DP2 x PP2 x CP2 x TP2 grid: every file of a checkpoint has exactly one writer
    among the CP (and DP) replicas."""
    grid = torch.arange(16).view(2, 2, 2, 2)  # [dp, pp, cp, tp]
    writers: dict[str, list[int]] = {}
    for rank in range(16):
        dp, pp, cp, tp = (grid == rank).nonzero()[0].tolist()
        state = dataclasses.replace(
            ParallelState.serial(torch.device("cpu")),
            rank=rank, world_size=16, tp_size=2, tp_rank=tp, dp_size=2, dp_rank=dp, pp_size=2,
            pp_rank=pp, cp_size=2, cp_rank=cp,
        )  # fmt: skip
        for name in files_written_by(state, distributed):
            writers.setdefault(name, []).append(rank)
    assert all(len(ranks) == 1 for ranks in writers.values()), writers
    shards = [n for n in writers if n.startswith("model_")]
    assert len(shards) == 4  # (TP 2) x (PP 2), each written once
    optim = [n for n in writers if n.startswith("optim_")]
    assert len(optim) == (16 if distributed else 0)  # one shard per DP x CP replica and (TP, PP)
