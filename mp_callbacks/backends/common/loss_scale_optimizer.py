"""`LossScaleOptimizer` on Keras's JAX and torch backends: Keras 3's contract
(`scale_loss`, then `stateless_apply` or `apply` of the gradients of the
scaled loss) and tf.keras's names (`get_scaled_loss`,
`get_unscaled_gradients`), on the one state machine.

The scale's state is this optimizer's own variables (Keras's
`LossScaleOptimizer` keeps its `step_counter` and `dynamic_scale` the same
way), so it travels through JAX's stateless step with the optimizer's
slots and is saved with them. A step checks the unscaled gradients once,
applies them through the inner optimizer, and keeps the weights and every
slot (and `iterations`) that came in where a gradient is not finite; each
backend's class (`backends/jax`, `backends/torch`) says how.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mp_callbacks import _scale_state
from mp_callbacks._backend import keras
from mp_callbacks._keras_internals import optimizer_built_variables, optimizer_own_variables
from mp_callbacks._optimizer_arguments import (
    ScaleOptimizerAttributes,
    scaler_from_arguments,
)
from mp_callbacks._unscale import overwrites_with_gradient, unscale
from mp_callbacks.backends.common.loss_scaler import LossScaler
from mp_callbacks.backends.common.step import scale_loss

__all__ = ["VariableScaleOptimizer"]

ops = keras.ops


class VariableScaleOptimizer(ScaleOptimizerAttributes, keras.optimizers.LossScaleOptimizer):
    """What the JAX and torch `LossScaleOptimizer`s share: the arguments,
    the state in the optimizer's own variables, scaling and unscaling (the
    one rule), and `stateless_apply` around each backend's
    `_apply_if_finite` (JAX: both sides and a conditional; torch: the host
    decision first, since its optimizers write in place)."""

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        *,
        growth_interval: int | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int | None = None,
        loss_scale: Any = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        scaler = scaler_from_arguments(
            inner_optimizer,
            dynamic,
            initial_scale,
            dynamic_growth_steps,
            loss_scale,
            {
                "growth_interval": growth_interval,
                "growth_factor": growth_factor,
                "backoff_factor": backoff_factor,
                "min_scale": min_scale,
                "max_scale": max_scale,
                "hysteresis": hysteresis,
            },
            kwargs,
            LossScaler,
        )
        # Keras's LossScaleOptimizer.__init__ checks only its own arguments
        # and makes no state; the base optimizer's sets up the tracking.
        keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name)
        inner_optimizer.loss_scale_factor = None  # one scale: this one
        self.inner_optimizer = inner_optimizer
        self.scaler = scaler
        self._mp_state: dict[str, Any] = {}
        # Set by get_unscaled_gradients, taken by the next apply (trace time).
        self._mp_unscaled_by_hand = False

    # ------------------------------------------- Keras 3's and tf.keras's attributes
    @property
    def step_counter(self) -> Any:
        """Keras 3's name for the finite-step counter."""
        return self._mp_state["good_steps"]

    @property
    def dynamic_scale(self) -> Any:
        """Keras 3's name for the variable holding the current scale."""
        return self._mp_state["scale"]

    @property
    def loss_scale(self) -> Any:
        """The current loss scale (a float32 scalar), as in tf.keras."""
        return self._mp_state["scale"].value if self.built else ops.convert_to_tensor(self.initial_scale)

    def get_scale(self) -> float:
        """The current loss scale as a Python float."""
        return self.scaler.get_scale() if self.built else float(self.initial_scale)

    # ------------------------------------------------------------- building
    def build(self, var_list: list[Any]) -> None:
        initial = _scale_state.initial_values(self.scaler.settings)
        state = {
            spec.name: self.add_variable(
                shape=(),
                dtype=spec.dtype,
                initializer=keras.initializers.Constant(initial[spec.name]),
                name=f"mp_{spec.name}",
            )
            for spec in _scale_state.STATE_VARIABLES
        }
        object.__setattr__(self, "_mp_state", state)  # tracked once, by add_variable
        self.scaler.bind(state)  # a LossScaler given with a state keeps it
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    @property
    def variables(self) -> list[Any]:
        return optimizer_own_variables(self) + self.inner_optimizer.variables

    # ---------------------------------------------------- scaling the loss
    def scale_loss(self, loss: Any) -> Any:
        """`loss` times the current scale (Keras 3's name, which Keras's
        own step calls; inside a stateless step, the scale it was given)."""
        if not self.scaler.scaling_active:
            return loss
        return scale_loss(loss, self._current_scale())

    def get_scaled_loss(self, loss: Any) -> Any:
        """tf.keras's name: `loss` times the scale; for a callable `loss`, a
        callable that returns the scaled loss."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """tf.keras's name: each gradient divided by the scale once; the
        next apply takes them as unscaled and does not divide again."""
        grads = list(grads)
        self._mp_unscaled_by_hand = True
        if not self.scaler.scaling_active:
            return grads
        return unscale(grads, self._current_scale())

    def _current_scale(self) -> Any:
        # `.value`: inside Keras's StatelessScope, the value the step was given.
        if not self.built:
            return ops.convert_to_tensor(self.initial_scale, "float32")
        return self._mp_state["scale"].value

    # ------------------------------------------------------------- applying
    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """Unscales the gradients (unless `get_unscaled_gradients` did),
        checks them once, applies them through the inner optimizer unless
        one is not finite (then every weight, slot and `iterations` stays),
        and moves the scale."""
        if not self.built:
            raise ValueError(
                f"To call `stateless_apply`, {type(self).__name__} must be built (i.e. its variables "
                "must have been created). You can build it via `optimizer.build(trainable_variables)`."
            )
        optimizer_variables = list(optimizer_variables)
        own_variables = optimizer_own_variables(self)
        own, inner = optimizer_variables[: len(own_variables)], optimizer_variables[len(own_variables) :]
        at = {id(v): i for i, v in enumerate(own_variables)}
        state = {name: own[at[id(v)]] for name, v in self._mp_state.items()}
        grads = self._unscaled(list(grads), state["scale"])
        applied, flags, trainable, inner = self._apply_if_finite(
            grads, list(inner), list(trainable_variables)
        )
        # No loss is seen here: its flag is 0 (a skip is an overflow).
        flags = ops.concatenate([flags, ops.zeros((1,), flags.dtype)])
        after = _scale_state.transition(self.scaler.settings, state, flags, applied)
        own = list(own)
        for name, variable in self._mp_state.items():
            own[at[id(variable)]] = after[name]
        return trainable, own + list(inner)

    def _apply_if_finite(
        self, grads: list[Any], inner: list[Any], trainable: list[Any]
    ) -> tuple[Any, Any, list[Any], list[Any]]:
        """The inner optimizer's `stateless_apply` where every gradient is
        finite, else `trainable` and `inner` as they came in; with the
        decision and the per-gradient flags. Each backend's own."""
        raise NotImplementedError

    def _resolved_variables(self, trainable_variables: Iterable[Any] | None) -> list[Any]:
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "LossScaleOptimizer.apply: pass `trainable_variables` with the "
                    "gradients, or build(variables) the optimizer first."
                )
            trainable_variables = optimizer_built_variables(self)
        variables = list(trainable_variables)
        if not self.built:
            self.build(variables)
        return variables

    def apply(self, grads: Iterable[Any], trainable_variables: Iterable[Any] | None = None) -> None:
        """Keras 3's stateful apply (an eager loop on JAX): the same step as
        `stateless_apply`, written back to the variables."""
        grads = list(grads)
        variables = self._resolved_variables(trainable_variables)
        new_trainable, new_optimizer = self.stateless_apply(
            [v.value for v in self.variables], grads, [v.value for v in variables]
        )
        for variable, value in zip(variables, new_trainable):
            variable.assign(value)
        for variable, value in zip(self.variables, new_optimizer):
            variable.assign(value)

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], *args: Any, **kwargs: Any) -> Any:
        """tf.keras's apply: `apply` of (gradient, variable) pairs; returns
        the inner optimizer's iteration count, as Keras does."""
        grads, variables = zip(*grads_and_vars)
        self.apply(list(grads), list(variables))
        return self.iterations

    def _unscaled(self, grads: list[Any], scale: Any) -> list[Any]:
        """The one unscaling rule: divided once, here or by hand, never for
        float8 state variables (their "gradient" is their next value)."""
        by_hand, self._mp_unscaled_by_hand = self._mp_unscaled_by_hand, False
        if not self.scaler.scaling_active:
            return grads
        variables = optimizer_built_variables(self)
        if not by_hand:
            return unscale(grads, scale, variables)
        # get_unscaled_gradients could not tell float8 state from
        # gradients and divided those too: undo it.
        return [
            g * ops.cast(scale, g.dtype) if g is not None and overwrites_with_gradient(v) else g
            for g, v in zip(grads, variables)
        ]

    # ---------------------------------------------------- serialization
