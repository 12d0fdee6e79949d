"""Where a run starts: a fine-tune's restart resumes its own checkpoint, a finished run says so,
a weights-only checkpoint starts fine-tunes only, and another model's checkpoint is refused whole.

Every run is the real pretrain_gpt.py in one process, fine-tuning the session's TP=2 checkpoint
(``trained_gpt``, 20 iterations) at TP=1, through a weights-only merge of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpt_run import read_metrics, run_pretrain, tiny_overrides
from tools.checkpoint_util import main as checkpoint_util

CONFIG = "configs/gpt_tiny.yaml"


def _run(data: dict, run_dir: Path, check: bool = True, **extra: object):
    keys = {"parallel.tensor_parallel_size": 1, "training.eval_iters": 0, **extra}
    return run_pretrain(
        "pretrain_gpt.py", CONFIG, tiny_overrides(data, run_dir, **keys), check=check
    )


@pytest.fixture(scope="module")
def finetune(trained_gpt, tmp_path_factory) -> dict:
    """A fine-tune of 3 iterations into its own save directory, then the same command again with
    training.train_iters=5 (what a requeued job does after raising the length)."""
    root = tmp_path_factory.mktemp("finetune")
    weights = root / "weights"
    argv = ["--input", trained_gpt["ckpt"], "--output", str(weights), "--merge", "--weights-only"]
    assert checkpoint_util(argv) == 0
    keys = {
        "checkpoint.load": weights,
        "checkpoint.finetune": "true",
        "checkpoint.save": root / "own",
    }
    first = _run(trained_gpt, root, **keys, **{"training.train_iters": 3})
    again = _run(trained_gpt, root, **keys, **{"training.train_iters": 5})
    return {"data": trained_gpt, "root": root, "keys": keys, "first": first, "again": again}


@pytest.mark.slow
def test_a_rerun_fine_tune_resumes_its_own_checkpoint(finetune):
    assert (
        f"fine-tuning the weights of {finetune['keys']['checkpoint.load']}"
        in finetune["first"].stdout
    )
    again = finetune["again"].stdout
    assert (
        f"checkpoint.save={finetune['keys']['checkpoint.save']} holds this fine-tune's own "
        "checkpoint: resuming it in full"
    ) in again
    assert "at iteration 3" in again
    # One metrics file for both runs: the second continues at 4, it does not start again at 1.
    iterations = [e["iteration"] for e in read_metrics(finetune["root"] / "metrics.jsonl")]
    assert iterations == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_a_finished_run_says_there_is_nothing_to_do(finetune):
    out = _run(
        finetune["data"], finetune["root"], **finetune["keys"], **{"training.train_iters": 5}
    )
    assert (
        "already at iteration 5 >= training.train_iters=5; nothing to do; raise train_iters to "
        "continue"
    ) in out.stdout
    assert len(read_metrics(finetune["root"] / "metrics.jsonl")) == 5  # no step was taken


@pytest.mark.slow
def test_a_weights_only_checkpoint_refuses_a_full_resume(finetune, tmp_path):
    weights = finetune["keys"]["checkpoint.load"]
    out = _run(finetune["data"], tmp_path, check=False, **{"checkpoint.load": weights})
    assert out.returncode == 2
    assert "holds weights only, no optimizer state" in out.stderr
    assert "checkpoint.finetune=true" in out.stderr


@pytest.mark.slow
def test_another_models_checkpoint_is_refused_with_the_whole_story(trained_gpt, tmp_path):
    keys = {"checkpoint.load": trained_gpt["ckpt"], "checkpoint.finetune": "true"}
    out = _run(trained_gpt, tmp_path, check=False, **keys, **{"model.num_layers": 1})
    assert out.returncode == 2
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "model/transformer.layers.1." in error
    assert error.endswith(
        "which this model lacks: it was saved from another model config; build the model with "
        "the checkpoint's model.* settings (its meta.json config), or load a checkpoint of this "
        "model"
    )
