"""End-to-end test helpers: corpus -> tokenizer -> .bin/.idx, and real entrypoint runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.forked_entrypoint import run_entrypoint

ROOT = Path(__file__).resolve().parent.parent


def _tool(*args: str) -> None:
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True, text=True)


def prepare_gpt_data(out: Path, vocab_size: int = 512, size_mb: float = 0.5) -> dict[str, str]:
    """Sample corpus (stdlib docstrings), a sentencepiece model, preprocessed tokens."""
    corpus, spm, prefix = out / "corpus.jsonl", out / "spm", out / "corpus"
    _tool("tools/make_sample_corpus.py", "--output", str(corpus), "--size-mb", str(size_mb))
    _tool(
        "tools/train_tokenizer.py",
        "--input",
        str(corpus),
        "--model-prefix",
        str(spm),
        "--vocab-size",
        str(vocab_size),
        "--threads",
        "1",
    )
    _tool(
        "tools/preprocess_data.py",
        "--input",
        str(corpus),
        "--output-prefix",
        str(prefix),
        "--tokenizer-type",
        "sentencepiece",
        "--tokenizer-model",
        f"{spm}.model",
        "--append-eod",
    )
    return {"tokenizer": f"{spm}.model", "data": f"{prefix}_text_document"}


# A TP=1 model one step from init std 0.3, 64 positions: its greedy predictions vary token to
# token, where a barely trained one predicts the same piece almost everywhere.
WIDE_ONE_STEP = {
    "parallel.tensor_parallel_size": 1,
    "model.max_position_embeddings": 64,
    "model.init_method_std": 0.3,
    "training.train_iters": 1,
    "optimizer.lr_warmup_iters": 0,
}


def tiny_overrides(data: dict[str, str], run_dir: Path, **extra: object) -> list[str]:
    """A ~100k-parameter GPT over ``data``; fp32, no dropout, one log line per iteration."""
    keys = {
        "model.num_layers": 2,
        "model.hidden_size": 64,
        "model.num_attention_heads": 4,
        "model.seq_length": 32,
        "model.max_position_embeddings": 32,
        "model.hidden_dropout": 0.0,
        "model.attention_dropout": 0.0,
        "tokenizer.model": data["tokenizer"],
        "data.paths": f"[{data['data']}]",
        "data.cache_dir": str(run_dir / "cache"),
        "data.num_workers": 0,
        "training.micro_batch_size": 2,
        "training.global_batch_size": 8,
        "training.train_iters": 20,
        "training.eval_interval": 10,
        "training.eval_iters": 2,
        "optimizer.lr": 1e-3,
        "optimizer.lr_warmup_iters": 2,
        "logging.log_interval": 1,
        "logging.metrics_file": str(run_dir / "metrics.jsonl"),
        "logging.tensorboard_dir": str(run_dir / "tb"),
        "checkpoint.save": None,
    }
    keys.update(extra)
    return [f"{k}={'null' if v is None else v}" for k, v in keys.items()]


def run_pretrain(
    script: str,
    config: str,
    overrides: list[str],
    nproc: int = 1,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` (or plain python for one process) on the real entrypoint, forked
    from the suite's fork server (tests/forked_entrypoint.py)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    argv = ["--config", config, *overrides]
    proc = run_entrypoint(script, argv, nproc, full_env, ROOT, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def start_torchrun(
    script: str, config: str, args: list[str], out: Path, logs: Path | None = None
) -> subprocess.Popen:
    """``torchrun --standalone`` of 2 workers on ``script``, in the background, stdout and stderr
    into ``out``; with ``logs``, no restarts and each worker's output in its own file there."""
    flags = ["--max-restarts", "0", "--log-dir", str(logs), "--redirects", "3"] if logs else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.Popen(
        [*cmd, *flags, script, "--config", config, *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
    )


def read_metrics(path: Path) -> list[dict]:
    """Training lines of a metrics file (evaluation lines carry no lm_loss)."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [e for e in lines if "lm_loss" in e]
