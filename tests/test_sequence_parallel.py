"""Sequence parallelism against the plain tensor-parallel model, on real gloo process groups.

- Training: SP on and off at TP=2 and TP=4, GPT and BERT (and GPT with full recomputation), 20
  fp32 steps through DataParallel, the SP gradient all-reduce and the optimizer: losses within
  1e-5 relative. Only float summation order differs: the LayerNorm and row-parallel-bias
  gradients are summed per sequence slice, then over TP, and gloo's reduce-scatter may add the
  TP partial sums in another order than its all-reduce.
- Dropout 0.1 at TP=2: each rank keeps its slice of the very mask the plain model draws, and
  two-rank sums are order-free, so the first forward (logits and loss) is bit for bit the plain
  one; later steps move by the gradients' summation order (1e-5).
- Communication: a layer does two all-gathers and two reduce-scatters forward, the same
  backward, and no all-reduce, each over a full [b, s, h]: the bytes of the two all-reduces it
  replaces (an all-reduce is a reduce-scatter plus an all-gather).
- The real entrypoint at TP=2 with SP follows the plain run's loss curve, and its checkpoint
  decodes with a KV cache (inference builds the model without SP).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config.load import load_config
from megatron.config.schema import OptimizerConfig, PrecisionConfig, padded_vocab_size
from megatron.launch.preflight import validate
from megatron.models.bert import BertModel
from megatron.models.build import build_model
from megatron.models.gpt import GPTModel
from megatron.models.transformer import TransformerLayer
from megatron.optim.build import build_optimizer
from megatron.parallel.data_parallel import DataParallel
from megatron.parallel.layers import ColumnParallelLinear
from megatron.parallel.random import RNGTracker
from megatron.parallel.sequence_parallel import (
    allreduce_sequence_parallel_grads,
    dropout_slice,
    is_sequence_parallel,
)
from megatron.parallel.state import ParallelState, initialize
from tests.distributed import run_distributed
from tests.gpt_run import ROOT, read_metrics, run_pretrain, tiny_overrides
from tests.model_config import tiny_model_config
from tests.test_bert_model import batch as bert_batch
from tests.test_bert_model import losses as bert_losses
from tests.test_config import error_of, tiny

VOCAB, SEQ = 250, 16


def build(kind: str, st: ParallelState, sp: bool, seed: int = 1234, **overrides) -> nn.Module:
    cfg = tiny_model_config(**overrides)
    tracker = RNGTracker(st.device)
    tracker.seed(seed, st.tp_rank)
    padded = padded_vocab_size(VOCAB, 128, st.tp_size)
    if kind == "gpt":
        return GPTModel(cfg, VOCAB, padded, st, tracker, sp)
    binary = "nsp" if overrides.get("layernorm_position") == "post" else "sop"
    return BertModel(cfg, VOCAB, padded, st, tracker, 2, binary, sp)


def gpt_tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(step))


def loss_of(kind: str, model: nn.Module, step: int) -> torch.Tensor:
    """pretrain_gpt's or pretrain_bert's loss on the step's batch (the same on every rank)."""
    if kind == "gpt":
        tokens = gpt_tokens(step)
        return model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    lm, binary = bert_losses(model, bert_batch(seed=step))
    return lm + binary


def train(kind: str, model: nn.Module, st: ParallelState, steps: int) -> list[float]:
    """TrainLoop.train_step's order: backward, DP sync, the SP all-reduce, the optimizer step."""
    ddp = DataParallel(model, st)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3), PrecisionConfig("fp32"), st)
    model.train()
    losses = []
    for step in range(steps):
        ddp.zero_grad_buffer()
        loss = loss_of(kind, model, step)
        loss.backward()
        ddp.finish_grad_sync()
        allreduce_sequence_parallel_grads(model, st.tp_group)
        assert optimizer.step().updated
        losses.append(loss.item())
    return losses


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


CASES = [("gpt", {}), ("bert", {}), ("gpt", {"recompute": "full"})]


def _child(tp: int) -> dict:
    st = initialize(tp)
    out = {"training": training(st)}
    if tp == 2:
        out.update(dropout=dropout(st), collectives=collectives(st), flagged=flagged(st))
    return out


@functools.cache
def results(tp: int) -> list[dict]:
    """Every rank's results of one spawn per TP size, shared by the tests that read them:
    starting processes costs more than these tiny models."""
    return run_distributed(_child, tp, tp)


def training(st: ParallelState) -> dict:
    """20 steps of each case, SP off and on (recomputation at TP=2 only: it replays the same
    forward whatever the TP size)."""
    return {
        (kind, sp, *overrides.values()): train(kind, build(kind, st, sp, **overrides), st, 20)
        for kind, overrides in CASES
        if st.tp_size == 2 or not overrides
        for sp in (False, True)
    }


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_training_matches_without_sequence_parallel(tp):
    runs = results(tp)[0]["training"]
    assert len(runs) == (6 if tp == 2 else 4)
    for kind, sp, *overrides in runs:
        if sp:
            on, off = runs[kind, True, *overrides], runs[kind, False, *overrides]
            assert rel(on, off) <= 1e-5, (kind, overrides, on, off)


