"""The one model builder: the model of each kind (``model.type``) as training, inference,
conversion and the benchmarks build it. A new kind is one function in ``BUILDERS``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from megatron.config.schema import Config
from megatron.models.bert import BertModel
from megatron.models.gpt import GPTModel
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import ParallelState


def _chunks(cfg: Config, state: ParallelState) -> int:
    """This pipeline stage's model chunks (interleaved 1F1B); one without a pipeline, so that a
    checkpoint of an interleaved run loads whole for inference or conversion."""
    return (cfg.parallel.virtual_pipeline_size or 1) if state.pp_size > 1 else 1


def _gpt(
    cfg: Config, vocab_size: int, padded: int, state: ParallelState, tracker: RNGTracker
) -> nn.Module:
    sp, chunks = cfg.parallel.sequence_parallel, _chunks(cfg, state)
    return GPTModel(cfg.model, vocab_size, padded, state, tracker, sp, chunks)


def _bert(
    cfg: Config, vocab_size: int, padded: int, state: ParallelState, tracker: RNGTracker
) -> nn.Module:
    b, sp, chunks = cfg.bert, cfg.parallel.sequence_parallel, _chunks(cfg, state)
    return BertModel(
        cfg.model, vocab_size, padded, state, tracker, b.num_tokentypes, b.binary_head, sp, chunks
    )


BUILDERS: dict[str, Callable[[Config, int, int, ParallelState, RNGTracker], nn.Module]] = {
    "gpt": _gpt,
    "bert": _bert,
}


def build_model(
    kind: str,
    cfg: Config,
    vocab_size: int,
    padded_vocab_size: int,
    state: ParallelState,
    tracker: RNGTracker,
) -> nn.Module:
    """This rank's part of the ``kind`` model of ``cfg``: its TP slice of its pipeline stage, with
    ``cfg.parallel``'s sequence parallelism and virtual pipeline chunks."""
    return BUILDERS[kind](cfg, vocab_size, padded_vocab_size, state, tracker)
