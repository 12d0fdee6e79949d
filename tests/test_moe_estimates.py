"""Mixture of experts in the estimates: the shipped configs' parameter counts against the
published ones, the counts and one MoE layer's saved bytes against the model, the memory of a
config whose layers mix dense and MoE MLPs, and the dry run's report.

Published totals (the safetensors of each Hugging Face model) and what the shapes give:

- Mixtral-8x7B-v0.1: 46,702,792,704 total, as published. Active per token 12,879,925,248:
  the often-quoted 12,879,138,816 counts only k = 2 of each layer's 8 router rows (786,432 =
  32 layers x 6 rows x 4096 fewer); every token's router scores all 8 experts, so ours counts
  the whole router.
- Qwen3-30B-A3B: 30,532,122,624 total, as published; active 3,353,032,704 ("3.3B").
- Qwen2-57B-A14B: the shapes of its config.json give 57,408,658,944, not the 57,409,215,488
  sometimes quoted (556,544 more, which no combination of its shapes gives); active
  14,249,270,784 ("14.2B"). The shapes are trusted.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from megatron.config.load import load_config, parse_args
from megatron.config.schema import padded_vocab_size
from megatron.estimate.activations import layer_activation_bytes
from megatron.estimate.memory import estimate_memory
from megatron.estimate.parameters import count_parameters
from megatron.launch.dry_run import dry_run
from megatron.models.gpt import GPTModel
from megatron.parallel.random import RNGTracker
from tests.distributed import run_distributed
from tests.model_config import tiny_model_config
from tests.test_document_mask import packed_batch
from tests.test_estimate import saved_bytes
from tests.test_llama_model import CPU, LLAMA, VOCAB

PUBLISHED = {
    # config: (total, active, vocabulary)
    "mixtral_8x7b": (46_702_792_704, 12_879_925_248, 32000),
    "qwen3_30b_a3b": (30_532_122_624, 3_353_032_704, 151936),
    "qwen2_57b_a14b": (57_408_658_944, 14_249_270_784, 151936),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shipped_configs_have_the_published_parameters(name):
    """At the config's own TP size no embedding row is padded, so the counts are the model's."""
    total, active, vocab = PUBLISHED[name]
    cfg = load_config([f"configs/{name}.yaml"])
    tp = cfg.parallel.tensor_parallel_size
    padded = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, tp)
    assert padded == vocab == cfg.tokenizer.vocab_size
    params = count_parameters(cfg.model, padded, tp)
    assert (params.total, params.active) == (total, active)


def test_mixtral_active_parameters_by_hand():
    """Per layer: attention 2*4096*4096 + 2*1024*4096, two RMSNorms 2*4096, the router 8*4096,
    two of the eight experts 2*3*14336*4096; embedding and output 2*32000*4096, final norm."""
    layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 2 * 4096 + 8 * 4096 + 2 * 3 * 14336 * 4096
    assert 32 * layer + 2 * 32000 * 4096 + 4096 == PUBLISHED["mixtral_8x7b"][1]


MOE = dict(
    LLAMA,
    num_layers=2,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
    moe_shared_expert_intermediate_size=64,
    moe_shared_expert_gate=True,
    moe_layer_freq=[0, 1],
)
DENSE = dict(
    MOE,
    num_experts=None,
    moe_ffn_hidden_size=None,
    moe_shared_expert_intermediate_size=None,
    moe_shared_expert_gate=False,
    moe_layer_freq=1,
)
MOE_CASES = {
    "shared_gated": MOE,
    "shared": {**MOE, "moe_shared_expert_gate": False},
    "routed_only": {**MOE, "moe_shared_expert_gate": False,
                    "moe_shared_expert_intermediate_size": None},
    "pre_softmax": {**MOE, "moe_router_pre_softmax": True},
    "sigmoid_top1": {**MOE, "moe_router_score_function": "sigmoid", "moe_router_topk": 1},
    "sigmoid_aux": {**MOE, "moe_router_score_function": "sigmoid", "moe_aux_loss_coeff": 0.01},
    "seq_aux_z": {**MOE, "moe_router_load_balancing_type": "seq_aux_loss",
                  "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001},
}  # fmt: skip


def _measure(overrides: dict, state=CPU, sequence_parallel=False) -> tuple[int, int]:
    """(parameters, bytes autograd saves) of a 2-layer GPT on this rank of ``state``."""
    cfg = tiny_model_config(**overrides)
    tracker = RNGTracker(state.device)
    tracker.seed(1, state.tp_rank)
    model = GPTModel(cfg, VOCAB, 256, state, tracker, sequence_parallel=sequence_parallel)
    model.train()
    generator = torch.Generator().manual_seed(state.dp_rank)  # each DP rank its own tokens
    tokens = torch.randint(0, VOCAB, (2, cfg.seq_length), generator=generator)
    saved = saved_bytes(model, tokens, packed_batch(n=2)[2], labels=tokens)
    return sum(p.numel() for p in model.parameters()), saved


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_counts_and_moe_layer_bytes_match_the_model(case):
    """Parameters exactly; the MoE layer's saved bytes exactly, as the difference from the same
    model with layer 1 dense (what the two layers share, e.g. the composite CPU RMSNorm's extra
    copy, cancels). fp32, micro-batch 2, dropless."""
    overrides = MOE_CASES[case]
    moe_params, moe_saved = _measure(overrides)
    _, dense_saved = _measure(DENSE)
    cfg, dense = tiny_model_config(**overrides), tiny_model_config(**DENSE)
    params = count_parameters(cfg, 256, 1)
    assert moe_params == params.total
    routed_off = cfg.num_experts - cfg.moe_router_topk  # experts a token skips, 3*48*h each
    assert params.total - params.active == routed_off * 3 * 48 * cfg.hidden_size
    moe_layer = layer_activation_bytes(cfg, 2, 1, 4, moe=True)
    assert moe_saved - dense_saved == moe_layer - layer_activation_bytes(dense, 2, 1, 4)


def _measure_tp2() -> dict[tuple[str, bool], tuple[int, int]]:
    """Per MoE case and with and without sequence parallelism, on this rank of TP 2: the saved
    bytes of the 2-layer GPT with and without its MoE layer."""
    from megatron.parallel.state import initialize

    state = initialize(2)
    return {
        (case, sp): (_measure(MOE_CASES[case], state, sp)[1], _measure(DENSE, state, sp)[1])
        for case in MOE_CASES
        for sp in (False, True)
    }


@pytest.mark.slow
def test_moe_layer_bytes_match_the_model_at_tp2():
    """Each TP rank's MoE layer bytes exactly, with and without sequence parallelism (which
    splits the routing over the ranks and gathers the choices)."""
    for measured in run_distributed(_measure_tp2, 2):
        for (case, sp), (moe, dense) in measured.items():
            cfg, dense_cfg = tiny_model_config(**MOE_CASES[case]), tiny_model_config(**DENSE)
            moe_layer = layer_activation_bytes(cfg, 2, 2, 4, sequence_parallel=sp, moe=True)
            dense_layer = layer_activation_bytes(dense_cfg, 2, 2, 4, sequence_parallel=sp)
            assert moe - dense == moe_layer - dense_layer, (case, sp)


def test_memory_follows_which_layers_are_moe():
    """Weights, gradients and optimizer state follow the parameters; activations are the dense
    layers' plus the MoE layers' (every other layer here); the dispatch buffers count once."""
    base = load_config(
        ["configs/moe_tiny.yaml"], ["model.moe_layer_freq=2", "model.recompute=none"]
    )
    cfg = dataclasses.replace(
        base, parallel=dataclasses.replace(base.parallel, tensor_parallel_size=1)
    )
    m, b = cfg.model, cfg.training.micro_batch_size
    mem = estimate_memory(cfg, 32000)
    params = count_parameters(m, 32000, 1)
    assert mem.weights == 4 * params.total and mem.params == params
    dense_cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, num_experts=None))
    dense = estimate_memory(dense_cfg, 32000)
    per_layer = layer_activation_bytes(m, b, 1, 4, moe=True) - layer_activation_bytes(m, b, 1, 4)
    assert mem.activations_no_recompute - dense.activations_no_recompute == 2 * per_layer
    assert mem.moe_dispatch == 2 * b * m.seq_length * 2 * m.hidden_size * 4
    assert mem.total - mem.moe_dispatch - mem.states == (
        mem.activations_no_recompute + mem.logits + mem.embedding_grad
    )
    biased = dataclasses.replace(
        cfg, model=dataclasses.replace(m, moe_router_enable_expert_bias=True)
    )
    assert estimate_memory(biased, 32000).expert_bias == 2 * 4 * m.num_experts
    # one full-recomputation working set: the largest layer, an MoE one here
    full = dataclasses.replace(cfg, model=dataclasses.replace(m, recompute="full"))
    mem_full = estimate_memory(full, 32000)
    assert mem_full.activations_recompute >= layer_activation_bytes(m, b, 1, 4, moe=True)


def test_dry_run_reports_total_and_active_parameters():
    argv = ["--config", "configs/qwen3_30b_a3b.yaml", "--dry-run", "--world-size", "32",
            "--gpu-memory-gb", "80"]  # fmt: skip
    cfg, args = parse_args(argv)
    out = io.StringIO()
    assert dry_run(cfg, args, out=out) == 0
    text = out.getvalue()
    assert "3,353,032,704 parameters active per token of 30,532,122,624" in text
    assert "parameters: 30,532,122,624 total" in text and "MoE dispatch buffers" in text


# moe_tiny at TP 1 with its experts split over 2 EP ranks, optimizer state sharded (fp32)
EP2 = ["parallel.tensor_parallel_size=1", "parallel.expert_parallel_size=2",
       "parallel.distributed_optimizer=true", "checkpoint.save=null"]  # fmt: skip


def _measure_ep2() -> tuple[int, int, int, dict[str, tuple[int, int]]]:
    """On this rank of an EP 2 world (DP 2, TP 1): moe_tiny's parameters, routed-expert
    parameters and distributed optimizer state bytes, and per MoE case the saved bytes of the
    2-layer GPT with and without its MoE layer."""
    from megatron.optim.build import build_optimizer
    from megatron.parallel.data_parallel import DataParallel
    from megatron.parallel.experts import is_expert
    from megatron.parallel.state import initialize

    state = initialize(1, ep_size=2)
    cfg = load_config(["configs/moe_tiny.yaml"], EP2)
    tracker = RNGTracker(state.device)
    tracker.seed(1, 0)
    model = GPTModel(cfg.model, 32000, 32000, state, tracker)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for p in model.parameters() if is_expert(p))
    ddp = DataParallel(model, state, cfg.parallel.ddp_bucket_size_mb, shard_optimizer=True)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.precision, state, ddp)
    saved = {case: (_measure(MOE_CASES[case], state)[1], _measure(DENSE, state)[1])
             for case in MOE_CASES}  # fmt: skip
    return params, experts, optimizer.state_bytes(), saved


@pytest.mark.slow
def test_expert_parallel_counts_and_moe_layer_bytes_match_the_model():
    """At EP 2 (two gloo ranks, DP 2, TP 1): each rank's parameters and routed-expert parameters
    exactly; an MoE layer's saved bytes exactly, summed over the EP group (the estimate assumes
    balanced routing, T*k rows received per rank; every expert-side term is linear in the rows
    received, which over the group sum to 2*T*k whatever the balance). fp32, dropless."""
    results = run_distributed(_measure_ep2, 2)
    tiny = load_config(["configs/moe_tiny.yaml"], EP2)
    count = count_parameters(tiny.model, 32000, 1, ep_size=2)
    mem = estimate_memory(tiny, 32000, "gpt", dp_size=2)
    assert mem.params == count and mem.main_params == 0  # fp32: the parameters are the main copy
    for params, experts, state_bytes, _ in results:
        assert (params, experts) == (count.per_gpu, count.experts_per_gpu)
        # the dense parameters' moments halved over DP 2, the experts' whole (EDP 1); the
        # buckets' padding to a multiple of DP adds under 2 elements each
        assert 0 <= state_bytes - mem.adam_moments < 8 * 2 * 4
    assert count.experts_per_gpu * 2 == count.experts  # half of the 8 experts on each rank
    for case, overrides in MOE_CASES.items():
        cfg, dense = tiny_model_config(**overrides), tiny_model_config(**DENSE)
        measured = sum(moe - dense for *_, saved in results for moe, dense in [saved[case]])
        moe_layer = layer_activation_bytes(cfg, 2, 1, 4, moe=True, expert_parallel=2)
        assert measured == 2 * (moe_layer - layer_activation_bytes(dense, 2, 1, 4)), case


def test_dry_run_reports_expert_parallelism():
    """Qwen3-30B-A3B on 64 GPUs at EP 8: the layout line names EP, the first stage's 12 layers
    hold 16 of the 128 experts each (12 x 16 x 3 x 768 x 2048 / TP 2), whose optimizer state
    no other rank shares (EDP 1)."""
    argv = ["--config", "configs/qwen3_30b_a3b.yaml", "--dry-run", "--world-size", "64",
            "--gpu-memory-gb", "80", "parallel.expert_parallel_size=8",
            "checkpoint.save=null"]  # fmt: skip
    cfg, args = parse_args(argv)
    out = io.StringIO()
    assert dry_run(cfg, args, out=out) == 0
    text = out.getvalue()
    assert "world 64 = DP 8 x PP 4 x TP 2 (EP 8 over DP x CP)" in text
    experts = 12 * 16 * 3 * 768 * 2048 // 2
    assert f"at EP 8: {experts:,} parameters (16 of 128 experts per MoE layer" in text
    assert "8 B/param / DP 8 | EDP 1" in text
