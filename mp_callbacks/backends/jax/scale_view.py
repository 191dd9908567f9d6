"""`ScaleView`: what the callbacks ask a loss scale, for a JAX model's.

On TensorFlow the callbacks ask the `LossScaler`. On JAX the scale's state
is variables of the model that travel through the stateless step; between
epochs (when Keras has put the state back into the variables) this view
reads them, with one host read per call, and resets the lowest-scale
latch. During an epoch the variables hold no value: the callbacks read the
step's logs instead.
"""

from __future__ import annotations

from typing import Any

from mp_callbacks import _scale_state
from mp_callbacks._backend import keras

__all__ = ["ScaleView"]


class ScaleView:
    """The loss scale of a JAX `MixedPrecisionModel`, as the callbacks see
    a `LossScaler`: its settings, `get_scale()`, `diagnostics()` and the
    lowest-scale latch."""

    def __init__(self, settings: _scale_state.ScaleSettings, variables: dict[str, Any]) -> None:
        self._settings = settings
        self._variables = variables
        self.initial_scale = settings.initial_scale
        self.growth_interval = settings.growth_interval
        self.min_scale = settings.min_scale
        self.max_scale = settings.max_scale
        self.hysteresis = settings.hysteresis

    @property
    def is_dynamic(self) -> bool:
        """True when the scale can change (`min_scale < max_scale`)."""
        return self._settings.is_dynamic

    @property
    def scaling_active(self) -> bool:
        """False when the scale is fixed at 1.0 (nothing is multiplied)."""
        return self.is_dynamic or self.initial_scale != 1.0

    @property
    def scales_losses(self) -> bool:
        """Whether the model's step multiplies the loss by the scale."""
        return self.scaling_active

    def get_scale(self) -> float:
        """The current loss scale (one host read)."""
        return float(keras.ops.convert_to_numpy(self._variables["scale"].value))

    def diagnostics(self) -> dict[str, Any]:
        """The state machine's variables as Python numbers (one host read
        each), keyed as `LossScaler.diagnostics()`."""
        values = {}
        for spec in _scale_state.STATE_VARIABLES:
            value = keras.ops.convert_to_numpy(self._variables[spec.name].value)
            values[spec.name] = int(value) if spec.name in _scale_state.COUNTERS else float(value)
        return values

    def get_state(self) -> dict[str, Any]:
        """The state as NumPy values, keyed as `LossScaler.get_state()`."""
        return {
            spec.name: keras.ops.convert_to_numpy(self._variables[spec.name].value)
            for spec in _scale_state.STATE_VARIABLES
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores `get_state()`'s values, all checked before any is set."""
        for variable, value in _scale_state.validated_updates(self._variables, state):
            variable.assign(value)

    def reset_lowest_scale(self) -> None:
        """Restarts the lowest-scale latch from the current scale (a copy:
        two variables holding one JAX buffer would be donated twice)."""
        self._variables["lowest_scale"].assign(keras.ops.copy(self._variables["scale"].value))

    def __repr__(self) -> str:
        if not self.is_dynamic:
            return f"ScaleView(fixed={self.initial_scale!r})"
        return f"ScaleView(initial_scale={self.initial_scale!r}, growth_interval={self.growth_interval})"
