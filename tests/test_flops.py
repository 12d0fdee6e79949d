"""The FLOPs count reduces to Megatron's closed form when ffn = 4h."""

import pytest

from megatron.config.model import ModelConfig
from megatron.estimate.flops import flops_per_iteration


@pytest.mark.parametrize("recompute", [False, True])
def test_matches_megatron_closed_form(recompute):
    b, s, layers, h, v = 512, 1024, 72, 3072, 51200
    model = ModelConfig(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=24,
        seq_length=s,
        ffn_hidden_size=4 * h,
        recompute="full" if recompute else "none",
    )
    got = flops_per_iteration(model, v, b)
    if recompute:
        want = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    else:
        want = 72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))
    assert got == pytest.approx(want, rel=1e-12)


def _tiny_moe(**overrides) -> ModelConfig:
    """4 layers, h 64, 4 heads of 16 in 2 groups, s 32, SwiGLU: a dense first layer of width 256,
    then 3 MoE layers of 8 experts of width 32, top 2, a gated shared expert of width 64."""
    shape = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=32,
        max_position_embeddings=32,
        ffn_hidden_size=256,
        activation="swiglu",
        add_bias_linear=False,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=64,
        moe_shared_expert_gate=True,
        moe_layer_freq=[0, 1, 1, 1],
    )
    return ModelConfig(**{**shape, **overrides})


@pytest.mark.parametrize("recompute, want", [("none", 98_181_120), ("full", 122_519_552)])
def test_moe_counts_the_active_parameters(recompute, want):
    """By hand, per token forward: attention 2*64*((4 + 2*2)*16 + 4*16) + 4*32*4*16 = 32,768 in
    each of the 4 layers; the dense MLP 2*64*3*256 = 98,304 in layer 0; each MoE layer the
    router 2*64*8 = 1,024, two experts 2*(2*64*3*32) = 24,576, the shared expert 2*64*3*64 =
    24,576 and its gate 2*64 = 128: 50,304. Layers 131,072 + 98,304 + 3*50,304 = 380,288, run 3
    times (4 with recomputation), the LM head 3*2*64*1024 = 393,216: 1,534,080 (1,914,368) per
    token, times 32 tokens x 2 sequences."""
    assert flops_per_iteration(_tiny_moe(recompute=recompute), 1024, 2) == want


def test_moe_layer_freq_picks_the_layers():
    """Every second layer MoE (0 and 2) differs from [0, 1, 1, 1] by one layer's MLP: two
    MoE layers and two dense ones against three and one."""
    every_other = flops_per_iteration(_tiny_moe(moe_layer_freq=2), 1024, 2)
    pattern = flops_per_iteration(_tiny_moe(), 1024, 2)
    assert pattern - every_other == 3 * (50_304 - 98_304) * 32 * 2
    dense = flops_per_iteration(_tiny_moe(num_experts=None, moe_layer_freq=1), 1024, 2)
    assert dense - pattern == 3 * 3 * (98_304 - 50_304) * 32 * 2
