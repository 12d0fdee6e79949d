"""The GPT model at TP=1, 2, 4 against itself serially: logits, loss and every gradient.

The TP=N model holds exact slices of the TP=1 model, so differences come only from float
reduction order (split matmul sums, all-reduces): logits and loss agree within 1e-5 relative
(normalised by the largest magnitude), gradients within 1e-4.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.models.gpt import GPTModel
from megatron.models.transformer import TransformerLayer
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import initialize
from tests.distributed import run_distributed
from tests.model_config import tiny_model_config
from tests.test_layers import close, gather_param

VOCAB = 250


def padded(tp: int) -> int:
    return -(-VOCAB // (128 * tp)) * 128 * tp


def build(tp: int, seed: int = 1234, st=None, **overrides):
    st = st or initialize(tp)
    cfg = tiny_model_config(**overrides)
    tracker = RNGTracker(st.device)
    tracker.seed(seed, st.tp_rank)
    return st, GPTModel(cfg, VOCAB, padded(tp), st, tracker), tracker


def batch(n: int = 4, s: int = 16, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def full_results(st, model, tokens, labels):
    """Gathered logits (unpadded), mean loss, and every gathered gradient (unpadded rows)."""
    logits = model(tokens)
    full_logits = gather_param(logits.detach(), -1, st.tp_group)[..., :VOCAB]
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = gather_param(p.grad, getattr(p, "tp_split_dim", None), st.tp_group)
        grads[name] = g[:VOCAB] if name == "embedding.word.weight" else g
    return full_logits, loss.detach(), grads


def _run_tp(tp: int):
    st, model, _ = build(tp)
    tokens, labels = batch()
    return full_results(st, model, tokens, labels)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_tp_matches_serial(tp):
    ref_logits, ref_loss, ref_grads = run_distributed(_run_tp, 1, 1)[0]
    for logits, loss, grads in run_distributed(_run_tp, tp, tp):
        close(logits, ref_logits, 1e-5)
        close(loss, ref_loss, 1e-5)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            close(g, ref_grads[name], 1e-4)


def _dropout_runs(tp: int, recompute: str):
    """Two builds with one seed, one with another seed; recompute on or off."""
    out = []
    tokens, labels = batch()
    st = initialize(tp)
    for seed in (5, 5, 6):
        _, model, _ = build(
            tp, seed=seed, st=st, hidden_dropout=0.2, attention_dropout=0.2, recompute=recompute
        )
        model.train()
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    return out


@pytest.mark.slow
def test_dropout_is_reproducible_and_recompute_replays_it():
    """Same seed: bit-identical; another seed: different; recomputation: the same masks."""
    plain = run_distributed(_dropout_runs, 2, 2, "none")
    recomputed = run_distributed(_dropout_runs, 2, 2, "full")
    for (a, b, c), (ra, _, _) in zip(plain, recomputed):
        assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
        assert not torch.equal(a[0], c[0])
        assert torch.equal(a[0], ra[0])
        for x, y in zip(a[1], ra[1]):
            close(y, x, 1e-6)


def _count_layer_collectives(tp: int):
    st = initialize(tp)
    cfg = tiny_model_config()
    tracker = RNGTracker(st.device)
    tracker.seed(0, st.tp_rank)
    layer = TransformerLayer(cfg, st, tracker, 0)
    x = torch.randn(2, 8, cfg.hidden_size, requires_grad=True)
    calls = []
    real = {
        name: getattr(dist, name)
        for name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter")
    }
    for name, fn in real.items():
        setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
    try:
        y = layer(x, None)
        forward = list(calls)
        calls.clear()
        y.sum().backward()
        backward = list(calls)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return forward, backward


@pytest.mark.slow
def test_one_layer_does_two_all_reduces_each_way():
    for forward, backward in run_distributed(_count_layer_collectives, 2, 2):
        assert forward == ["all_reduce", "all_reduce"]
        assert backward == ["all_reduce", "all_reduce"]


def _dp_grads(tp: int, dp_parts: int):
    """Gradients averaged over DP replicas, each on its slice of one batch of 8."""
    st, model, _ = build(tp)
    tokens, labels = batch(n=8)
    per = 8 // st.dp_size
    rows = slice(st.dp_rank * per, (st.dp_rank + 1) * per)
    model(tokens[rows], labels=labels[rows]).mean().backward()
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=st.dp_group)
        p.grad /= st.dp_size
        grads[name] = gather_param(p.grad, getattr(p, "tp_split_dim", None), st.tp_group)
    return grads


@pytest.mark.slow
def test_data_parallel_composes_with_tensor_parallel():
    ref = run_distributed(_dp_grads, 2, 2, 1)[0]
    for grads in run_distributed(_dp_grads, 4, 2, 2):
        for name, g in grads.items():
            close(g, ref[name], 1e-5)
