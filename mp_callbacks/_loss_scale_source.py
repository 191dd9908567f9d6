"""The one answer to "which loss scale does this model use?".

The callbacks and `check_model` all ask it; keeping the answer here (by
duck typing, not by importing the model class) keeps `model.py` and its
users free of import cycles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mp_callbacks._backend import BACKEND, keras

_Scale: type
if BACKEND == "tensorflow":
    from mp_callbacks.loss_scale import LossScaler

    _Scale = LossScaler
else:  # a JAX or torch MixedPrecisionModel's scale, read between epochs
    from mp_callbacks.backends.common.loss_scaler import LossScaler as VariableLossScaler

    _Scale = VariableLossScaler

__all__ = ["LossScaleSource", "find_scaler", "read_variable"]


def read_variable(variable: Any) -> Any:
    """A Keras or TensorFlow variable's value as NumPy, without going
    through `__array__` (which NumPy 2 warns about for variables)."""
    value = getattr(variable, "value", variable)
    return value.numpy() if hasattr(value, "numpy") else variable.numpy()


def _held_scale(value: Any) -> Any:
    if isinstance(value, _Scale):
        return value
    held = getattr(value, "scaler", None)  # mp_callbacks.LossScaleOptimizer
    return held if isinstance(held, _Scale) else None


def find_scaler(model: Any) -> Any:
    """The `LossScaler` (on JAX too) a model trains with,
    wherever it is kept: `model.scaler` (a `MixedPrecisionModel`'s), the model's
    `mp_callbacks.LossScaleOptimizer`, or any attribute of the model that
    holds one (a hand-written `train_step`'s `self.scaler`, or an
    optimizer attribute such as `self.d_optimizer`), in name order."""
    for candidate in (
        getattr(model, "scaler", None),
        getattr(model, "loss_scale", None),
        getattr(model, "optimizer", None),
    ):
        found = _held_scale(candidate)
        if found is not None:
            return found
    for name in sorted(vars(model)):
        if name.startswith("__"):
            continue
        found = _held_scale(vars(model)[name])
        if found is not None:
            return found
    return None


@dataclass
class LossScaleSource:
    """Where a model's loss scale lives.

    Attributes:
        kind: `"mp"` (a `LossScaler` that scales the loss: see
            `find_scaler`), `"keras"` (Keras's own `LossScaleOptimizer`)
            or `"none"`.
        scaler: the `LossScaler` driving the steps, also when it
            does not scale (it still counts and skips non-finite steps),
            for example a `train_step` of your own that never scales its
            loss.
        optimizer: Keras's `LossScaleOptimizer` for kind `"keras"`.
    """

    kind: str
    scaler: Any = None  # a LossScaler, or None
    optimizer: Any = None

    @classmethod
    def of(cls, model: Any) -> LossScaleSource:
        scaler = find_scaler(model)
        if scaler is not None:
            return cls("mp" if scaler.scales_losses else "none", scaler=scaler)
        optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return cls("keras", optimizer=optimizer)
        return cls("none")

    @property
    def active(self) -> bool:
        """True when the loss is multiplied by a scale."""
        return self.kind != "none"

    @property
    def dynamic(self) -> bool:
        """True when the scale can move (so it can collapse)."""
        if self.kind == "mp":
            return self.scaler.is_dynamic
        return self.kind == "keras"

    @property
    def min_scale(self) -> float:
        if self.kind == "mp":
            return self.scaler.min_scale
        return 1.0  # Keras's LossScaleOptimizer has no floor; below 1 is collapse

    def read_scale(self) -> float:
        """One host read of the current scale (1.0 when not scaling)."""
        if self.kind == "mp":
            return self.scaler.get_scale()
        if self.kind == "keras":
            if not self.optimizer.built:
                return float(self.optimizer.initial_scale)
            return float(read_variable(self.optimizer.dynamic_scale))
        return 1.0

    def read_lowest_scale(self) -> float:
        """The lowest scale since the last call (restarting the latch), so
        that a collapse between two reads is not missed; for Keras's
        optimizer, which keeps no such latch, the current scale."""
        if self.kind == "mp":
            state = self.scaler.diagnostics()
            lowest = (
                state["scale"]
                if state["lowest_scale"] is None
                else min(state["lowest_scale"], state["scale"])
            )
            self.scaler.reset_lowest_scale()
            return lowest
        return self.read_scale()
