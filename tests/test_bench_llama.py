"""The benchmark's Llama row times two models of one function: ours and the plain PyTorch Llama
(benchmarks/plain_llama.py), our weights copied in, give the same loss, and the same loss after
one SGD step on each (a step along the gradients themselves, so every gradient counts).

The tolerance, 1e-5 relative, is float association order (fused QKV and fc1 matmuls against
separate ones, SDPA's grouped key/value heads against repeated ones) in fp32.
"""

from __future__ import annotations

import torch

from benchmarks.bench_gpt_step import Shape, llama_pair
from megatron.parallel.state import ParallelState

SHAPE = Shape(layers=2, hidden=64, heads=8, vocab=512, seq=32, batch=2, groups=2, ffn=176)


def test_plain_llama_computes_our_loss():
    torch.manual_seed(0)
    ours, plain = llama_pair(ParallelState.serial(torch.device("cpu")), SHAPE)
    data = torch.randint(0, SHAPE.vocab, (SHAPE.batch, SHAPE.seq + 1))
    tokens, labels = data[:, :-1], data[:, 1:]
    losses = []
    for model, loss_fn in ((ours, lambda: ours(tokens, labels=labels).mean()),
                           (plain, lambda: plain(tokens, labels))):  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        first = loss_fn()
        first.backward()
        opt.step()
        losses.append((first.item(), loss_fn().item()))
    (ours_first, ours_next), (plain_first, plain_next) = losses
    assert abs(ours_first - plain_first) <= 1e-5 * abs(plain_first), losses
    assert abs(ours_next - plain_next) <= 1e-5 * abs(plain_next), losses
    assert ours_next < ours_first - 1e-3  # the step moved the weights the loss depends on
