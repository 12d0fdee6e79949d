"""Loss scalers: Megatron's dynamic rule step by step, its state dict, and which scaler each
precision gets."""

from __future__ import annotations

from megatron.config.schema import PrecisionConfig
from megatron.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler


def run(scaler: DynamicGradScaler, overflows: str) -> list[float]:
    """Feed a pattern ('x' overflow, '.' clean step); the scale after each step."""
    scales = []
    for c in overflows:
        scaler.update(found_inf=c == "x")
        scales.append(scaler.scale)
    return scales


def test_defaults_match_the_issue():
    s = build_grad_scaler(PrecisionConfig(dtype="fp16"))
    assert isinstance(s, DynamicGradScaler)
    assert (s.scale, s.growth_interval, s.hysteresis, s.min_scale) == (2.0**32, 1000, 2, 1.0)


def test_hysteresis_then_halving():
    s = DynamicGradScaler(initial_scale=1024.0, growth_interval=4, hysteresis=2)
    # First overflow spends hysteresis; the second halves; while hysteresis stays spent, every
    # further overflow halves too (Megatron refills it only when the scale grows).
    assert run(s, "xxx") == [1024.0, 512.0, 256.0]
    assert run(s, "..x") == [256.0, 256.0, 128.0]


def test_growth_after_window_refills_hysteresis():
    s = DynamicGradScaler(initial_scale=8.0, growth_interval=3, hysteresis=2)
    assert run(s, "...") == [8.0, 8.0, 16.0]
    assert run(s, "x") == [16.0]  # hysteresis refilled by the growth: no halving yet
    assert run(s, "..x") == [16.0, 16.0, 8.0]  # an overflow resets the clean-step count
    assert run(s, "...") == [8.0, 8.0, 16.0]


def test_minimum_scale():
    s = DynamicGradScaler(initial_scale=4.0, min_scale=2.0, growth_interval=10, hysteresis=1)
    assert run(s, "xxx") == [2.0, 2.0, 2.0]


def test_state_dict_resumes_exactly():
    pattern = "..x.x..x....xx...x......"
    whole = DynamicGradScaler(initial_scale=2.0**16, growth_interval=3, hysteresis=2)
    first = DynamicGradScaler(initial_scale=2.0**16, growth_interval=3, hysteresis=2)
    expected = run(whole, pattern)
    head = run(first, pattern[:11])
    state = first.state_dict()
    assert all(isinstance(v, int | float) for v in state.values())
    resumed = DynamicGradScaler(initial_scale=2.0**16, growth_interval=3, hysteresis=2)
    resumed.load_state_dict(state)
    assert head + run(resumed, pattern[11:]) == expected


def test_constant_scalers():
    for dtype in ("bf16", "fp32"):
        s = build_grad_scaler(PrecisionConfig(dtype=dtype))
        assert isinstance(s, ConstantGradScaler) and s.scale == 1.0 and not s.dynamic
    fixed = build_grad_scaler(PrecisionConfig(dtype="fp16", loss_scale=128.0))
    fixed.update(found_inf=True)
    assert isinstance(fixed, ConstantGradScaler) and fixed.scale == 128.0
    custom = build_grad_scaler(
        PrecisionConfig(
            dtype="fp16",
            initial_loss_scale=64.0,
            loss_scale_window=5,
            hysteresis=3,
            min_loss_scale=4.0,
        )
    )
    assert (custom.scale, custom.growth_interval, custom.hysteresis, custom.min_scale) == (
        64.0,
        5,
        3,
        4.0,
    )
