"""Weights & Biases logging (``logging.wandb_*``), offline so no network is needed: the run holds
the metrics file's losses, a resumed run continues the same W&B run, and a config asking for W&B
where the package is missing is refused in one line before training starts.

W&B 0.31 has no public reader of a run on disk, so ``history`` reads the ``.wandb`` transaction
log itself: LevelDB's log format (32 KiB blocks of checksummed chunks) after a 7-byte
``:W&B`` header, each record a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from megatron.training.wandb_logger import RUN_ID_FILE
from tests.gpt_run import read_metrics, run_pretrain, tiny_overrides

CONFIG = "configs/gpt_tiny.yaml"
BLOCK, CHUNK_HEADER = 32768, 7
FULL, LAST = 1, 4
TP1 = {"parallel.tensor_parallel_size": 1}


def wandb_env(tmp_path: Path) -> dict[str, str]:
    """Quiet, and W&B's own settings and caches in ``tmp_path`` rather than the home directory."""
    return {
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_X_DISABLE_STATS": "true",  # no system-metrics sampler process
    }


def history(path: Path) -> dict[int, dict]:
    """Each step's logged values in the ``.wandb`` file at ``path``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows: dict[int, dict] = {}
    pos, chunks = CHUNK_HEADER, b""
    while pos + CHUNK_HEADER <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER:  # a block's tail too short for a chunk: padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        chunks += data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind not in (FULL, LAST):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunks)
        chunks = b""
        if record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows[row["_step"]] = row
    return rows


@pytest.mark.slow
def test_offline_run_holds_the_losses_and_a_resumed_run_continues_it(gpt_data, tmp_path):
    pytest.importorskip("wandb")
    save = tmp_path / "ckpt"
    wandb = {"logging.wandb_project": "megatron-test", "logging.wandb_mode": "offline"}
    keys = {"training.train_iters": 5, "checkpoint.save": save, **TP1, **wandb}
    first = tiny_overrides(gpt_data, tmp_path, **keys, **{"training.exit_interval": 3})
    run_pretrain("pretrain_gpt.py", CONFIG, first, env=wandb_env(tmp_path))
    run_pretrain(
        "pretrain_gpt.py",
        CONFIG,
        tiny_overrides(gpt_data, tmp_path, **keys),
        env=wandb_env(tmp_path),
    )

    run_id = (save / RUN_ID_FILE).read_text().strip()
    runs = sorted((save / "wandb").glob("offline-run-*"))
    assert [r.name.rsplit("-", 1)[1] for r in runs] == [run_id, run_id]
    logged: dict[int, dict] = {}
    for run in runs:
        (log,) = run.glob(f"run-{run_id}.wandb")
        logged.update(history(log))
    losses = {e["iteration"]: e["lm_loss"] for e in read_metrics(tmp_path / "metrics.jsonl")}
    assert list(losses) == [1, 2, 3, 4, 5]
    assert {step: row["lm loss"] for step, row in logged.items()} == losses
    assert logged[5]["consumed-samples"] == 5 * 8
    assert logged[5]["lm loss vs samples"] == losses[5]


def test_missing_package_is_one_line_before_training(gpt_data, tmp_path):
    """The real entrypoint, with ``import wandb`` failing as where it is not installed."""
    blocked = tmp_path / "without_wandb.py"
    blocked.write_text(
        "import runpy, sys\n"
        "sys.modules['wandb'] = None\n"
        "runpy.run_path('pretrain_gpt.py', run_name='__main__')\n"
    )
    overrides = tiny_overrides(gpt_data, tmp_path, **TP1, **{"logging.wandb_project": "demo"})
    proc = run_pretrain(str(blocked), CONFIG, overrides, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: logging.wandb_project=demo: needs the wandb package; pip install wandb"
    ]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_online_without_an_api_key_is_one_line_before_training(gpt_data, tmp_path, monkeypatch):
    """wandb installed, online mode, no WANDB_API_KEY and no netrc entry: one line naming the
    three ways out, exit 2, before any process group (no metrics file, no W&B directory)."""
    overrides = tiny_overrides(gpt_data, tmp_path, **TP1, **{"logging.wandb_project": "demo"})
    env = {**wandb_env(tmp_path), "WANDB_API_KEY": "", "NETRC": str(tmp_path / "no-netrc")}
    proc = run_pretrain("pretrain_gpt.py", CONFIG, overrides, env=env, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: logging.wandb_project=demo logs online, and W&B has no API key here; run "
        "`wandb login`, set WANDB_API_KEY, or set logging.wandb_mode=offline"
    ]
    assert not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    from megatron.launch.preflight import _wandb_logged_in

    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert _wandb_logged_in()  # what `wandb login` writes counts as logged in
