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
