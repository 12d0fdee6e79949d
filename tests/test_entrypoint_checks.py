"""What the entrypoints refuse or warn about before training, run as a user runs them.

A config of the other model (``model.type``) is refused and a run records only its own model's
sections; fp16 on a CPU is one warning; the dry run counts hdf5 rows against every split, as the
real run does at start.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.config.load import config_from_dict, load_config
from megatron.data.hdf5_dataset import write_shard
from megatron.estimate.checkpoint_size import checkpoint_bytes
from megatron.launch.dry_run import dry_run
from tests.gpt_run import ROOT, run_pretrain, tiny_overrides

BERT_VOCAB = "tests/fixtures/tokenizers/bert-vocab.txt"


def _entrypoint(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "script, config, kind, other",
    [
        ("pretrain_gpt.py", "configs/bert_tiny.yaml", "bert", "gpt"),
        ("pretrain_bert.py", "configs/gpt_tiny.yaml", "gpt", "bert"),
    ],
)
def test_the_other_models_config_is_refused(script, config, kind, other):
    out = _entrypoint(script, "--config", config, "--dry-run")
    assert out.returncode == 2, out.stdout
    assert out.stderr == (
        f"error: model.type={kind}: {config} is a {kind} config and this entrypoint trains "
        f"{other}; run pretrain_{kind}.py with it, or give a {other} config\n"
    )


def _run(data: dict, run_dir: Path, **extra: object) -> subprocess.CompletedProcess:
    """One step of the tiny GPT in one process."""
    keys = {
        "parallel.tensor_parallel_size": 1,
        "training.train_iters": 1,
        "training.eval_iters": 0,
        "optimizer.lr_warmup_iters": 0,
        **extra,
    }
    return run_pretrain(
        "pretrain_gpt.py", "configs/gpt_tiny.yaml", tiny_overrides(data, run_dir, **keys)
    )


@pytest.fixture(scope="module")
def one_step(gpt_data, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One fp16 step of the tiny GPT saved to a checkpoint: (the run, its directory)."""
    run_dir = tmp_path_factory.mktemp("one_step")
    keys = {"checkpoint.save": run_dir / "ckpt", "precision.dtype": "fp16"}
    return _run(gpt_data, run_dir, **keys), run_dir


@pytest.mark.slow
def test_a_gpt_run_prints_and_saves_only_gpt_sections(one_step):
    out, run_dir = one_step
    written = run_dir / "ckpt" / "resolved_config.yaml"
    assert f"resolved config: {written}\n" in out.stdout
    printed = written.read_text()
    assert "\n  type: gpt\n" in printed
    assert "\nbert:" not in printed and "masked_lm_prob" not in printed
    events = b"".join(p.read_bytes() for p in (run_dir / "tb").glob("events.*"))
    assert b"type: gpt" in events and b"masked_lm_prob" not in events
    meta = json.loads((run_dir / "ckpt" / "iter_0000001" / "meta.json").read_text())
    assert "bert" not in meta["config"] and meta["config"]["model"]["type"] == "gpt"
    # What megatron/inference/loading.py builds the model from still loads.
    cfg = config_from_dict(meta["config"], "meta.json")
    assert cfg.model.type == "gpt" and cfg.model.num_layers == 2


@pytest.mark.slow
def test_runs_that_train_nothing_leave_the_recorded_config(gpt_data, tmp_path):
    """A run with nothing left to do, or refused by the checkpoint it would resume, does not
    rewrite the save directory's resolved_config.yaml (its checkpoints' config)."""
    save = {"checkpoint.save": tmp_path / "ckpt"}
    _run(gpt_data, tmp_path, **save)
    written = tmp_path / "ckpt" / "resolved_config.yaml"
    before = written.read_text()
    done = _run(gpt_data, tmp_path, **save, **{"logging.log_interval": 7})  # nothing to do
    assert "nothing to do" in done.stdout + done.stderr
    keys = {**save, "training.train_iters": 2, "model.hidden_size": 96}  # another model
    keys |= {"training.eval_iters": 0, "optimizer.lr_warmup_iters": 0}
    keys |= {"parallel.tensor_parallel_size": 1}
    overrides = tiny_overrides(gpt_data, tmp_path, **keys)
    refused = run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", overrides, check=False)
    assert refused.returncode != 0 and "checkpoint's model.* settings" in refused.stderr
    assert written.read_text() == before


