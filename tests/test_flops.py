"""The FLOPs count reduces to Megatron's closed form when ffn = 4h."""

import pytest

from megatron.estimate.flops import flops_per_iteration


@pytest.mark.parametrize("recompute", [False, True])
def test_matches_megatron_closed_form(recompute):
    b, s, layers, h, v = 512, 1024, 72, 3072, 51200
    got = flops_per_iteration(
        num_layers=layers,
        hidden_size=h,
        ffn_hidden_size=4 * h,
        seq_length=s,
        padded_vocab_size=v,
        global_batch_size=b,
        recompute=recompute,
    )
    if recompute:
        want = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    else:
        want = 72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))
    assert got == pytest.approx(want, rel=1e-12)
