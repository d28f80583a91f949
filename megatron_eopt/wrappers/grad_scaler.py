"""Loss scaling for fp16 training: a constant scale, or a dynamic one that backs off on overflow.

Dynamic rule: after `hysteresis` steps with inf/NaN gradients (counted since the last growth),
multiply the scale by `backoff_factor` (never below `min_scale`); after `growth_interval`
consecutive clean steps, multiply it by `growth_factor`.
"""

from typing import Any, Optional

import torch


class ConstantGradScaler:
    """A loss scale that never changes."""

    def __init__(self, scale: float, device: Optional[torch.device] = None) -> None:
        if not scale > 0.0:
            raise ValueError(f"loss scale must be > 0; got {scale}.")
        self._scale = torch.tensor([float(scale)], dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.reciprocal()

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale.item()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale.fill_(float(state_dict["scale"]))


class DynamicGradScaler(ConstantGradScaler):
    """Grows the loss scale while gradients stay finite, backs off when they overflow."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__(initial_scale, device)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(
                f"need 0 < min_scale <= initial_scale; got min_scale={min_scale}, "
                f"initial_scale={initial_scale}."
            )
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1; got {growth_factor}.")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1); got {backoff_factor}.")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"growth_interval and hysteresis must be >= 1; got {growth_interval}, {hysteresis}."
            )
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                # On the device (no read-back); in float64 as the Python arithmetic it replaces.
                backed_off = (self._scale.double() * self.backoff_factor).clamp_(min=self.min_scale)
                self._scale.copy_(backed_off)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale.mul_(self.growth_factor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale.item(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def make_grad_scaler(config: Any, device: Optional[torch.device] = None) -> Optional[ConstantGradScaler]:
    """The scaler megatron-core's config asks for: only fp16 scales the loss."""
    if not config.fp16:
        return None
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale, device)
    return DynamicGradScaler(
        initial_scale=config.initial_loss_scale,
        min_scale=config.min_loss_scale,
        growth_interval=int(config.loss_scale_window),
        hysteresis=config.hysteresis,
        device=device,
    )
