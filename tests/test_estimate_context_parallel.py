"""Context parallelism (``parallel.context_parallel_size``) in the memory estimate and the dry run.

CP c gives each rank s/c of every sample's tokens: every activation term falls as 1/c at a fixed
global batch, and layer bytes at (s, c) are those at (s/c, 1). Against the real ring
(megatron/parallel/context_parallel.py, two gloo processes): one layer's saved bytes exactly,
and its transient peak in backward within 6%. Ring attention's transient buffers are the K/V
and dK/dV messages, query-sized buffers and one fused-kernel pair's outputs, all 1/c (no score
block: nothing grows as (s/c)^2), counted once in the total. The distributed optimizer
shards over DP x CP. At CP 1 every figure is today's.
The dry run names CP in its layout line and states the longest seq_length that fits; a
seq_length not divisible by 2c, or a world not divisible by tp * cp * pp, is one line and exit
code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import re
import subprocess
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.config.load import load_config, parse_args
from megatron.errors import ConfigError
from megatron.estimate.activations import (
    CPU_KERNEL_TILES,
    layer_activation_bytes,
    ring_attention_bytes,
)
from megatron.estimate.flops import flops_per_iteration
from megatron.estimate.longest_sequence import longest_seq_length, seq_granularity, with_seq_length
from megatron.estimate.memory import estimate_memory, estimate_stages, fits, worst_stage
from megatron.launch.dry_run import dry_run
from tests.distributed import run_distributed
from tests.gpt_run import ROOT
from tests.model_config import tiny_model_config
from tests.test_estimate import saved_bytes
from tests.test_llama_model import _composite_rms_bytes

LLAMA = "configs/llama3_8b.yaml"
LONG = ["model.seq_length=32768", "model.max_position_embeddings=32768"]
# (config, overrides): Llama 3 8B (RoPE, GQA, SwiGLU, RMSNorm, TP 2 with SP and the distributed
# optimizer) and GPT-2 345M (learned positions, LayerNorm, hidden dropout masks, no SP).
CONFIGS = [
    (LLAMA, LONG),
    ("configs/gpt_345m.yaml", ["model.attention_dropout=0.0", "model.seq_length=4096",
                               "model.max_position_embeddings=4096"]),
]  # fmt: skip


def _at(path: str, overrides: list[str], cp: int, *more: str):
    return load_config([path], [*overrides, f"parallel.context_parallel_size={cp}", *more])


@pytest.mark.parametrize("path, overrides", CONFIGS)
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_activations_fall_as_one_over_cp(path, overrides, cp):
    """Same samples, same DP (the world grows with CP): every activation and the logits are
    1/cp of CP 1's and of CP 2's times 2; one layer at (s, cp) is one layer at (s/cp, 1).
    Weights, gradients and the (not distributed) optimizer state stay."""
    one, two, many = (_at(path, overrides, c) for c in (1, 2, cp))
    m, b = one.model, one.training.micro_batch_size
    tp, sp = one.parallel.tensor_parallel_size, one.parallel.sequence_parallel
    layer = layer_activation_bytes(m, b, tp, 2, sequence_parallel=sp)
    ring = layer_activation_bytes(m, b, tp, 2, sequence_parallel=sp, context_parallel=cp)
    assert ring * cp == layer
    short = dataclasses.replace(m, seq_length=m.seq_length // cp)
    assert ring == layer_activation_bytes(short, b, tp, 2, sequence_parallel=sp)
    base, pair = estimate_memory(one, 128256, "gpt", 2), estimate_memory(two, 128256, "gpt", 2)
    split = estimate_memory(many, 128256, "gpt", 2)
    for name in ("activations_no_recompute", "activations_recompute", "logits"):
        assert getattr(split, name) * cp == getattr(pair, name) * 2, name
    for name in ("activations_no_recompute", "activations_recompute", "logits"):
        assert getattr(pair, name) * 2 == getattr(base, name), name
    assert (split.weights, split.main_grads) == (base.weights, base.main_grads)
    if not one.parallel.distributed_optimizer:
        assert (split.main_params, split.adam_moments) == (base.main_params, base.adam_moments)
    assert split.unfused_attention_extra == 0  # the ring never materialises probabilities


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_ring_buffers(cp):
    """Two K/V messages [2, b, g/t, s/c, d] in bf16, fp32 dK/dV accumulators of that shape (2
    at CP 2, else 4), the fp32 dq [b, a/t, s/c, d] and four fp32 row statistics [b, a/t, s/2c],
    and one pair's kernel outputs (dq, dk, dv; on CUDA in fp32, with g < a, four per-head [b,
    s/2c, a/t, d] copies too); none at CP 1. The total counts them once, on top of the rest; at
    twice the CP everything halves but the dK/dV accumulators from CP 2 to 4 (2 become 4)."""
    cfg = _at(LLAMA, LONG, cp, "training.micro_batch_size=2")
    m, tp, b = cfg.model, 2, 2
    s, g, a, d = m.seq_length // cp, m.query_groups // tp, m.num_attention_heads // tp, m.head_dim
    ring = ring_attention_bytes(m, b, tp, 2, cp)
    mem = estimate_memory(cfg, 128256, "gpt", 1)
    if cp == 1:
        assert (ring.total, mem.ring_attention) == (0, 0)
        return
    message = 2 * b * g * s * d
    assert ring.kv == 2 * message * 2 and ring.dkv == (2 if cp == 2 else 4) * message * 4
    assert ring.working == 4 * b * a * (s * d + 4 * (s // 2))
    assert ring.pair == 2 * b * (s // 2) * d * (a + 2 * g)
    fp32 = ring_attention_bytes(m, b, tp, 4, cp)
    assert fp32.pair == 4 * b * (s // 2) * d * (a + 2 * g + 4 * a)
    cpu = ring_attention_bytes(m, b, tp, 2, cp, device="cpu")
    assert cpu.pair == 2 * b * (s // 2) * d * (a + 2 * g)
    assert cpu.kernel == 2 * b * a * (s // 2) * d + CPU_KERNEL_TILES[2] and ring.kernel == 0
    assert mem.ring_attention == ring.kv + ring.dkv + ring.working + ring.pair
    for recompute in (False, True):
        rest = mem.states + mem.embedding_grad + mem.logits
        rest += mem.activations_recompute if recompute else mem.activations_no_recompute
        assert mem.total_with(recompute) == rest + mem.ring_attention
    twice = ring_attention_bytes(m, b, tp, 2, 2 * cp)
    assert (2 * twice.kv, 2 * twice.working, 2 * twice.pair) == (
        ring.kv, ring.working, ring.pair
    )  # fmt: skip
    assert 2 * twice.dkv == (2 * ring.dkv if cp == 2 else ring.dkv)


# GPT-2's shape (learned positions, LayerNorm, GeLU) and the Llama options with several query
# groups of several heads per rank.
RING_CASES = [
    {},
    {"position_embedding_type": "rope", "normalization": "rmsnorm", "activation": "swiglu",
     "num_attention_heads": 8, "num_query_groups": 2, "ffn_hidden_size": 96},
]  # fmt: skip


def _saved_per_layer(cases: list[dict], cp: int) -> list[int]:
    """One layer's saved bytes on this CP rank (fp32 on CPU): 2 layers' minus 1 layer's."""
    from megatron.models.gpt import GPTModel
    from megatron.parallel.context_parallel import held_positions, split_sequence
    from megatron.parallel.random import RNGTracker
    from megatron.parallel.state import initialize

    st = initialize(1, cp_size=cp)
    out = []
    for overrides in cases:
        saved = {}
        for layers in (1, 2):
            cfg = tiny_model_config(**{**overrides, "num_layers": layers, "seq_length": 32,
                                       "max_position_embeddings": 32})  # fmt: skip
            tracker = RNGTracker(st.device)
            tracker.seed(1, 0)
            model = GPTModel(cfg, 250, 256, st, tracker).train()
            tokens = torch.randint(
                0, 250, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0)
            )
            local = split_sequence(tokens, 1, st.cp_rank, cp)
            positions = held_positions(cfg.seq_length, st.cp_rank, cp)[None].expand(2, -1)
            saved[layers] = saved_bytes(model, local, positions, labels=local)
        out.append(saved[2] - saved[1])
    return out