@pytest.mark.slow
def test_fp16_on_cpu_is_one_warning(one_step):
    out, _ = one_step
    output = out.stdout + out.stderr
    assert output.count("precision.dtype=fp16 on CPU can be up to ~50x slower than bf16") == 1
    assert "use precision.dtype=bf16" in output


@pytest.mark.slow
def test_the_checkpoint_estimate_matches_a_real_checkpoint(one_step):
    """fp16: weights, fp32 main params and Adam moments, 14 B/param; what the estimate leaves
    out (headers, meta.json, RNG states: ~60 KiB here) keeps it within 10% even for 0.13M
    parameters, and below the real size."""
    _, run_dir = one_step
    saved = run_dir / "ckpt" / "iter_0000001"
    meta = json.loads((saved / "meta.json").read_text())
    cfg = config_from_dict(meta["config"], "meta.json")
    estimate = checkpoint_bytes(cfg, meta["padded_vocab_size"], "gpt")
    real = sum(f.stat().st_size for f in saved.iterdir())
    assert 0.9 * real < estimate < real


def _shards(folder: Path, rows: int, s: int = 16) -> None:
    sample = {
        "text": np.arange(s), "types": np.zeros(s, np.int64), "padding_mask": np.ones(s),
        "loss_mask": np.eye(s)[2], "labels": np.full(s, 7), "is_random": 0,
    }  # fmt: skip
    write_shard(str(folder / "a.hdf5"), [sample] * rows, max_predictions=4)


def test_the_dry_run_counts_hdf5_rows_against_every_split(tmp_path):
    """10 rows split 8,2,0: two steps of 2 train samples fit; 2 evaluations of 2 batches of 2
    (at iteration 2 and one to spare) need 8 validation samples, and 2 are there."""
    _shards(tmp_path, 10)
    args = [
        "--config", "configs/bert_tiny.yaml", "--dry-run", "data.format=hdf5",
        f"data.paths=[{tmp_path}]", "data.split=8,2,0", "model.seq_length=16",
        "model.max_position_embeddings=16", f"tokenizer.vocab_file={BERT_VOCAB}",
        "training.train_iters=2", "training.micro_batch_size=1", "training.global_batch_size=2",
        "training.eval_interval=2", "optimizer.lr_warmup_iters=0",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    fits = load_config(["configs/bert_tiny.yaml"], [*args[3:], "training.eval_iters=0"])
    out = io.StringIO()
    assert dry_run(fits, argparse.Namespace(world_size=None, gpu_memory_gb=None), "bert", out) == 0
    held = "train 8 >= 4, valid unused, test unused"
    assert f"data: hdf5 splits (samples held >= needed): {held}\n" in out.getvalue()
    short = _entrypoint("pretrain_bert.py", *args, "training.eval_iters=2")
    assert short.returncode == 2 and "config valid" not in short.stdout
    assert "the hdf5 shards give the valid split 2 samples but the run needs 8" in short.stderr


@pytest.mark.slow
def test_a_resume_warns_once_under_tp2(gpt_data, tmp_path):
    """Resuming with a longer run moves the LR decay: the changed settings are one warning on
    the console, not one per rank ("[rank 1] ...")."""
    keys = {"checkpoint.save": tmp_path / "ckpt", "training.eval_iters": 0}
    keys["optimizer.lr_warmup_iters"] = 0
    first = tiny_overrides(gpt_data, tmp_path, **keys, **{"training.train_iters": 2})
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", first, 2)
    longer = tiny_overrides(gpt_data, tmp_path, **keys, **{"training.train_iters": 3})
    out = run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", longer, 2)
    said = (out.stdout + out.stderr).count("learning-rate settings differ from the checkpoint's")
    assert said == 1, out.stdout + out.stderr
