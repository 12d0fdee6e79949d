"""The BERT model: TP=1, 2, 4 against serial, its masked-only LM head, its attention, and the
estimates (parameter count, activation bytes, dry run) against the real model.

As for GPT, the TP=N model holds exact slices of the TP=1 model, so differences come only from
float reduction order (split matmul sums, all-reduces): logits and losses agree within 1e-5
relative (normalised by the largest magnitude), gradients within 1e-4.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from megatron.config.load import load_config
from megatron.config.schema import padded_vocab_size
from megatron.data.bert_dataset import masked_count
from megatron.estimate.memory import estimate_memory
from megatron.estimate.parameters import count_parameters
from megatron.models.bert import BertModel
from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.random import RNGTracker
from megatron.parallel.state import initialize
from tests.distributed import run_distributed
from tests.model_config import tiny_model_config
from tests.test_estimate import saved_bytes
from tests.test_layers import close, gather_param

VOCAB = 250
SEQ = 16
# (model overrides, binary head): pre-LN with sentence order; the original post-LN arrangement
# (embedding LayerNorm, no final one) with NSP; no binary head at all.
CASES = [({}, "sop"), ({"layernorm_position": "post"}, "nsp"), ({}, "none")]


def build(st, overrides: dict, binary_head: str, vocab: int = VOCAB, seed: int = 1234):
    cfg = tiny_model_config(**overrides)
    tracker = RNGTracker(st.device)
    tracker.seed(seed, st.tp_rank)
    padded = padded_vocab_size(vocab, 128, st.tp_size)
    return BertModel(cfg, vocab, padded, st, tracker, 2, binary_head)


def pad_masked(masked: torch.Tensor) -> torch.Tensor:
    """Each row's masked positions in order, then 0 up to the widest row: the datasets'
    ``masked_positions``."""
    width = int(masked.sum(1).max())
    order = torch.sort((~masked).to(torch.int8), dim=1, stable=True).indices[:, :width]
    return torch.where(masked.gather(1, order), order, 0)


def batch(n: int = 4, seed: int = 7, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Random sentence pairs with padding and ~15% masked positions (never [CLS] or padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([SEQ, SEQ - 5, SEQ - 2, 9])[:n]
    real = torch.arange(SEQ)[None, :] < lengths[:, None]  # [n, s]
    tokens = torch.randint(5, vocab, (n, SEQ), generator=g).masked_fill(~real, 0)
    types = (torch.arange(SEQ)[None, :] >= lengths[:, None] // 2).long() * real
    masked = (torch.rand(n, SEQ, generator=g) < 0.2) & real
    masked[:, 0] = False
    masked[:, 1] = True  # every sample has at least one masked token
    labels = torch.where(masked, torch.randint(5, vocab, (n, SEQ), generator=g), -1)
    return {
        "text": tokens,
        "types": types,
        "padding_mask": real.long(),
        "labels": labels,
        "loss_mask": masked.float(),
        "is_random": torch.randint(0, 2, (n,), generator=g),
        "masked_positions": pad_masked(masked),
    }


def losses(model, b: dict[str, torch.Tensor]):
    """pretrain_bert's losses: the masked-token mean LM loss, the binary head's cross entropy."""
    lm, binary = model(b["text"], b["types"], b["padding_mask"], b["labels"], b["masked_positions"])
    lm_loss = (lm * b["loss_mask"]).sum() / b["loss_mask"].sum()
    if binary is None:
        return lm_loss, torch.zeros(())
    return lm_loss, F.cross_entropy(binary.float(), b["is_random"])


def _run_tp(tp: int):
    """Per case: gathered logits (unpadded), binary logits, both losses, gathered gradients."""
    st = initialize(tp)
    b = batch()
    out = []
    for overrides, head in CASES:
        model = build(st, overrides, head)
        logits, binary = model(b["text"], b["types"], b["padding_mask"])
        full_logits = gather_param(logits.detach(), -1, st.tp_group)[..., :VOCAB]
        lm_loss, binary_loss = losses(model, b)
        (lm_loss + binary_loss).backward()
        grads = {}
        for name, p in model.named_parameters():
            g = gather_param(p.grad, getattr(p, "tp_split_dim", None), st.tp_group)
            grads[name] = g[:VOCAB] if getattr(p, "vocab_padded", False) else g
        detached = None if binary is None else binary.detach()
        out.append((full_logits, detached, lm_loss.detach(), binary_loss.detach(), grads))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_bert_tp_matches_serial(tp):
    serial = run_distributed(_run_tp, 1, 1)[0]
    for rank in run_distributed(_run_tp, tp, tp):
        for (overrides, head), got, ref in zip(CASES, rank, serial, strict=True):
            logits, binary, lm_loss, binary_loss, grads = got
            close(logits, ref[0], 1e-5)
            if head != "none":
                close(binary, ref[1], 1e-5)
                close(binary_loss, ref[3], 1e-5)
            close(lm_loss, ref[2], 1e-5)
            assert grads.keys() == ref[4].keys(), (overrides, head)
            for name, g in grads.items():
                close(g, ref[4][name], 1e-4)


def _head_and_attention():
    st = initialize(1)
    model = build(st, {}, "sop")
    b = batch()
    out = {}
    # the masked-only head against full logits through the same vocab-parallel loss, where the
    # -1 labels of unmasked positions meet a zero loss mask
    logits, _ = model(b["text"], b["types"], b["padding_mask"])
    dense = vocab_parallel_cross_entropy(logits, b["labels"], VOCAB, st.tp_group)
    dense_loss = (dense * b["loss_mask"]).sum() / b["loss_mask"].sum()
    params = list(model.parameters())
    # the binary head takes no part in the LM loss
    grad = lambda loss: torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)  # noqa: E731
    dense_grads = grad(dense_loss)
    sparse, _ = model(b["text"], b["types"], b["padding_mask"], b["labels"], b["masked_positions"])
    sparse_loss = (sparse * b["loss_mask"]).sum() / b["loss_mask"].sum()
    sparse_grads = grad(sparse_loss)
    every, _ = model(b["text"], b["types"], b["padding_mask"], labels=b["labels"])
    out["head"] = (dense.detach(), sparse.detach(), dense_grads, sparse_grads, every.detach())
    # bidirectional: a later token changes the first position; padding changes nothing real
    later = {**b, "text": b["text"].clone()}
    later["text"][0, SEQ - 1] = (later["text"][0, SEQ - 1] + 1) % VOCAB
    padded = {**b, "text": b["text"].clone(), "types": b["types"].clone()}
    padded["text"][3, 9:] = 77
    padded["types"][3, 9:] = 1
    with torch.no_grad():
        runs = [model(x["text"], x["types"], x["padding_mask"]) for x in (b, later, padded)]
    out["attention"] = [(logits.clone(), binary.clone()) for logits, binary in runs]
    return out


def test_masked_only_head_and_bidirectional_attention():
    out = run_distributed(_head_and_attention, 1)[0]
    dense, sparse, dense_grads, sparse_grads, every = out["head"]
    masked = batch()["loss_mask"].bool()
    assert torch.isfinite(dense).all()  # -1 labels give finite losses, zeroed by the mask
    close(sparse[masked], dense[masked], 1e-6)
    assert (sparse[~masked] == 0).all()
    close(every, sparse, 1e-6)  # without masked_positions the head runs on every position
    for s, d in zip(sparse_grads, dense_grads, strict=True):
        close(s, d, 1e-5)
    (base, base_bin), (later, _), (padded, padded_bin) = out["attention"]
    assert not torch.allclose(later[0, 0], base[0, 0])  # position 0 sees position s-1
    assert torch.allclose(later[1:], base[1:], atol=1e-6)
    assert torch.allclose(padded[3, :9], base[3, :9], atol=1e-6)  # padding is invisible
    assert torch.allclose(padded_bin, base_bin, atol=1e-6)


SHAPES = [  # (model overrides, vocab, binary head): counted against count_parameters
    ({}, 250, "sop"),
    ({"layernorm_position": "post"}, 1000, "nsp"),
    ({"num_layers": 3, "ffn_hidden_size": 96, "max_position_embeddings": 24}, 77, "none"),
    ({"hidden_size": 48, "num_attention_heads": 6, "ffn_hidden_size": 192}, 30522, "sop"),
]


def _measure(tp: int):
    """Per shape on this rank: (split, replicated) parameters, and saved bytes at TP=1."""
    st = initialize(tp)
    out = []
    for overrides, vocab, head in SHAPES:
        model = build(st, overrides, head, vocab).train()
        params = list(model.parameters())
        split = sum(p.numel() for p in params if hasattr(p, "tp_split_dim"))
        entry = {"split": split, "replicated": sum(p.numel() for p in params) - split}
        if tp == 1:  # a batch whose samples mask the most tokens a sample can
            b = batch(n=2, vocab=vocab)
            n = masked_count(SEQ - 3, 0.15)
            b["labels"] = torch.full((2, SEQ), -1).index_fill(1, torch.arange(1, n + 1), 5)
            b["masked_positions"] = torch.arange(1, n + 1).expand(2, n)
            b["padding_mask"] = torch.ones(2, SEQ, dtype=torch.long)
            entry["saved"] = saved_bytes(
                model, b["text"], b["types"], b["padding_mask"], b["labels"], b["masked_positions"]
            )
        out.append(entry)
    return out


def test_counts_and_activation_bytes_match_the_model():
    """count_parameters equals sum(numel); the activation estimate plus the loss's fp32
    exponentials (4 * tokens * V) matches what autograd saves, up to the int64/bool index tensors
    (< 32 bytes a token), as for GPT (dropout off: CPU keeps float dropout masks)."""
    for (overrides, vocab, head), got in zip(SHAPES, run_distributed(_measure, 1, 1)[0]):
        cfg = tiny_model_config(**overrides)
        padded = padded_vocab_size(vocab, 128, 1)
        params = count_parameters(cfg, padded, 1, "bert", 2, head != "none")
        assert got["split"] + got["replicated"] == params.total, (overrides, head)
        run = load_config(
            ["configs/bert_tiny.yaml"],
            ["precision.dtype=fp32", "parallel.tensor_parallel_size=1", f"bert.binary_head={head}"],
        )
        run = dataclasses.replace(
            run, model=cfg, training=dataclasses.replace(run.training, micro_batch_size=2)
        )
        head_tokens = 2 * masked_count(SEQ - 3, 0.15)
        estimated = estimate_memory(run, padded, "bert").activations_no_recompute
        estimated += 4 * head_tokens * padded
        assert 0 <= got["saved"] - estimated < 32 * 2 * SEQ, (overrides, got["saved"], estimated)


@pytest.mark.slow
def test_counts_match_the_model_at_tp2():
    ranks = run_distributed(_measure, 2, 2)
    for i, (overrides, vocab, head) in enumerate(SHAPES):
        cfg = tiny_model_config(**overrides)
        params = count_parameters(
            cfg, padded_vocab_size(vocab, 128, 2), 2, "bert", 2, head != "none"
        )
        per_rank = [r[i] for r in ranks]
        assert all(r["split"] + r["replicated"] == params.per_gpu for r in per_rank)
        assert sum(r["split"] for r in per_rank) + per_rank[0]["replicated"] == params.total


def _real_count(vocab: int, padded: int, overrides: dict) -> int:
    st = initialize(1)
    cfg = tiny_model_config(**overrides)
    tracker = RNGTracker(st.device)
    tracker.seed(0, 0)
    return sum(p.numel() for p in BertModel(cfg, vocab, padded, st, tracker).parameters())


def _dry_run_params(capsys, *overrides: str) -> int:
    import pretrain_bert
    from megatron.training.pretrain import main

    argv = ["--config", "configs/bert_3.9b.yaml", "--dry-run", "--world-size", "8", *overrides]
    rc = main(
        argv,
        "",
        pretrain_bert.datasets_provider,
        pretrain_bert.forward_step,
        model_type="bert",
    )
    text = capsys.readouterr().out
    assert rc == 0 and "dry run (bert): world 8 = DP 2 x TP 4" in text, text
    return int(re.search(r"parameters: ([\d,]+) total", text).group(1).replace(",", ""))


def test_dry_run_reports_the_real_parameter_count(capsys):
    """pretrain_bert.py --dry-run on bert_3.9b.yaml: ~3.9B, and for tiny shapes exactly what the
    model holds (the standard uncased vocabulary 30522 is assumed, padded at TP 4 to 30720)."""
    assert round(_dry_run_params(capsys) / 1e9, 1) == 3.9
    shape = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    reported = _dry_run_params(capsys, *(f"model.{k}={v}" for k, v in shape.items()))
    shape.update(ffn_hidden_size=4 * 64, max_position_embeddings=512)  # as the YAML resolves
    assert reported == run_distributed(_real_count, 1, 30522, 30720, shape)[0]
