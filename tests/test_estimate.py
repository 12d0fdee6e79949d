"""The estimates against the real model and the paper, and the dry run end to end.

Parameter counts must equal ``sum(p.numel())`` of GPTModel exactly, at TP=1 and at TP=2 (two
real processes: each rank holds split/tp + replicated; the split parts summed over ranks plus
the replicated ones once give the total). One layer's activation bytes must equal what autograd
actually saves (measured with saved-tensor hooks on CPU in fp32 without dropout, where PyTorch's
CPU attention is the fused kind too, so the formula is exact), with and without sequence
parallelism at TP=2, and the whole model's must match up to a few index tensors. The Table 1
configurations of the Megatron-LM paper must fit a 32 GB V100 at their TP size with
recomputation; 8.3B must not fit on one GPU. (What the distributed optimizer and sequence
parallelism buy: tests/test_memory_metrics.py.)
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.config.load import load_config, parse_args
from megatron.config.schema import padded_vocab_size
from megatron.data.hdf5_dataset import write_shard
from megatron.data.indexed_dataset import IndexedDatasetWriter, data_path
from megatron.errors import ConfigError
from megatron.estimate.activations import layer_activation_bytes
from megatron.estimate.memory import GIB, estimate_memory, fits
from megatron.estimate.parameters import count_parameters
from megatron.launch.data_checks import check_indexed
from megatron.launch.dry_run import dry_run
from tests.distributed import run_distributed
from tests.model_config import tiny_model_config

SP_MODEL = "tests/fixtures/tokenizers/sp-bpe.model"  # a sentencepiece model of 1000 pieces
SP_VOCAB = 1000
# (overrides of tiny_model_config, real vocabulary size): pre-LN, post-LN (no final LN), an ffn
# that is not 4h with a longer position table, and odd head/width choices.
CASES = [
    ({}, 250),
    ({"layernorm_position": "post"}, 1000),
    ({"num_layers": 3, "ffn_hidden_size": 96, "max_position_embeddings": 24}, 77),
    ({"hidden_size": 48, "num_attention_heads": 6, "ffn_hidden_size": 192}, 129),
]


def saved_bytes(model: torch.nn.Module, *inputs: torch.Tensor, **named: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd still holds after one forward
    ``model(*inputs, **named)``, parameters excluded. A tensor saved by a node that the forward
    then dropped (its output unused) is freed and not counted, whatever the allocator does with
    its address."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs, **named)
    storages = {}
    for ref in saved:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    del out
    return sum(storages.values())


def _measure(tp: int, cases: list) -> list[dict]:
    """Per case on this rank: parameters (split, replicated) and one layer's saved bytes, and
    at TP > 1 the same bytes with sequence parallelism (``sp_`` keys)."""
    from megatron.models.gpt import GPTModel
    from megatron.parallel.random import RNGTracker
    from megatron.parallel.state import initialize

    st = initialize(tp)
    out = []
    for overrides, vocab in cases:
        padded = padded_vocab_size(vocab, 128, tp)
        saved = {}
        for sp in (False, True) if tp > 1 else (False,):
            for layers in (1, 2):
                cfg = tiny_model_config(**{**overrides, "num_layers": layers})
                tracker = RNGTracker(st.device)
                tracker.seed(1, st.tp_rank)
                model = GPTModel(cfg, vocab, padded, st, tracker, sequence_parallel=sp).train()
                tokens = torch.randint(0, vocab, (2, cfg.seq_length))
                saved[sp, layers] = saved_bytes(model, tokens, labels=tokens)
        cfg = tiny_model_config(**overrides)
        tracker = RNGTracker(st.device)
        tracker.seed(1, st.tp_rank)
        params = list(GPTModel(cfg, vocab, padded, st, tracker).parameters())
        out.append(
            {
                "split": sum(p.numel() for p in params if hasattr(p, "tp_split_dim")),
                "replicated": sum(p.numel() for p in params if not hasattr(p, "tp_split_dim")),
                "layer_bytes": saved[False, 2] - saved[False, 1],
                "model_bytes": saved[False, 2],
                **(
                    {
                        "sp_layer_bytes": saved[True, 2] - saved[True, 1],
                        "sp_model_bytes": saved[True, 2],
                    }
                    if tp > 1
                    else {}
                ),
            }
        )
    return out


def _expected(tp: int, overrides: dict, vocab: int):
    cfg = tiny_model_config(**overrides)
    params = count_parameters(cfg, padded_vocab_size(vocab, 128, tp), tp)
    return cfg, params


def _check_model_bytes(
    measured: int, overrides: dict, vocab: int, tp: int, sequence_parallel: bool = False
) -> None:
    """Whole model, 2 layers: the estimate's activations plus the loss's saved fp32 exponentials
    (4*b*s*V/t), up to the int64/bool index tensors the embedding and the loss keep (< 32*b*s)."""
    model = tiny_model_config(**{**overrides, "num_layers": 2})
    cfg = load_config(["configs/gpt_tiny.yaml"], ["precision.dtype=fp32"])
    cfg = dataclasses.replace(
        cfg,
        model=model,
        parallel=dataclasses.replace(
            cfg.parallel, tensor_parallel_size=tp, sequence_parallel=sequence_parallel
        ),
        training=dataclasses.replace(cfg.training, micro_batch_size=2),
    )
    padded = padded_vocab_size(vocab, 128, tp)
    mem = estimate_memory(cfg, padded)
    tokens = 2 * model.seq_length
    estimated = mem.activations_no_recompute + 4 * tokens * padded // tp
    assert 0 <= measured - estimated < 32 * tokens, (overrides, measured, estimated)


def test_counts_and_layer_bytes_match_the_model_at_tp1():
    for (overrides, vocab), got in zip(CASES, run_distributed(_measure, 1, 1, CASES)[0]):
        cfg, params = _expected(1, overrides, vocab)
        assert got["split"] + got["replicated"] == params.total, overrides
        assert got["layer_bytes"] == layer_activation_bytes(cfg, 2, 1, 4), overrides
        _check_model_bytes(got["model_bytes"], overrides, vocab, 1)


@pytest.mark.slow
def test_counts_and_layer_bytes_match_the_model_at_tp2():
    ranks = run_distributed(_measure, 2, 2, CASES)
    for i, (overrides, vocab) in enumerate(CASES):
        cfg, params = _expected(2, overrides, vocab)
        per_rank = [r[i] for r in ranks]
        assert all(r["split"] + r["replicated"] == params.per_gpu for r in per_rank), overrides
        assert sum(r["split"] for r in per_rank) + per_rank[0]["replicated"] == params.total
        assert all(r["layer_bytes"] == layer_activation_bytes(cfg, 2, 2, 4) for r in per_rank)
        sp_layer = layer_activation_bytes(cfg, 2, 2, 4, sequence_parallel=True)
        assert all(r["sp_layer_bytes"] == sp_layer for r in per_rank), overrides
        for r in per_rank:
            _check_model_bytes(r["model_bytes"], overrides, vocab, 2)
            _check_model_bytes(r["sp_model_bytes"], overrides, vocab, 2, sequence_parallel=True)


def test_published_counts():
    """GPT-2 small (HF GPT2Model, vocab 50257 unpadded: 124,439,808) and BERT-large (HF BertModel:
    335,141,888, whose embedding LayerNorm stands where our final LayerNorm is, plus our heads)."""
    gpt2 = tiny_model_config(
        num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
        max_position_embeddings=1024,
    )  # fmt: skip
    assert count_parameters(gpt2, 50257, 1).total == 124_439_808
    h, v = 1024, 30522
    bert = tiny_model_config(
        num_layers=24, hidden_size=h, num_attention_heads=16, ffn_hidden_size=4 * h,
        max_position_embeddings=512,
    )  # fmt: skip
    heads = (h * h + h + 2 * h + v) + (2 * h + 2)  # LM head (dense, LN, output bias), binary
    assert count_parameters(bert, v, 1, "bert", 2, True).total == 335_141_888 + heads
    no_binary = count_parameters(bert, v, 1, "bert", 2, False).total
    assert no_binary == 335_141_888 + heads - (h * h + h) - (2 * h + 2)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_layer_bytes_reduce_to_korthikanti(tp):
    """Unfused, 16-bit, f = 4h: s*b*h*(10 + 24/t + 5as/(ht)), plus the LayerNorms' statistics."""
    s, b, h, a = 1024, 4, 3072, 32
    cfg = tiny_model_config(
        hidden_size=h, num_attention_heads=a, ffn_hidden_size=4 * h, seq_length=s,
        hidden_dropout=0.1, attention_dropout=0.1,
    )  # fmt: skip
    want = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)) + 16 * s * b
    assert layer_activation_bytes(cfg, b, tp, 2, fused_attention=False) == want


