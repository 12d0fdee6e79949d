"""Pytest setup: one intra-op thread per process, and the repo root importable."""

import os
import sys

# Before torch is imported: its OpenMP pool reads this once, and every process a test starts
# inherits it (processes x threads <= the 2 cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite starts hundreds of interpreters: where the environment forbids bytecode caches
# (PYTHONDONTWRITEBYTECODE, as on CI), each would compile torch and this repo from source again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory):
    """A real tokenizer and preprocessed corpus, built once per test session."""
    from tests.gpt_run import prepare_gpt_data

    return prepare_gpt_data(tmp_path_factory.mktemp("gpt_data"))


@pytest.fixture(scope="session")
def trained_gpt(tmp_path_factory, gpt_data):
    """A tiny GPT (2 layers, hidden 64, 512-piece sentencepiece vocab, seq 32) trained for 20
    iterations at TP=2 by the real entrypoint; ``ckpt`` is its save directory."""
    from tests.gpt_run import run_pretrain, tiny_overrides

    run = tmp_path_factory.mktemp("trained_gpt")
    ckpt = run / "ckpt"
    overrides = tiny_overrides(gpt_data, run, **{"checkpoint.save": ckpt})
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", overrides, nproc=2)
    return {**gpt_data, "ckpt": str(ckpt), "run": str(run)}


@pytest.fixture(scope="session")
def wide_gpt(tmp_path_factory, gpt_data):
    """A TP=1 checkpoint written by the real entrypoint after one step from init std 0.3: its
    greedy predictions vary token to token (``trained_gpt`` predicts one piece almost everywhere);
    64 positions. ``ckpt`` is its save directory."""
    from tests.gpt_run import WIDE_ONE_STEP, run_pretrain, tiny_overrides

    run = tmp_path_factory.mktemp("wide_gpt")
    extra = {"checkpoint.save": run / "ckpt", **WIDE_ONE_STEP}
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", tiny_overrides(gpt_data, run, **extra))
    return {**gpt_data, "ckpt": str(run / "ckpt")}


@pytest.fixture
def fake(tmp_path):
    """The fake SLURM of tests/fake_slurm.py: (environment of a 2-node job with 4 GPUs per node,
    the stubs' log directory)."""
    from tests.fake_slurm import STUBS

    stubs, log = tmp_path / "bin", tmp_path / "log"
    stubs.mkdir()
    log.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "TORCH_NCCL_"))}  # fmt: skip
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "REQUEUE", "LAUNCHER", "ENTRYPOINT"):
        env.pop(key, None)
    env.update(
        PATH=f"{stubs}:{env['PATH']}",
        STUB_LOG=str(log),
        STUB_HOSTS="node07 node08",
        PYTHON=sys.executable,
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="pretrain-gpt",
        SLURM_JOB_NODELIST="node[07-08]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="4",
        SLURM_CPUS_ON_NODE="32",
        SLURM_SUBMIT_DIR=str(ROOT),
        OMP_NUM_THREADS="1",
        # The default lies under the repository's logs/; a user's value is kept.
        TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(tmp_path / "nccl" / "trace_"),
    )
    return env, log
