"""The training loop's downstream scorer (``training.eval_tasks``), built where the entrypoint
asks for it: lm-eval is imported only when tasks are configured, after a one-line check that
it is installed."""

from __future__ import annotations

from typing import Any

from megatron.inference.lm_eval_tasks import require_lm_eval


def downstream_tasks(cfg: Any, tokenizer: Any) -> Any:
    """``training.eval_tasks``'s scorer for the training loop (``pretrain(downstream=...)``),
    its tasks checked now; None without tasks."""
    if not cfg.training.eval_tasks:
        return None
    require_lm_eval("training.eval_tasks")  # before the adapter imports lm-eval, in one line
    from megatron.inference.lm_eval_training import DownstreamTasks

    return DownstreamTasks(cfg, tokenizer)
