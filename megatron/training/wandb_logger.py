"""Rank 0's scalars in a Weights & Biases run (``logging.wandb_project``), which a run resumed
from ``checkpoint.save`` continues. ``wandb`` is an optional package: preflight
(megatron/launch/preflight.py) refuses a config that asks for it where it is not installed."""

from __future__ import annotations

import os
import secrets
from typing import Any

from megatron.atomic_file import write_contents
from megatron.config.schema import Config, to_dict

# In checkpoint.save: the W&B run id of every run that trains into that directory.
RUN_ID_FILE = "wandb_run_id"


def _run_id(save_dir: str) -> str:
    """The id recorded in ``save_dir``, or a new one recorded there first."""
    path = os.path.join(save_dir, RUN_ID_FILE)
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    run_id = secrets.token_hex(8)  # 64 random bits: unique within any project
    write_contents(path, f"{run_id}\n")
    return run_id


class WandbRun:
    """A W&B run with TensorBoard's scalars: each under its name at the iteration, and each
    ``<name> vs samples`` twin charted against ``consumed-samples`` (a W&B history row has one
    step, so the twins ride in the iteration's row with the sample count as their x-axis)."""

    def __init__(self, cfg: Config):
        import wandb  # optional, and only rank 0 pays for its import

        log, save = cfg.logging, cfg.checkpoint.save
        self.run = wandb.init(
            project=log.wandb_project,
            name=log.wandb_run_name,
            mode=log.wandb_mode,
            dir=save or log.tensorboard_dir,  # None: W&B's default, ./wandb or $WANDB_DIR
            id=_run_id(save) if save else None,
            resume="allow" if save else None,
            config=to_dict(cfg),  # the run's own sections, as checkpoints and TensorBoard hold it
        )
        self.run.define_metric("consumed-samples", hidden=True)
        self._twins: set[str] = set()

    def log(self, values: dict[str, float], iteration: int, samples: int | None = None) -> None:
        row: dict[str, Any] = dict(values)
        if samples is not None:
            for name, value in values.items():
                twin = f"{name} vs samples"
                if twin not in self._twins:
                    self.run.define_metric(twin, step_metric="consumed-samples")
                    self._twins.add(twin)
                row[twin] = value
            row["consumed-samples"] = samples
        self.run.log(row, step=iteration)

    def close(self) -> None:
        self.run.finish()