DROPOUT_CASES = [
    ("gpt", {}),
    ("gpt", {"recompute": "full"}),
    ("bert", {}),
    ("bert", {"layernorm_position": "post"}),  # its embedding LayerNorm + dropout see a slice
]


def dropout(st: ParallelState) -> dict:
    """Per case and SP off/on: the first forward's logits, then the losses of 3 steps."""
    out = {}
    for kind, overrides in DROPOUT_CASES:
        for sp in (False, True):
            drop = dict(hidden_dropout=0.1, attention_dropout=0.1)
            model = build(kind, st, sp, seed=5, **drop, **overrides)
            model.train()
            if kind == "gpt":
                logits = model(gpt_tokens(0)[:, :-1])
            else:
                b = bert_batch(seed=0)
                logits = model(b["text"], b["types"], b["padding_mask"])[0]
            out[kind, sp, *overrides.values()] = logits.detach(), train(kind, model, st, 3)
    return out


@pytest.mark.slow
def test_dropout_masks_are_slices_of_the_plain_mask():
    for rank in results(2):
        out = rank["dropout"]
        for kind, overrides in DROPOUT_CASES:
            off_logits, off = out[kind, False, *overrides.values()]
            on_logits, on = out[kind, True, *overrides.values()]
            assert torch.equal(on_logits, off_logits), (kind, overrides)
            assert on[0] == off[0], (kind, overrides)  # the first step's loss, bit for bit
            assert rel(on, off) <= 1e-5, (kind, overrides)


BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}  # to compare bit patterns


@pytest.mark.parametrize("dtype", BITS)
def test_dropout_slice_saves_a_bool_mask_and_is_f_dropouts_slice(dtype):
    """Each of 2 ranks' dropout_slice, from the generator state the unsplit dropout starts at,
    is F.dropout's slice bit for bit, forward and backward (signed zeros, infinities and NaN
    included), and backward holds only the slice's bool mask: one byte per element."""
    tp, p, s = 2, 0.1, 4  # s: each rank's sequence length
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, tp * s, 16, generator=g).to(dtype)
    x[0, 0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0])
    grad = torch.randn(x.shape, generator=g).to(dtype)
    torch.manual_seed(3)
    whole = x.clone().requires_grad_()
    expected = F.dropout(whole, p, True)
    expected.backward(grad)
    assert (expected == 0).any() and (expected != 0).any()
    saved = []  # (dtype, shape) of each tensor saved for backward

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.dtype, t.shape))
        return t

    for rank in range(tp):
        part = x.narrow(1, rank * s, s).clone().requires_grad_()
        saved.clear()
        torch.manual_seed(3)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = dropout_slice(part, p, tp, rank)
        assert saved == [(torch.bool, part.shape)]
        out.backward(grad.narrow(1, rank * s, s))
        for mine, full in [(out.detach(), expected.detach()), (part.grad, whole.grad)]:
            want = full.narrow(1, rank * s, s).contiguous()
            assert torch.equal(mine.view(BITS[dtype]), want.view(BITS[dtype])), (dtype, rank)


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "broadcast", "reduce_scatter")
COLLECTIVES += ("reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")
COLLECTIVES += ("all_to_all_single",)


def _full_size(name: str, args: tuple) -> int:
    """Elements of the collective's full-size side: [b, s, h] for every SP and TP mapping."""
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return args[1].numel()  # the input, summed over the group
    return args[0].numel()  # the tensor reduced in place, or the gathered output


@contextlib.contextmanager
def recorded_collectives() -> Iterator[list[tuple[str, int]]]:
    """Every ``COLLECTIVES`` call made inside, as (name, full size), appended to the list
    yielded; torch.distributed's own functions are back afterwards."""
    calls: list[tuple[str, int]] = []
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name, fn):
        return lambda *a, **k: (calls.append((name, _full_size(name, a))), fn(*a, **k))[1]

    for name in COLLECTIVES:
        setattr(dist, name, counted(name, real[name]))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def collectives(st: ParallelState) -> dict:
    """One layer's collectives (name, full size) forward and backward: plain TP, SP, SP with the
    overlapped column-parallel backward."""
    tracker = RNGTracker(st.device)
    tracker.seed(0, st.tp_rank)
    out = {}
    for sp, overlap in [(False, False), (True, False), (True, True)]:
        layer = TransformerLayer(tiny_model_config(), st, tracker, 0, sequence_parallel=sp)
        for m in layer.modules():
            if isinstance(m, ColumnParallelLinear):  # the overlapped backward (off on CPU)
                m.async_grad_allreduce = overlap
        x = torch.randn(2, 4 if sp else 8, 32, requires_grad=True)  # [b, s or s / tp, h]
        with recorded_collectives() as calls:
            y = layer(x, None)
            forward = list(calls)
            calls.clear()
            y.sum().backward()
            out[sp, overlap] = forward, list(calls)
    return out


