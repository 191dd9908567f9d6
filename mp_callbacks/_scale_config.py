"""`ScaleConfig`: what every backend's `LossScaler` shares, apart from where
its state lives: the settings as attributes, fixed and no scaling, config
and repr."""

from __future__ import annotations

from typing import Any

from mp_callbacks._scale_state import ScaleSettings

__all__ = ["ScaleConfig"]


class ScaleConfig:
    """The settings side of a `LossScaler` (a mixin: the backend's class
    holds the state)."""

    name: str
    _settings: ScaleSettings

    def _take_settings(self, settings: ScaleSettings) -> None:
        self._settings = settings
        self.initial_scale = settings.initial_scale
        self.growth_interval = settings.growth_interval
        self.growth_factor = settings.growth_factor
        self.backoff_factor = settings.backoff_factor
        self.min_scale = settings.min_scale
        self.max_scale = settings.max_scale
        self.hysteresis = settings.hysteresis

    @classmethod
    def fixed(cls, scale: float, name: str = "fixed_loss_scale") -> Any:
        """A constant loss scale (still skips non-finite steps)."""
        return cls(initial_scale=scale, min_scale=scale, max_scale=scale, name=name)  # type: ignore[call-arg]

    @classmethod
    def disabled(cls, name: str = "no_loss_scale") -> Any:
        """No loss scaling: scale 1.0, non-finite steps still skipped."""
        return cls.fixed(1.0, name=name)

    @property
    def settings(self) -> ScaleSettings:
        """The checked settings the state machine runs with."""
        return self._settings

    @property
    def is_dynamic(self) -> bool:
        """True when the scale can change (`min_scale < max_scale`)."""
        return self.min_scale < self.max_scale

    @property
    def scaling_active(self) -> bool:
        """False when the scale is fixed at 1.0 (multiplying is skipped)."""
        return self.is_dynamic or self.initial_scale != 1.0

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_scale": self.initial_scale,
            "growth_interval": self.growth_interval,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "hysteresis": self.hysteresis,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Any:
        return cls(**config)

    def __repr__(self) -> str:
        if not self.is_dynamic:
            return f"LossScaler.fixed({self.initial_scale!r})"
        return (
            f"LossScaler(initial_scale={self.initial_scale!r}, "
            f"growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis})"
        )
