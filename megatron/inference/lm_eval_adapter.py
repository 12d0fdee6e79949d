"""Our GPT as lm-eval-harness's ``LM``: loglikelihood, loglikelihood_rolling and generate_until
over the loaded tensor-parallel model, without conversion.

lm-eval's ``TemplateLM`` splits each (context, continuation) pair into token ids the way its
``hf`` model does (the whole text's ids past the context's); this class scores them. Requests
are sorted longest first and run ``batch_size`` per forward pass, padded on the right (causal
attention: padding never reaches a real position); only the continuation positions go through
the LM head and only their logits are gathered over TP. A sequence longer than the position
table keeps its last ``max_positions + 1`` tokens, as the ``hf`` model does.

DP: lm-eval's evaluator hands each DP rank its share of the documents (``rank`` and
``world_size`` are the DP rank and size) and gathers the metrics over the DP group; the TP ranks
of a DP rank run the same requests together. Generation is greedy, through the KV-cached
``generate``; a request asking to sample is refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import Tensor, nn

from megatron.data.tokenizers.base import Tokenizer
from megatron.errors import ConfigError
from megatron.inference.generation import generate
from megatron.inference.sampling import full_vocab_logits
from megatron.parallel.state import ParallelState

# lm-eval's own default when a task names no max_gen_toks (its ``hf`` model's too).
DEFAULT_MAX_GEN_TOKS = 256


def longest_first(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices into ``lengths`` in batches of up to ``batch_size``, longest first (ties in
    order), so that rows of a batch pad little and the first batch shows the peak memory."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


@torch.no_grad()
def score_continuations(
    model: nn.Module, rows: list[tuple[list[int], int]]
) -> list[tuple[float, bool]]:
    """(log-probability, is greedy) of the last ``n`` ids of each row of (ids, n), read by the
    model from the ids before them in one forward pass; ``n < len(ids)``."""
    device, vocab = model.embedding.word.weight.device, model.vocab_size
    width = max(len(ids) for ids, _ in rows) - 1
    picked = max(n for _, n in rows)
    inputs = torch.zeros(len(rows), width, dtype=torch.int64)  # [b, s]
    # [b, p]: the positions predicting each continuation id and the ids; a shorter continuation
    # repeats position 0 and id 0, masked out
    positions = torch.zeros(len(rows), picked, dtype=torch.int64)
    targets = torch.zeros(len(rows), picked, dtype=torch.int64)
    scored = torch.zeros(len(rows), picked, dtype=torch.bool)
    for row, (ids, n) in enumerate(rows):
        inputs[row, : len(ids) - 1] = torch.tensor(ids[:-1])
        positions[row, :n] = torch.arange(len(ids) - 1 - n, len(ids) - 1)
        targets[row, :n] = torch.tensor(ids[len(ids) - n :])
        scored[row, :n] = True
    logits = model(inputs.to(device), positions=positions.to(device))  # [b, p, v / tp]
    full = full_vocab_logits(logits.flatten(0, 1), vocab, model.tp_group)  # [b * p, vocab]
    logprobs = full.double().log_softmax(-1).view(len(rows), picked, vocab)
    targets, scored = targets.to(device), scored.to(device)
    totals = torch.where(scored, logprobs.gather(-1, targets[..., None]).squeeze(-1), 0.0)
    greedy = (logprobs.argmax(-1).eq(targets) | ~scored).all(-1)  # [b]
    return list(zip(totals.sum(-1).tolist(), greedy.tolist()))


class MegatronLM(TemplateLM):
    """A loaded GPT (eval mode, any TP) behind lm-eval's ``LM`` interface."""

    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, state: ParallelState, batch_size: int
    ) -> None:
        super().__init__()
        self.model, self.tok, self.state, self.batch_size = model, tokenizer, state, batch_size
        self.max_length = model.max_positions
        self._rank, self._world_size, self._device = state.dp_rank, state.dp_size, state.device

    def score(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """(log-probability, is greedy) of the last ``n`` ids of each row of (ids, n)."""
        return score_continuations(self.model, rows)

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def tokenizer_name(self) -> str:
        return type(self.tok).__name__

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: Any) -> list:
        """Our ids of ``string``: never a special token added (lm-eval's causal default)."""
        return self.tok.encode(string)

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """(log P(continuation | context), greedy?) of each (key, context ids, continuation
        ids), in request order."""
        rows = []
        for _, context, continuation in requests:
            if not 0 < len(continuation) <= self.max_length:
                raise ConfigError(
                    f"a continuation of {len(continuation)} tokens: lm-eval needs 1 to "
                    f"{self.max_length} (the model's max_position_embeddings)"
                )
            rows.append(((context + continuation)[-(self.max_length + 1) :], len(continuation)))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for batch in longest_first([len(ids) for ids, _ in rows], self.batch_size):
            scores = self.score([rows[i] for i in batch])
            for i, score in zip(batch, scores):
                results[i] = score
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, in disjoint windows of the position table's length
        (lm-eval's own windowing: the first predicted from end of document)."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations cut at the first stop sequence (end of document included), the
        context cut on the left to leave room for ``max_gen_toks``."""
        eos = self.tok.decode([self.eot_token_id])
        groups: dict[str, list[int]] = {}  # requests sharing generation settings batch together
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        results = [""] * len(requests)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], DEFAULT_MAX_GEN_TOKS)
            if kwargs.get("do_sample"):
                raise ConfigError(
                    "a generate_until task asks to sample (do_sample: true); our lm-eval model "
                    "decodes greedily: set do_sample: false in the task's generation_kwargs"
                )
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            room = self.max_length - max_new
            if room < 1:
                raise ConfigError(
                    f"max_gen_toks {max_new} leaves no room for a context in the model's "
                    f"{self.max_length} positions; ask for fewer tokens"
                )
            prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in indices]
            for batch in longest_first([len(p) for p in prompts], self.batch_size):
                made = generate(self.model, [prompts[j] for j in batch], max_new, self.tok.eod)
                for j, generation in zip(batch, made):
                    text = self.tok.decode(generation.tokens)
                    results[indices[j]] = postprocess_generated_text(text, until, None)
        return results

    # The evaluator's collectives, over the DP group (TP ranks hold the same values).

    def all_gather(self, tensor: Tensor) -> Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor, group=self.state.dp_group)
        return torch.cat([p.reshape(-1) for p in parts])

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        parts: list[Any] = [None] * self._world_size
        dist.all_gather_object(parts, obj, group=self.state.dp_group)
        return parts

    def barrier(self) -> None:
        dist.barrier(group=self.state.dp_group)