@pytest.mark.slow
def test_layer_bytes_match_the_ring_at_cp2():
    """What autograd saves per layer on each CP rank is the estimate exactly (the CPU's
    composite RMSNorm's extra x * rstd aside, as in tests/test_llama_estimates.py)."""
    ranks = run_distributed(_saved_per_layer, 2, RING_CASES, 2)
    for i, overrides in enumerate(RING_CASES):
        cfg = tiny_model_config(**overrides, seq_length=32, max_position_embeddings=32)
        local = dataclasses.replace(cfg, seq_length=16)
        want = layer_activation_bytes(cfg, 2, 1, 4, context_parallel=2)
        want += _composite_rms_bytes(local)
        assert [r[i] for r in ranks] == [want, want], overrides


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the storages that ops inside the mode create and that are alive."""

    def __init__(self, outside: list[int]):
        super().__init__()
        self.outside, self.live, self.now, self.peak = set(outside), {}, 0, 0

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else [result]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self.outside or not storage.nbytes():
                continue
            if ptr not in self.live:
                self.live[ptr] = [storage.nbytes(), 0]
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self.live[ptr][1] += 1
            weakref.finalize(t, self._release, ptr)
        return result


def _ring_backward_peak(shape: tuple[int, int, int, int, int], dtype: torch.dtype, cp: int) -> int:
    """The peak bytes ring attention's backward allocates on this rank, q/k/v/dout aside."""
    import torch.distributed as dist

    from megatron.parallel.context_parallel import Ring, ring_attention
    from megatron.parallel.state import initialize

    b, h, g, s, d = shape
    st = initialize(1, cp_size=cp)
    assert st.cp_size == cp == len(st.cp_ranks)
    ring = Ring(st.cp_group, st.cp_ranks, st.cp_rank)
    gen = torch.Generator().manual_seed(st.cp_rank)
    q, k, v = (
        torch.randn(b, s, n, d, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()
        for n in (h, g, g)
    )  # the [b, s, heads, d] memory order of the model's q, k and v
    dout = torch.randn(b, h, s, d, generator=gen, dtype=dtype)
    out = ring_attention(q, k, v, ring, True, None)
    mode = _LiveBytes([t.untyped_storage().data_ptr() for t in (q, k, v, dout, out)])
    with mode:
        out.backward(dout)
    dist.barrier()
    return mode.peak


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ring_buffers_bound_the_rings_backward(cp, dtype):
    """The transient peak of the real ring's backward, on every rank, within 6% of the
    estimate's ring term on CPU's kernel (b=1, 8 heads in 2 groups, 512 local tokens)."""
    shape = (1, 8, 2, 512, 16)
    model = tiny_model_config(num_attention_heads=8, num_query_groups=2, hidden_size=128,
                              seq_length=512 * cp, max_position_embeddings=512 * cp)  # fmt: skip
    ring = ring_attention_bytes(model, 1, 1, 2 if dtype == torch.bfloat16 else 4, cp, "cpu")
    want = ring.total - ring.kernel  # the kernel's own workspace is no tensor: not seen here
    for peak in run_distributed(_ring_backward_peak, cp, shape, dtype, cp):
        assert abs(want - peak) <= 0.06 * peak, (want, peak)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_distributed_optimizer_shards_over_dp_times_cp(cp):
    """ceil(N / (dp * cp)) parameters' fp32 main copy and moments per rank: CP 2 x DP 2 holds
    what CP 1 x DP 4 does; without the distributed optimizer CP changes no state."""
    cfg = _at(LLAMA, LONG, cp)
    for dp in (1, 2, 4):
        mem = estimate_memory(cfg, 128256, "gpt", dp)
        owned = -(-mem.params.per_gpu // (dp * cp))
        assert (mem.main_params, mem.adam_moments) == (4 * owned, 8 * owned)
        same = estimate_memory(_at(LLAMA, LONG, 1), 128256, "gpt", dp * cp)
        assert (mem.main_params, mem.adam_moments) == (same.main_params, same.adam_moments)
    plain = _at(LLAMA, LONG, cp, "parallel.distributed_optimizer=false")
    mem = estimate_memory(plain, 128256, "gpt", 2)
    assert mem.states == 18 * mem.params.per_gpu


# Totals (bytes, every stage, as configured and the other recompute setting) of the estimate
# before context parallelism existed: CP 1 must give them still.
TODAY = [
    (LLAMA, [], 8, "gpt", 128256, [64913461248], [41265483776]),
    ("configs/llama3_70b.yaml", [], 64, "gpt", 128256,
     [74834116608, 61361848320, 49465589760, 40067665920],
     [29268910080, 27336384512, 26979868672, 29121687552]),
    ("configs/gpt_8.3b.yaml", ["parallel.distributed_optimizer=true",
                               "parallel.sequence_parallel=true"], 64, "gpt", 50257,
     [8377199104], [15079688704]),
    ("configs/bert_3.9b.yaml", [], 512, "bert", 30522, [21735935396], [18291215780]),
    ("configs/gpt_39b.yaml", [], 16, "gpt", 50257, [46790918144, 45729021952],
     [55435804672, 49942364160]),
]  # fmt: skip


@pytest.mark.parametrize("path, overrides, world, kind, vocab, configured, other", TODAY)
def test_cp1_gives_todays_figures(path, overrides, world, kind, vocab, configured, other):
    cfg = load_config([path], overrides)
    assert cfg.parallel.context_parallel_size == 1
    derived = cfg.derived(world)
    stages = estimate_stages(cfg, derived.padded_vocab_size(vocab), kind, derived.dp_size)
    assert [s.total for s in stages] == configured
    assert [s.total_with(not s.recompute) for s in stages] == other
    assert all(s.ring_attention == 0 for s in stages)


def _dry(*argv: str) -> tuple[int, str]:
    cfg, args = parse_args(["--dry-run", *argv])
    out = io.StringIO()
    return dry_run(cfg, args, out=out), out.getvalue()


def test_dry_run_layout_line():
    """CP stands between PP and TP, as in the rank grid [dp, pp, cp, tp]; CP 1 reads as
    before; without --world-size one replica is TP x CP x PP GPUs. FLOPs count each token
    once: the same in all at any CP."""
    rc, text = _dry("--config", LLAMA, "--world-size", "8", *LONG)
    assert rc == 0 and "dry run (gpt): world 8 = DP 4 x TP 2; 128 micro-batches" in text
    assert "CP" not in text.split("\n", 1)[0] and "ring attention" not in text
    total = flops_per_iteration(load_config([LLAMA], LONG).model, 128256, 512)
    flops = f"FLOPs per iteration: {total:.3e} in all"
    assert flops in text
    cp = "parallel.context_parallel_size=4"
    rc, text = _dry("--config", LLAMA, "--world-size", "8", *LONG, cp)
    assert rc == 0 and "world 8 = DP 1 x CP 4 x TP 2; 512 micro-batches of 1" in text
    assert "seq 32768 (8192 tokens on each of CP 4 ranks)" in text
    assert "fp32 main params (4 B/param / DPxCP 4)" in text and flops in text
    assert "ring attention buffers (one layer, transient)" in text
    rc, text = _dry("--config", LLAMA, *LONG, cp)
    assert "world 8 = DP 1 x CP 4 x TP 2" in text and "one replica of 8 GPU(s)" in text
    rc, text = _dry("--config", "configs/llama3_70b.yaml", "--world-size", "64",
                    "parallel.context_parallel_size=2")  # fmt: skip
    assert rc == 0 and "world 64 = DP 1 x PP 4 x CP 2 x TP 8;" in text


def _longest(text: str) -> int:
    line = re.search(r"longest model.seq_length that fits in 80 GB at this layout: ([\d,]+) ", text)
    assert line, text
    return int(line.group(1).replace(",", ""))


def test_dry_run_states_the_longest_seq_length_that_fits():
    """Llama 3 8B, TP 2 x CP 4 with SP and recomputation on 8 GPUs: the line's length (a
    multiple of 2 x CP and of CP x TP: 8) fits, 8 more does not; the dry run agrees at both."""
    layout = [LLAMA, "--world-size", "8", "--gpu-memory-gb", "80", *LONG,
              "parallel.context_parallel_size=4", "model.recompute=full"]  # fmt: skip
    rc, text = _dry("--config", *layout)
    longest = _longest(text)
    assert rc == 0 and "(a multiple of 2 x CP and CP x TP: 8; all else as configured;" in text
    cfg = load_config([LLAMA], layout[5:])
    assert seq_granularity(cfg) == 8 and longest % 8 == 0 and longest > 32768
    assert longest == longest_seq_length(cfg, 128256, "gpt", 1, 80)
    assert fits(worst_stage(with_seq_length(cfg, longest), 128256, "gpt", 1).total, 80)
    assert not fits(worst_stage(with_seq_length(cfg, longest + 8), 128256, "gpt", 1).total, 80)
    for seq, code in ((longest, 0), (longest + 8, 1)):
        lengths = [f"model.seq_length={seq}", f"model.max_position_embeddings={seq}"]
        rc, text = _dry("--config", *layout, *lengths)
        assert rc == code and _longest(text) == longest, (seq, text)


def test_dry_run_hints_a_larger_cp():
    """524288 tokens at TP 2 on 64 GPUs with every other switch on: CP 8 is the first size that
    fits (CP 2 and 4 do not; 3, 5, 6, 7 do not divide the world). With fused kernels in the
    ring (no score blocks) 131072 tokens fit at CP 2 already."""
    for seq, cp, dp in ((524288, 8, 4), (131072, 2, 16)):
        rc, text = _dry("--config", LLAMA, "--world-size", "64", "--gpu-memory-gb", "80",
                        f"model.seq_length={seq}", f"model.max_position_embeddings={seq}",
                        "model.recompute=full")  # fmt: skip
        assert rc == 1 and f"hint: parallel.context_parallel_size={cp} fits (DP {dp})" in text


def _entrypoint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--config", LLAMA, "--dry-run", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    "args, error",
    [
        (
            ["--world-size", "8", "parallel.context_parallel_size=4", "model.seq_length=8196"],
            "error: parallel.context_parallel_size=4 cuts model.seq_length=8196 into 2 x 4 = 8 "
            "equal chunks; use model.seq_length=8184 or 8192",
        ),
        (
            ["--world-size", "12", "parallel.context_parallel_size=4"],
            "error: parallel.tensor_parallel_size=2 x parallel.context_parallel_size=4 x "
            "parallel.pipeline_parallel_size=1 = 8 does not divide the world size 12; ",
        ),
    ],
)
def test_bad_layouts_are_one_line_and_exit_2(args, error):
    done = _entrypoint(*args)
    assert done.returncode == 2 and "config valid" not in done.stdout, done.stdout
    assert done.stderr.startswith(error) and done.stderr.count("\n") == 1, done.stderr


def test_attention_dropout_is_refused_with_cp():
    cfg = _at(LLAMA, [], 2, "model.attention_dropout=0.1")
    with pytest.raises(ConfigError, match="ring attention .* has no attention dropout"):
        dry_run(cfg, argparse.Namespace(world_size=8, gpu_memory_gb=None), out=io.StringIO())
