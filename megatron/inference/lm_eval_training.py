"""lm-eval's loglikelihood tasks on the training model in place (``training.eval_tasks``), at
the run's own layout: TP, sequence parallelism, PP (interleaved too), CP and DP; no save, no load.

Requests go through the model as training batches do: ``micro_batch_size`` rows of
``seq_length`` tokens (padded on the right, so every pipeline activation has the training
shape), each CP rank holding its chunks of the sequence (``split_batch``). The stages run one
after another (chunk by chunk around the ring with virtual stages): an evaluation needs no
overlap. The last stage scores every position it holds from its vocab-parallel logits (the
log-probability through the vocab-parallel cross entropy, greedy when no column beats the
target's), sums the continuation positions over the CP ranks and hands the rows' scores to every
stage. The rest (tokenizing, batching, DP splitting, metrics) is ``MegatronLM``'s and lm-eval's.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron.config.dtypes import DTYPES
from megatron.config.schema import Config
from megatron.data.tokenizers.base import Tokenizer
from megatron.errors import ConfigError
from megatron.inference.lm_eval_adapter import MegatronLM
from megatron.inference.lm_eval_tasks import run_tasks, task_manager, task_scores
from megatron.parallel.context_batch import split_batch
from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.pipeline.p2p import start_exchange
from megatron.parallel.pipeline.stage import activation_spec
from megatron.parallel.state import ParallelState

ASKED_BY = "training.eval_tasks"


def _through_stages(
    model: nn.Module, batch: dict[str, Tensor], cfg: Config, state: ParallelState
) -> Tensor | None:
    """The last stage's logits [b, s_local, padded_vocab / tp] of ``batch`` (None elsewhere),
    each chunk's output passed to the next around the pipeline ring."""
    if state.pp_size == 1:
        return model(batch["tokens"], batch["position_ids"])
    pipe = state.pipeline
    sp = cfg.parallel.sequence_parallel
    spec = activation_spec(
        cfg.model, batch["tokens"].shape[0], state, sp, DTYPES[cfg.precision.dtype]
    )
    output = None
    for chunk in range(model.num_chunks):
        reads_batch = state.is_first_stage and chunk == 0
        hidden = None if reads_batch else start_exchange(pipe, spec, recv_prev=True).wait()[0]
        output = model(batch["tokens"], batch["position_ids"], hidden=hidden, chunk=chunk)
        if not (state.is_last_stage and chunk == model.num_chunks - 1):
            start_exchange(pipe, spec, send_next=output).wait()
            output = None
    return output


def _row_scores(
    logits: Tensor, batch: dict[str, Tensor], model: nn.Module, state: ParallelState
) -> Tensor:
    """[b, 2] float64: each row's summed log-probability over its continuation positions held
    here, and the number of those whose target some column beats."""
    vocab, part = model.vocab_size, logits.shape[-1]
    start = state.tp_rank * part
    local = logits.float()  # [b, s, part]
    columns = torch.arange(start, start + part, device=local.device)
    local = local.masked_fill(columns >= vocab, -torch.inf)  # padded columns are no token
    best = local.amax(-1)  # [b, s]
    labels = batch["labels"]
    owned = (labels >= start) & (labels < start + part)
    target = local.gather(-1, (labels - start).clamp(0, part - 1)[..., None]).squeeze(-1)
    target = torch.where(owned, target, 0.0)
    if state.tp_size > 1:
        dist.all_reduce(best, dist.ReduceOp.MAX, group=state.tp_group)
        dist.all_reduce(target, group=state.tp_group)
    logprob = -vocab_parallel_cross_entropy(local, labels, vocab, state.tp_group, inplace=True)
    mask = batch["loss_mask"].bool()
    scores = torch.stack(
        [
            torch.where(mask, logprob.double(), 0.0).sum(-1),
            (mask & (target < best)).sum(-1).double(),
        ],
        dim=-1,
    )
    return scores