PAPER = [("1.2b", 1, 1.2), ("2.5b", 2, 2.5), ("4.2b", 4, 4.2), ("8.3b", 8, 8.3)]


@pytest.mark.parametrize("name,tp,billions", PAPER)
def test_paper_table1_fits_a_v100_with_recomputation(name, tp, billions):
    cfg = load_config([f"configs/gpt_{name}.yaml"])
    assert cfg.parallel.tensor_parallel_size == tp and cfg.model.recompute == "full"
    padded = padded_vocab_size(50257, 128, tp)
    assert round(count_parameters(cfg.model, padded, tp).total / 1e9, 1) == billions
    mem = estimate_memory(cfg, padded)
    assert fits(mem.total, 32), mem
    # bf16 with fp32 main params, main_grad and two moments: 18 bytes per parameter
    assert mem.states == 18 * count_parameters(cfg.model, padded, tp).per_gpu
    if tp > 1:  # the paper's weak scaling: each model is too big for half its GPUs
        override = f"parallel.tensor_parallel_size={tp // 2}"
        half = load_config([f"configs/gpt_{name}.yaml"], [override])
        assert not fits(estimate_memory(half, padded_vocab_size(50257, 128, tp // 2)).total, 32)


def test_8_3b_needs_tensor_parallelism():
    one_gpu = load_config(["configs/gpt_8.3b.yaml"], ["parallel.tensor_parallel_size=1"])
    mem = estimate_memory(one_gpu, padded_vocab_size(50257, 128, 1))
    assert not fits(mem.total, 32) and mem.states > 100 * GIB


def _dry(argv: list[str]) -> tuple[int, str]:
    cfg, args = parse_args(argv)
    out = io.StringIO()
    return dry_run(cfg, args, out=out), out.getvalue()


def test_dry_run_cli_answers_for_the_paper_setups():
    rc, text = _dry(["--config", "configs/gpt_8.3b.yaml", "--dry-run", "--world-size", "16",
                     "--gpu-memory-gb", "32"])  # fmt: skip
    assert rc == 0 and "fits in 32 GB: yes" in text and "DP 2 x TP 8" in text
    assert "ABSENT here: data/gpt2_text_document.idx" in text and "gpt2 ASSUMED" in text
    rc, text = _dry(["--config", "configs/gpt_8.3b.yaml", "parallel.tensor_parallel_size=1",
                     "--dry-run", "--world-size", "8", "--gpu-memory-gb", "32"])  # fmt: skip
    assert rc == 1 and "fits in 32 GB: no" in text and "hint:" in text
    rc, text = _dry(["--config", "configs/gpt_8.3b.yaml", "--dry-run", "--world-size", "8"])
    assert rc == 0 and "fits in" not in text and "FLOPs per iteration: 3.659e+16" in text


def test_dry_run_into_a_closed_pipe_exits_quietly():
    """``--dry-run | head -3`` where head has gone before the report is written (the read end
    of a real pipe closed before the start): exit 141, as `cat` there would, and no
    BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    argv = [sys.executable, "pretrain_gpt.py", "--config", "configs/gpt_tiny.yaml", "--dry-run"]
    try:
        done = subprocess.run(
            [*argv, f"tokenizer.model={SP_MODEL}"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            timeout=120,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def test_dry_run_without_an_hf_tokenizer_file_takes_the_configs_rows():
    """Llama 3 8B before its import: tokenizer.vocab_size stands in for the absent file, and
    the count is the published 8.03B; without it the file is asked for."""
    argv = ["--config", "configs/llama3_8b.yaml", "--dry-run", "--world-size", "8"]
    rc, text = _dry(argv)
    assert rc == 0 and "hf ASSUMED (files absent; tokenizer.vocab_size 128256)" in text
    assert "parameters: 8,030,261,248 total" in text
    with pytest.raises(ConfigError, match="tokenizer.model: runs/llama3_8b-import"):
        _dry([*argv, "tokenizer.vocab_size=null"])


def _tiny(tmp_path, tokens: list[list[int]], *overrides: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    prefix = str(tmp_path / "corpus")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for doc in tokens:
            w.add_document([np.array(doc)])
    cfg = load_config(
        ["configs/gpt_tiny.yaml"],
        [f"tokenizer.model={SP_MODEL}", f"data.paths=[{prefix}]",
         f"data.cache_dir={tmp_path / 'cache'}", *overrides],
    )  # fmt: skip
    return cfg, prefix


def test_dry_run_checks_the_data(tmp_path):
    cfg, prefix = _tiny(tmp_path, [[1, 2, 3], [SP_VOCAB - 1, 5]])
    out = io.StringIO()
    assert dry_run(cfg, argparse.Namespace(world_size=4, gpu_memory_gb=1.0), out=out) == 0
    text = out.getvalue()
    assert f"max id {SP_VOCAB - 1} < {SP_VOCAB} (all scanned)" in text
    assert "2 sequences, 5 uint16 tokens" in text and "ABSENT" not in text
    assert "fits in 1 GB: yes" in text
    tiny_gpu = argparse.Namespace(world_size=4, gpu_memory_gb=0.01)
    assert dry_run(cfg, tiny_gpu, out=io.StringIO()) == 1

    bad, _ = _tiny(tmp_path / "bad", [[1, 2], [3, SP_VOCAB, 4]])
    with pytest.raises(ConfigError, match=r"sequence 1, token 3\).*token id 1000 .*\[0, 1000\)"):
        dry_run(bad, argparse.Namespace(world_size=2, gpu_memory_gb=None), out=io.StringIO())


def test_dry_run_rejects_config_and_file_errors(tmp_path):
    cfg, prefix = _tiny(tmp_path, [[1, 2, 3]])
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        dry_run(cfg, argparse.Namespace(world_size=3, gpu_memory_gb=None), out=io.StringIO())
    with open(data_path(prefix), "ab") as f:
        f.write(b"\0\0")  # one token more than the index describes
    with pytest.raises(ConfigError, match="corpus.bin: 8 bytes but"):
        dry_run(cfg, argparse.Namespace(world_size=2, gpu_memory_gb=None), out=io.StringIO())
    absent = tmp_path / "absent.model"
    missing = load_config(["configs/gpt_tiny.yaml"], [f"tokenizer.model={absent}"])
    with pytest.raises(ConfigError, match=f"tokenizer.model: {absent} not found"):
        dry_run(missing, argparse.Namespace(world_size=2, gpu_memory_gb=None), out=io.StringIO())


def test_sampled_scan(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 900, 1000).tolist() for _ in range(64)]
    _, prefix = _tiny(tmp_path, docs)
    full = check_indexed(prefix, SP_VOCAB)
    part = check_indexed(prefix, SP_VOCAB, sample_tokens=64 * 100)
    assert not full.sampled and part.sampled
    assert full.max_id == max(map(max, docs)) and part.max_id <= full.max_id


def test_dry_run_checks_hdf5_shards(tmp_path):
    s, n = 16, 3
    sample = {
        "text": np.arange(s), "types": np.zeros(s, np.int64), "padding_mask": np.ones(s),
        "loss_mask": np.eye(s)[2], "labels": np.full(s, 7), "is_random": 0,
    }  # fmt: skip
    write_shard(str(tmp_path / "a.hdf5"), [sample] * n, max_predictions=4)
    overrides = ["data.format=hdf5", f"data.paths=[{tmp_path}]", "model.seq_length=16",
                 f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    # A run the 3 rows can feed: the dry run also checks each split's sample count.
    overrides += ["training.train_iters=1", "optimizer.lr_warmup_iters=0", "training.eval_iters=0",
                  "training.micro_batch_size=1", "training.global_batch_size=2"]  # fmt: skip
    cfg = load_config(["configs/gpt_tiny.yaml"], [f"tokenizer.model={SP_MODEL}", *overrides])
    out = io.StringIO()
    assert dry_run(cfg, argparse.Namespace(world_size=2, gpu_memory_gb=None), "bert", out) == 0
    assert f"{n} sequences, {n * s} int32 tokens; max id 15 < {SP_VOCAB}" in out.getvalue()
    sample["labels"] = np.full(s, SP_VOCAB + 5)
    write_shard(str(tmp_path / "b.hdf5"), [sample], max_predictions=4)
    with pytest.raises(ConfigError, match=r"b.hdf5 \(masked_lm_ids\): token id 1005"):
        dry_run(cfg, argparse.Namespace(world_size=2, gpu_memory_gb=None), "bert", out)
