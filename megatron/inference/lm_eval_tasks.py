"""Choosing and running lm-eval-harness tasks: the checks a user's task list passes before any
model is built (lm-eval installed, an include path that is a directory, every name known), the
run itself through lm-eval's evaluator, and its results as one flat record per task.

lm-eval is optional (``pip install lm-eval``; requirements-dev.txt pins it): nothing here
imports it until a task is asked for.
"""

from __future__ import annotations

import os
from typing import Any

from megatron.errors import ConfigError

PIP_PACKAGE = "lm-eval"


def require_lm_eval(asked_by: str) -> None:
    """One line naming the pip package when lm-eval is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{asked_by} needs lm-eval-harness, which is not installed: pip install "
            f"{PIP_PACKAGE} (requirements-dev.txt pins the tested version)"
        ) from None


def split_names(text: str, asked_by: str) -> list[str]:
    """``T1,T2`` as a list of names; an empty list is a ConfigError."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError(f"{asked_by}: no task named; give lm-eval task names, e.g. hellaswag")
    return names


def task_manager(
    names: list[str], include_path: str | None, asked_by: str, path_key: str = "--include-path"
) -> Any:
    """lm-eval's TaskManager knowing every one of ``names``, with the user's task YAMLs under
    ``include_path`` (given as ``path_key``). When the include path holds every name, lm-eval's
    own few thousand task files are not indexed (which takes seconds); otherwise they are, and
    the user's override them."""
    require_lm_eval(asked_by)
    if include_path is not None and not os.path.isdir(include_path):
        raise ConfigError(
            f"{path_key} {include_path}: not a directory; give the directory that holds "
            "your task YAML files"
        )
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(own.match_tasks([name]) for name in names):
            return own
    manager = TaskManager(include_path=include_path)
    unknown = [name for name in names if not manager.match_tasks([name])]
    if unknown:
        where = f" or under {include_path}" if include_path else ""
        raise ConfigError(
            f"{asked_by}: unknown lm-eval task {unknown[0]!r} (not among lm-eval's tasks{where});"
            f" `lm-eval ls tasks` lists them, {path_key} DIR adds your own YAMLs"
        )
    return manager


def run_tasks(
    lm: Any,
    names: list[str],
    manager: Any,
    num_fewshot: int | None = None,
    limit: int | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100_000,
) -> dict[str, Any] | None:
    """lm-eval's results dict for ``names`` on ``lm`` (on DP rank 0; None on the others).

    Collective over every rank of ``lm``'s model. Python's and numpy's generators are seeded as
    lm-eval's CLI seeds them (few-shot sampling); torch's global generator is left alone.
    """
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=lm,
        tasks=names,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        bootstrap_iters=bootstrap_iters,
        torch_random_seed=None,
    )


def task_scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each task's metrics, named as lm-eval names them less the default filter (``acc``,
    ``acc_stderr``, ``exact_match``; ``exact_match,strict-match`` for another filter)."""
    scores = {}
    for task, metrics in results["results"].items():
        scores[task] = {
            key.removesuffix(",none"): value
            for key, value in metrics.items()
            if key not in ("alias", "sample_len") and isinstance(value, (int, float))
        }
    return scores


def task_lines(results: dict[str, Any], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per task: its name, metrics, the documents scored, and ``settings``."""
    counts = results.get("n-samples", {})
    return [
        {"task": task, **metrics, "n": counts.get(task, {}).get("effective")} | settings
        for task, metrics in task_scores(results).items()
    ]
