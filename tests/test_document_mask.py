"""Document masks from per-token document ids, against the dense per-sample mask they replace.

The reference is the path this replaced: Megatron's dense mask ([s, s] per sample, built by a
plain loop), handed to scaled_dot_product_attention as a bool mask in every layer. The additive
mask is the same 0 / -inf the bool mask becomes inside SDPA, and flex attention (eager on CPU)
computes the same softmax over the same keys, so logits and gradients agree within 1e-5
relative (float summation order only).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.data.gpt_dataset import ltor_masks
from megatron.models import document_mask, gpt
from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.state import ParallelState
from tests.gpt_run import ROOT, read_metrics, run_pretrain, tiny_overrides
from tests.test_gpt_dataset import _megatron_masks
from tests.test_gpt_model import VOCAB, build
from tests.test_layers import close

EOD = 3
# A world of one without process groups, so these in-process tests leave no group behind.
CPU = ParallelState.serial(torch.device("cpu"))


def packed_batch(n: int = 3, s: int = 16, seed: int = 11):
    """Tokens with EODs at random places (one row starts and one ends with EOD), labels, and
    the dataset's position and document ids, stacked as the loader does."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, s + 1), generator=g)
    tokens[torch.rand(n, s + 1, generator=g) < 0.2] = EOD
    tokens[0, 0], tokens[1, s - 1] = EOD, EOD
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    rows = [ltor_masks(t, EOD, True, True, False) for t in inputs]
    position_ids = torch.stack([r["position_ids"] for r in rows])  # [b, s]
    document_ids = torch.stack([r["document_ids"] for r in rows])  # [b, s]
    return inputs, labels, position_ids, document_ids


def dense_reference(model, tokens, labels, position_ids):
    """The replaced path: per-sample dense masks, True = attend, through the same layers."""
    attend = torch.stack([~_megatron_masks(t, EOD)[2] for t in tokens])  # [b, 1, s, s]
    h = model.embedding(tokens, position_ids)  # [b, s, h]
    h = model.transformer(h, attend)
    logits = F.linear(h, model.embedding.word.weight)  # [b, s, padded_vocab]
    return logits, vocab_parallel_cross_entropy(logits.clone(), labels, VOCAB, None)


def logits_and_grads(model, run):
    """Logits and every gradient of the mean loss of ``run(model) -> (logits, losses)``."""
    model.zero_grad()
    logits, losses = run(model)
    losses.mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_document_ids_give_the_dense_mask_results():
    """The additive mask (CPU, and CUDA with attention dropout): logits and every gradient."""
    _, model, _ = build(1, st=CPU)
    tokens, labels, positions, docs = packed_batch()
    assert docs[0, 0] == 0 and docs.max() > 2  # several documents per row
    ref_logits, ref_grads = logits_and_grads(
        model, lambda m: dense_reference(m, tokens, labels, positions)
    )
    logits, grads = logits_and_grads(
        model, lambda m: (m(tokens, positions, docs), m(tokens, positions, docs, labels=labels))
    )
    close(logits, ref_logits, 1e-5)
    for name, g in grads.items():
        close(g, ref_grads[name], 1e-5)


@pytest.mark.skipif(document_mask.flex_attention is None, reason="this torch has no flex attention")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_mask_gives_the_dense_mask_logits(monkeypatch):
    """The CUDA path's BlockMask, run through eager flex attention on CPU: forward only, since
    torch has no flex-attention backward on CPU (the CUDA test below checks gradients)."""
    monkeypatch.setattr(gpt, "uses_flex", lambda device, dropout: True)
    _, model, _ = build(1, st=CPU)
    tokens, labels, positions, docs = packed_batch()
    with torch.no_grad():
        ref_logits, ref_losses = dense_reference(model, tokens, labels, positions)
        close(model(tokens, positions, docs), ref_logits, 1e-5)
        close(model(tokens, positions, docs, labels=labels), ref_losses, 1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused flex path needs CUDA")
def test_flex_attention_on_cuda_equals_the_additive_mask(monkeypatch):
    """On CUDA the model picks compiled flex attention; against the additive SDPA mask, logits
    and gradients within 1e-4 (two different fused kernels, each with its own online softmax)."""
    cuda = ParallelState.serial(torch.device("cuda"))
    # head_dim 16: flex attention's kernels need at least 16
    _, model, _ = build(1, st=cuda, hidden_size=64, ffn_hidden_size=256)
    device = model.embedding.word.weight.device
    tokens, labels, positions, docs = (t.to(device) for t in packed_batch())
    assert isinstance(gpt.document_mask(docs, torch.float32, True), document_mask.BlockMask)

    def run(m):
        return m(tokens, positions, docs), m(tokens, positions, docs, labels=labels)

    logits, grads = logits_and_grads(model, run)
    monkeypatch.setattr(gpt, "uses_flex", lambda device, dropout: False)
    ref_logits, ref_grads = logits_and_grads(model, run)
    close(logits, ref_logits, 1e-4)
    for name, g in grads.items():
        close(g, ref_grads[name], 1e-4)


def test_the_mask_is_built_once_per_forward(monkeypatch):
    calls = []
    real = gpt.document_mask
    monkeypatch.setattr(gpt, "document_mask", lambda *a: calls.append(1) or real(*a))
    _, model, _ = build(1, st=CPU, num_layers=3)
    tokens, _, positions, docs = packed_batch()
    model(tokens, positions, docs)
    assert len(calls) == 1


def test_flex_only_where_it_is_fused_and_exact():
    """BlockMasks only on CUDA and without attention dropout (flex attention has none)."""
    assert not document_mask.uses_flex(torch.device("cpu"), 0.0)
    assert not document_mask.uses_flex(torch.device("cuda"), 0.1)
    assert document_mask.uses_flex(torch.device("cuda"), 0.0) == (
        document_mask.flex_attention is not None
    )


# pretrain_gpt.py with the model fed the dense bool mask of the replaced path (True = attend).
DENSE_ENTRYPOINT = """
import runpy, sys, torch
sys.path.insert(0, {root!r})
from megatron.models import gpt

def dense(doc, dtype, flex):
    causal = torch.ones(doc.shape[1], doc.shape[1], dtype=torch.bool).tril()  # [s_q, s_k]
    return causal & (doc[:, None, :, None] == doc[:, None, None, :])  # [b, 1, s, s]

gpt.document_mask = dense
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


@pytest.mark.slow
def test_training_losses_equal_the_dense_mask_path(gpt_data, tmp_path):
    """Five steps with document resets through the real entrypoint, against the dense mask;
    without resets the losses differ (the samples do hold several documents)."""
    dense = tmp_path / "dense_entrypoint.py"
    dense.write_text(DENSE_ENTRYPOINT.format(root=str(ROOT)))
    short = {"training.train_iters": 5, "parallel.tensor_parallel_size": 1}
    resets = {**short, "data.reset_attention_mask": "true", "data.reset_position_ids": "true"}
    runs = {}
    for name, script, extra in (
        ("ids", "pretrain_gpt.py", resets),
        ("dense", str(dense), resets),
        ("plain", "pretrain_gpt.py", short),
    ):
        overrides = tiny_overrides(gpt_data, tmp_path / name, **extra)
        run_pretrain(script, "configs/gpt_tiny.yaml", overrides)
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    assert len(runs["ids"]) == 5
    for a, b in zip(runs["ids"], runs["dense"], strict=True):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * abs(b["lm_loss"])
    assert runs["plain"][-1]["lm_loss"] != runs["ids"][-1]["lm_loss"]
