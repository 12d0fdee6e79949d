"""Pipeline parallelism through the real entrypoints: PP (x TP, x DP) trains like one process.

Every layout runs ``training.main`` of pretrain_gpt.py / pretrain_bert.py in real gloo processes
on one tiny fp32 model without dropout; the losses and gradient norms of 20 iterations are
compared with the TP=1 x PP=1 run. The stages hold exactly the whole model's layers (a layer
draws from its own stream), so the runs differ only in float reduction order: the pipeline moves
activations unchanged, and the gradient norm is summed over TP and PP (and DP
shards) in fp64. 1e-5 relative on the losses and 1e-4 on the norms leave room for that order,
not for a wrong gradient (left unsummed over the stages, the tied word table's gradient moves the
first norm by 5% and the third loss by 8e-5, relative).

Spawns are shared: one set of processes runs several layouts one after another, each with its
own rendezvous port. The exit signal and a killed stage use real processes as
tests/test_preemption.py and tests/test_hang.py do.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time

import pytest
import torch

from megatron.checkpoint import find_latest
from megatron.checkpoint.format import checkpoint_name, shard_file, verify_checkpoint
from megatron.models.bert import BertModel
from megatron.models.gpt import GPTModel
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState
from tests.distributed import rendezvous_ports, run_distributed
from tests.gpt_run import read_metrics, start_torchrun, tiny_overrides
from tests.model_config import tiny_model_config
from tests.test_hang import launch_ranks
from tests.test_preemption import wait_for_iterations, worker_pids
from tests.test_pretrain_bert import bert_data, bert_overrides  # noqa: F401 (fixture)

GPT, BERT = ("pretrain_gpt", "configs/gpt_tiny.yaml"), ("pretrain_bert", "configs/bert_tiny.yaml")
# 8 layers: 4 stages x 2 chunks of one layer each; 4 micro-batches at DP=1, 2 at DP=2.
GPT_SHAPE = {
    "parallel.tensor_parallel_size": 1,
    "model.num_layers": 8,
    "model.hidden_size": 32,
    "model.seq_length": 16,
    "model.max_position_embeddings": 16,
    "training.eval_interval": 10,
    "training.eval_iters": 1,
    "logging.tensorboard_dir": None,
}
PLAIN, INTERLEAVED = {}, {"parallel.virtual_pipeline_size": 2}
WORLD4 = {  # each with the plain and the interleaved schedule
    "pp4": {"parallel.pipeline_parallel_size": 4},
    "tp2_pp2": {"parallel.tensor_parallel_size": 2, "parallel.pipeline_parallel_size": 2},
    # Small DP buckets (~2600 values), so that several are reduced during backward.
    "pp2_dp2": {"parallel.pipeline_parallel_size": 2, "parallel.ddp_bucket_size_mb": 0.01},
}
# The interleaved runs add what must keep working with PP > 1 (reduction order only).
EXTRAS = {
    "tp2_pp2": {"parallel.sequence_parallel": True},
    "pp2_dp2": {"parallel.distributed_optimizer": True, "model.recompute": "full"},
}


def _stage(model_cls, pp: int, stage: int, chunks: int = 1):
    """Stage ``stage`` of ``pp`` of a 4-layer model, built as in a run (seed 1234); no process
    group is needed to build one at TP=1."""
    state = dataclasses.replace(
        ParallelState.serial(torch.device("cpu")), pp_size=pp, pp_rank=stage
    )
    tracker = RNGTracker(state.device)
    tracker.seed(1234, 0)
    return model_cls(tiny_model_config(num_layers=4), 250, 256, state, tracker, chunks=chunks)


@pytest.mark.parametrize("model_cls", [GPTModel, BertModel])
@pytest.mark.parametrize(("pp", "chunks"), [(2, 1), (4, 1), (2, 2)])
def test_stages_hold_the_whole_models_tensors_under_its_names(model_cls, pp, chunks):
    """The checkpoint contract: every stage's state_dict is the PP=1 model's, restricted to the
    layers it holds (by global index) plus embeddings on the first stage and the heads (GPT: the
    tied word table's copy) on the last, with equal values; together the stages hold it all."""
    whole = _stage(model_cls, 1, 0).state_dict()
    seen = set()
    for stage in range(pp):
        held = _stage(model_cls, pp, stage, chunks).state_dict()
        layers = {int(k.split(".")[2]) for k in held if k.startswith("transformer.layers.")}
        per_chunk = 4 // (pp * chunks)
        want = {(c * pp + stage) * per_chunk + i for c in range(chunks) for i in range(per_chunk)}
        assert layers == want
        for key, value in held.items():
            assert torch.equal(value, whole[key]), key
        ends = {k.split(".")[0] for k in held if not k.startswith("transformer.layers.")}
        first = {"embedding"} if stage == 0 else set()
        last = {"embedding", "transformer", "lm_head", "pooler", "binary_head"}
        last = last if model_cls is BertModel else {"embedding", "transformer"}
        assert ends == first | (last if stage == pp - 1 else set()), (stage, ends)
        if stage == pp - 1:  # the tied head's copy of the word table, nothing else of it
            assert {k for k in held if k.startswith("embedding.")} == {"embedding.word.weight"}
        seen |= set(held)
    assert seen == set(whole)


def _train(runs: list[tuple[str, str, list[str]]]) -> list[dict[str, list]]:
    """In a spawned rank: ``training.main`` of each (entrypoint module, config, overrides), one
    after another, each on its own rendezvous port. Per run and training step: "in_flight",
    (stage, most micro-batches in flight) of its schedule on this rank, and "buckets", (DP
    buckets launched during backward, buckets, held ones) when finish_grad_sync is called."""
    import importlib

    from megatron.parallel.data_parallel import DataParallel
    from megatron.parallel.pipeline import max_in_flight
    from megatron.parallel.pipeline.stage import PipelineStage
    from megatron.training.pretrain import main

    run, finish = PipelineStage.run, DataParallel.finish_grad_sync
    recorded: dict[str, list] = {"in_flight": [], "buckets": []}

    def recorded_run(self, batches, num_micro, *args, **kwargs):
        sums, result = run(self, batches, num_micro, *args, **kwargs)
        if not kwargs.get("forward_only"):
            recorded["in_flight"].append((self.state.pp_rank, max_in_flight(result.events)))
        return sums, result

    def recorded_finish(self):
        held = sum(b.held for b in self.buckets)
        recorded["buckets"].append((self._next, len(self.buckets), held))
        finish(self)

    PipelineStage.run, DataParallel.finish_grad_sync = recorded_run, recorded_finish
    per_run, ports = [], rendezvous_ports()
    for module, config, overrides in runs:
        os.environ["MASTER_PORT"] = next(ports)
        entry = importlib.import_module(module)
        providers = entry.datasets_provider, entry.forward_step
        model_type = module.removeprefix("pretrain_")
        code = main(["--config", config, *overrides], "", *providers, model_type=model_type)
        assert code == 0, (module, overrides)
        per_run.append({k: list(v) for k, v in recorded.items()})
        for values in recorded.values():
            values.clear()
    return per_run


def _spawn(world: int, runs: list[tuple[str, str, list[str]]]) -> list[list[dict[str, list]]]:
    return run_distributed(_train, world, runs, timeout=600)


def _gpt(gpt_data, tmp_path, name: str, **extra) -> tuple[str, str, list[str]]:
    keys = {**GPT_SHAPE, "data.cache_dir": tmp_path / "cache", **extra}
    return (*GPT, tiny_overrides(gpt_data, tmp_path / name, **keys))


def _lines(path) -> tuple[list[dict], list[dict]]:
    """(training lines, validation lines) of a metrics file."""
    import json

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return read_metrics(path), [e for e in lines if "lm_loss_validation" in e]


def _assert_same_run(run_dir, ref_dir, losses: tuple[str, ...] = ("lm_loss",)) -> None:
    (train, valid), (ref_train, ref_valid) = _lines(run_dir), _lines(ref_dir)
    assert [e["iteration"] for e in train] == [e["iteration"] for e in ref_train]
    for got, want in zip(train, ref_train):
        for key in losses:
            assert got[key] == pytest.approx(want[key], rel=1e-5), (run_dir, got, want)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (run_dir, got)
    assert len(valid) == len(ref_valid) > 0
    for got, want in zip(valid, ref_valid):
        for key in losses:
            key = f"{key}_validation"
            assert got[key] == pytest.approx(want[key], rel=1e-5), (run_dir, got, want)


@pytest.mark.slow
def test_gpt_layouts_train_like_one_process(gpt_data, tmp_path):
    """PP=2, PP=4, TP2xPP2 and PP2xDP2, each plain and interleaved, against TP1xPP1; in the
    plain 1F1B PP=4 run stage s keeps at most 4 - s micro-batches in flight (4 per step); the DP
    gradient sync overlaps the schedule's backwards."""
    _spawn(1, [_gpt(gpt_data, tmp_path, "ref")])
    names = ["pp2", "pp2_v2"]
    pp2 = {"parallel.pipeline_parallel_size": 2}
    _spawn(
        2, [_gpt(gpt_data, tmp_path, n, **pp2, **s) for n, s in zip(names, (PLAIN, INTERLEAVED))]
    )
    runs = []
    for name, layout in WORLD4.items():
        runs.append(_gpt(gpt_data, tmp_path, name, **layout))
        extra = {**layout, **INTERLEAVED, **EXTRAS.get(name, {})}
        runs.append(_gpt(gpt_data, tmp_path, f"{name}_v2", **extra))
        names += [name, f"{name}_v2"]
    per_rank = _spawn(4, runs)
    for name in names:
        _assert_same_run(tmp_path / name / "metrics.jsonl", tmp_path / "ref" / "metrics.jsonl")
    # The plain PP=4 run: 4 micro-batches per step, so stage s holds exactly 4 - s at most.
    for records in (rank[0]["in_flight"] for rank in per_rank):
        assert len(records) == 20
        assert {most for _, most in records} == {4 - records[0][0]}, records
    # PP2xDP2, both schedules: every bucket but the one holding the tied word table (the last:
    # the embedding is registered first) was reduced during the schedule's backwards.
    for rank in per_rank:
        for run in rank[names.index("pp2_dp2") - 2 :]:
            assert len(run["buckets"]) == 20 and len(set(run["buckets"])) == 1, run["buckets"]
            launched, buckets, held = run["buckets"][0]
            assert held == 1 and launched == buckets - 1 > 1, run["buckets"]


@pytest.mark.slow
def test_bert_pp2_trains_like_one_process(bert_data, tmp_path):  # noqa: F811 (fixture)
    """Both losses (masked LM, sentence order) of a PP=2 BERT equal the PP=1 run's."""
    shape = {
        "parallel.tensor_parallel_size": 1,
        "training.train_iters": 20,
        "training.eval_interval": 10,
        "logging.tensorboard_dir": None,
    }
    ref = (*BERT, bert_overrides(bert_data, tmp_path / "ref", **shape))
    _spawn(1, [ref])
    pp2 = {**shape, "parallel.pipeline_parallel_size": 2}
    _spawn(2, [(*BERT, bert_overrides(bert_data, tmp_path / "pp2", **pp2))])
    losses = ("lm_loss", "sop_loss")
    _assert_same_run(tmp_path / "pp2" / "metrics.jsonl", tmp_path / "ref" / "metrics.jsonl", losses)


def _endless(gpt_data, tmp_path, **extra) -> list[str]:
    keys = {
        "parallel.tensor_parallel_size": 1,
        "parallel.pipeline_parallel_size": 2,
        "training.train_iters": 1000,
        **extra,
    }
    return tiny_overrides(gpt_data, tmp_path, **{"training.eval_iters": 0, **keys})


@pytest.mark.slow
def test_sigterm_to_the_last_stage_stops_every_stage_saves_and_exits_0(gpt_data, tmp_path):
    """torchrun, PP=2; SIGTERM to the last stage's worker alone: its flag rides in the step's
    world all-reduce, so the first stage stops at the same iteration, both stages save it (one
    file each, checksums intact) and the job exits 0."""
    log, ckpt = tmp_path / "torchrun.out", tmp_path / "ckpt"
    args = _endless(gpt_data, tmp_path, **{"checkpoint.save": ckpt})
    proc = start_torchrun("pretrain_gpt.py", GPT[1], args, log)
    try:
        wait_for_iterations(tmp_path / "metrics.jsonl", 2, proc)
        os.kill(worker_pids(proc.pid)[1], signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]["iteration"]
    assert 2 <= last < 1000 and "(signal SIGTERM)" in out, out[-3000:]
    assert find_latest(str(ckpt)) == last
    saved = ckpt / checkpoint_name(last)
    assert verify_checkpoint(str(saved)) is None
    assert {shard_file(0, p, 2) for p in range(2)} <= set(os.listdir(saved))


@pytest.mark.slow
def test_a_killed_stage_is_named_by_the_other(gpt_data, tmp_path):
    """PP=2 without torchrun; the last stage is SIGKILLed mid-run. The first stage, waiting in
    a p2p transfer or the step's all-reduce, fails (gloo sees the socket close), names rank 1
    through the heartbeat and exits 1."""
    args = _endless(gpt_data, tmp_path, **{"parallel.timeout_minutes": 0.5})
    procs, outputs = launch_ranks(2, args, tmp_path)
    survivor, victim = procs
    try:
        wait_for_iterations(tmp_path / "metrics.jsonl", 2, survivor)
        time.sleep(2)  # every rank has beaten since it entered the loop
        victim.send_signal(signal.SIGKILL)
        survivor.wait(timeout=90)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = outputs[0].read_text()
    assert survivor.returncode == 1, out[-3000:]
    assert re.search(r"rank 1 \(host \S+\) stopped responding at iteration \d+", out), out[-3000:]