@pytest.mark.slow
def test_one_layer_all_gathers_and_reduce_scatters_what_it_all_reduced():
    full = 2 * 8 * 32  # [b, s, h]
    # On gloo the reduce-scatter is an all-to-all of the parts and a local sum (gloo's own
    # reduce-scatter all-reduces the whole): the same full-size tensor goes out.
    ag, rs = ("all_gather_single", full), ("all_to_all_single", full)
    for rank in results(2):
        out = rank["collectives"]
        assert out[False, False] == ([("all_reduce", full)] * 2, [("all_reduce", full)] * 2)
        # Forward: qkv gathers, dense scatters, fc1 gathers, fc2 scatters; backward reversed.
        assert out[True, False] == ([ag, rs, ag, rs], [ag, rs, ag, rs])
        assert out[True, True] == out[True, False]


def flagged(st: ParallelState) -> dict:
    """Per model kind: the parameters its builder flags with SP on, and those expected:
    the transformer's LayerNorms (BERT's LM-head LayerNorm sees gathered activations) and the
    row-parallel biases."""
    out = {}
    for kind, config in [("gpt", "gpt_tiny"), ("bert", "bert_tiny")]:
        cfg = load_config(
            [str(ROOT / "configs" / f"{config}.yaml")], ["parallel.sequence_parallel=true"]
        )
        tracker = RNGTracker(st.device)
        tracker.seed(0, st.tp_rank)
        model = build_model(kind, cfg, VOCAB, padded_vocab_size(VOCAB, 128, 2), st, tracker)
        expected = {
            f"{name}.{p}"
            for name, m in model.named_modules()
            if isinstance(m, nn.LayerNorm) and not name.startswith("lm_head")
            for p in ("weight", "bias")
        }
        expected |= {
            n for n, _ in model.named_parameters() if n.endswith(("dense.bias", "fc2.bias"))
        }
        expected -= {"lm_head.dense.bias"}
        marked = {n for n, p in model.named_parameters() if is_sequence_parallel(p)}
        out[config] = marked, expected
    return out


@pytest.mark.slow
def test_entrypoints_flag_the_parameters_that_see_split_activations():
    for rank in results(2):
        for config, (marked, expected) in rank["flagged"].items():
            assert marked == expected and marked, config


def test_config_needs_tensor_parallelism_and_a_divisible_sequence():
    message = error_of(
        validate,
        tiny("parallel.sequence_parallel=true", "parallel.tensor_parallel_size=1"),
        2,
        check_files=False,
    )
    assert message.startswith("parallel.sequence_parallel=true needs parallel.tensor_parallel_size")
    message = error_of(
        validate,
        tiny("parallel.sequence_parallel=true", "model.seq_length=127"),
        2,
        check_files=False,
    )
    assert "model.seq_length=127" in message and "126 or 128" in message
    validate(tiny("parallel.sequence_parallel=true"), 2, check_files=False)


def _generate_child(ckpt: str) -> tuple[bool, list[int]]:
    from megatron.inference.generation import generate
    from megatron.inference.loading import load_for_inference

    loaded = load_for_inference(ckpt, [])
    (out,) = generate(loaded.model, [[5, 6, 7]], 4, loaded.tokenizer.eod, stop_at_eod=False)
    return loaded.cfg.parallel.sequence_parallel, out.tokens


@pytest.mark.slow
def test_entrypoint_follows_the_plain_run_and_its_checkpoint_decodes(trained_gpt, tmp_path):
    """pretrain_gpt at TP=2 with SP: the plain run's losses (trained_gpt, same overrides) within
    1e-5 for its 20 iterations; its checkpoint then decodes at TP=2 with a KV cache."""
    ckpt = tmp_path / "ckpt"
    extra = {"parallel.sequence_parallel": "true", "checkpoint.save": ckpt}
    overrides = tiny_overrides(trained_gpt, tmp_path, **extra)
    run_pretrain("pretrain_gpt.py", "configs/gpt_tiny.yaml", overrides, nproc=2)
    plain = read_metrics(f"{trained_gpt['run']}/metrics.jsonl")
    mine = read_metrics(tmp_path / "metrics.jsonl")
    assert [e["iteration"] for e in mine] == [e["iteration"] for e in plain]
    assert rel([e["lm_loss"] for e in mine], [e["lm_loss"] for e in plain]) <= 1e-5
    for sequence_parallel, tokens in run_distributed(_generate_child, 2, str(ckpt)):
        assert not sequence_parallel and len(tokens) == 4
