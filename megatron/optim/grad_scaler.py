"""Loss scaling: a constant scale (1 for bf16/fp32), or Megatron's dynamic scaler for fp16.

The dynamic rule: every overflow resets the clean-step count and spends one unit of hysteresis;
once hysteresis is spent, each overflow halves the scale (never below the minimum). After
``growth_interval`` clean steps in a row the scale doubles and hysteresis is refilled. The scale
is a Python float: a power of two times the initial value, exact in fp32 for the usual settings.
"""

from __future__ import annotations

from typing import Any

from megatron.config.schema import PrecisionConfig


class ConstantGradScaler:
    """A loss scale that never changes: 1 for bf16/fp32, ``precision.loss_scale`` for fp16."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        if not scale > 0:
            raise ValueError(f"loss scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """Nothing to adapt; the caller still skips the step when ``found_inf``."""

    def state_dict(self) -> dict[str, Any]:
        """The scale, for the record (the config decides it on load)."""
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A constant scale comes from the config, not the checkpoint."""


class DynamicGradScaler:
    """fp16 loss scale that halves on overflow (after ``hysteresis`` of them) and doubles after
    ``growth_interval`` clean steps."""

    dynamic = True

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"need 0 < min_scale={min_scale} <= initial_scale={initial_scale}")
        if min(growth_interval, hysteresis) < 1 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError("need growth_interval, hysteresis >= 1, growth > 1, 0 < backoff < 1")
        self.scale, self.min_scale = float(initial_scale), float(min_scale)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker = 0  # clean steps since the last overflow or growth
        self.hysteresis_tracker = hysteresis  # overflows left before the scale starts halving

    def update(self, found_inf: bool) -> None:
        """Adapt the scale after a step; ``found_inf`` must already agree across ranks."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """Scale and both trackers, as plain numbers."""
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly where the saved run was (scale and trackers)."""
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


GradScaler = ConstantGradScaler | DynamicGradScaler


def build_grad_scaler(cfg: PrecisionConfig) -> GradScaler:
    """Dynamic for fp16 unless ``loss_scale`` fixes it; a constant 1 for bf16 and fp32."""
    if cfg.dtype != "fp16":
        return ConstantGradScaler(1.0)
    if cfg.loss_scale is not None:
        return ConstantGradScaler(cfg.loss_scale)
    return DynamicGradScaler(
        initial_scale=cfg.initial_loss_scale,
        min_scale=cfg.min_loss_scale,
        growth_interval=cfg.loss_scale_window,
        hysteresis=cfg.hysteresis,
    )