@torch.no_grad()
def score_in_place(
    model: nn.Module, rows: list[tuple[list[int], int]], cfg: Config, state: ParallelState
) -> list[tuple[float, bool]]:
    """(log-probability, is greedy) of the last ``n`` ids of each row of (ids, n); every rank
    of the model calls it with the same rows (at most micro_batch_size, each at most
    seq_length + 1 ids)."""
    size, seq = cfg.training.micro_batch_size, cfg.model.seq_length
    tokens = torch.zeros(size, seq, dtype=torch.int64)  # [b, s]
    labels = torch.zeros_like(tokens)
    mask = torch.zeros(size, seq)
    for row, (ids, n) in enumerate(rows):
        tokens[row, : len(ids) - 1] = torch.tensor(ids[:-1])
        labels[row, : len(ids) - 1] = torch.tensor(ids[1:])
        mask[row, len(ids) - 1 - n : len(ids) - 1] = 1.0
    positions = torch.arange(seq).expand(size, seq)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": positions}
    batch = split_batch({k: v.to(state.device) for k, v in batch.items()}, state, "gpt")
    scores = torch.zeros(size, 2, dtype=torch.float64, device=state.device)
    logits = _through_stages(model, batch, cfg, state)
    if logits is not None:
        scores = _row_scores(logits, batch, model, state)
        if state.cp_size > 1:
            dist.all_reduce(scores, group=state.cp_group)  # each CP rank held some positions
    if state.pp_size > 1:
        dist.broadcast(scores, src=state.pp_ranks[-1], group=state.pp_group)
    return [(total, misses == 0) for total, misses in scores[: len(rows)].tolist()]


def output_types(names: list[str], manager: Any) -> dict[str, str]:
    """Each task's lm-eval output type (a group's: its tasks'), its dataset loaded once now."""
    from lm_eval.tasks import get_task_dict

    found: dict[str, str] = {}

    def walk(node: Any) -> None:
        for name, value in node.items():
            if isinstance(value, dict):
                walk(value)
            elif hasattr(value, "OUTPUT_TYPE"):
                found[str(getattr(value, "task_name", name))] = value.OUTPUT_TYPE

    walk(get_task_dict(names, manager))
    return found


class DownstreamTasks:
    """``training.eval_tasks`` checked before any model is built; called on the training model,
    its scores named ``eval/<task>/<metric>``."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer) -> None:
        t = cfg.training
        self.cfg, self.tokenizer, self.names = cfg, tokenizer, list(t.eval_tasks)
        path = t.eval_tasks_include_path
        self.manager = task_manager(self.names, path, ASKED_BY, "training.eval_tasks_include_path")
        generating = [name for name, kind in output_types(self.names, self.manager).items()
                      if kind == "generate_until"]  # fmt: skip
        if generating:
            raise ConfigError(
                f"{ASKED_BY}: {generating[0]} is a generate_until task; the loop runs "
                "loglikelihood tasks: evaluate it with tools/evaluate.py --task lm-eval"
            )

    def __call__(self, model: nn.Module, state: ParallelState) -> dict[str, float]:
        """The scores on the DP-rank-0 ranks (the logging rank among them), {} elsewhere.
        Python's and numpy's global generators, which lm-eval seeds, are left as they were."""
        lm = InPlaceLM(model, self.tokenizer, state, self.cfg)
        limit = self.cfg.training.eval_tasks_limit
        saved = random.getstate(), np.random.get_state()
        results = run_tasks(lm, self.names, self.manager, limit=limit, bootstrap_iters=0)
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        scores = task_scores(results) if results is not None else {}
        return {
            f"eval/{task}/{metric}": value
            for task, metrics in scores.items()
            for metric, value in metrics.items()
        }


class InPlaceLM(MegatronLM):
    """``MegatronLM`` over the training model: training-shaped batches, loglikelihood only."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, state: ParallelState, cfg: Config):
        super().__init__(model, tokenizer, state, cfg.training.micro_batch_size)
        self.cfg, self.max_length = cfg, cfg.model.seq_length

    def score(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        return score_in_place(self.model, rows, self.cfg, self.state)
