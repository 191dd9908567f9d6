"""What the three callbacks share: reading the loss scale from any model,
and deep copies that do not drag a model along (keras-tuner deep-copies the
callbacks of every trial)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from mp_callbacks._backend import keras


class ConfigCopyMixin:
    """`copy.deepcopy` rebuilds the callback from its config.

    A callback that has been attached to a model holds it; copying that
    would copy (or, for Keras objects, re-save) the whole model. A copy made
    from the config is what keras-tuner wants for a new trial: same
    settings, fresh state.
    """

    def __deepcopy__(self, memo: dict) -> Any:
        clone = type(self).from_config(copy.deepcopy(self.get_config(), memo))
        memo[id(self)] = clone
        return clone

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Any:
        return cls(**config)


@dataclass
class LossScaleSource:
    """Where a model's loss scale lives: "mp" (MixedPrecisionModel),
    "keras" (Keras's LossScaleOptimizer) or "none"."""

    kind: str
    model: Any = None
    optimizer: Any = None

    @classmethod
    def of(cls, model: Any) -> "LossScaleSource":
        from mp_callbacks.model import MixedPrecisionModel

        if isinstance(model, MixedPrecisionModel) and model.loss_scale is not None:
            if model.loss_scale.scaling_active:
                return cls("mp", model=model)
            return cls("none", model=model)
        optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return cls("keras", optimizer=optimizer)
        return cls("none")

    @property
    def active(self) -> bool:
        return self.kind != "none"

    @property
    def dynamic(self) -> bool:
        """True when the scale can move (so it can collapse)."""
        if self.kind == "mp":
            return self.model.loss_scale.is_dynamic
        return self.kind == "keras"

    @property
    def min_scale(self) -> float:
        if self.kind == "mp":
            return self.model.loss_scale.min_scale
        return 1.0  # Keras's LossScaleOptimizer has no floor; below 1 is collapse

    def read_scale(self) -> float:
        """One host read of the current scale (1.0 when not scaling)."""
        if self.kind == "mp":
            return self.model.loss_scale.get_scale()
        if self.kind == "keras":
            if not self.optimizer.built:
                return float(self.optimizer.initial_scale)
            return float(keras.ops.convert_to_numpy(self.optimizer.dynamic_scale))
        return 1.0
