"""The loss-scale state machine: `DynamicLossScale`.

One object holds the loss scale and its counters in TensorFlow variables and
makes the one decision a mixed-precision step needs: were all gradients
finite? If so they are applied and the scale may grow; if not, the step is
skipped and the scale may back off. `MixedPrecisionModel.train_step` uses it,
and it works alone in a hand-written `tf.function` loop.

State transitions (per call of `apply_gradients`), as in PyTorch's
`GradScaler` and Megatron-LM's `DynamicGradScaler`:

* finite step: the optimizer is applied and `good_steps += 1`. When
  `good_steps` reaches `growth_interval`, the scale is multiplied by
  `growth_factor` (capped at `max_scale`), `good_steps` is reset to 0 and the
  hysteresis budget is refilled to `hysteresis`.
* non-finite step: nothing is applied (weights and optimizer state, including
  its iteration count, stay as they were), `good_steps` is reset to 0 and one
  unit of the hysteresis budget is spent. When the budget is exhausted the
  scale is multiplied by `backoff_factor` (floored at `min_scale`); the budget
  then stays at 0, so every further overflow backs off until the next growth.

A fixed scale is the degenerate machine with `min_scale == max_scale`
(`DynamicLossScale.fixed(128.0)`); no scaling is the fixed scale 1.0
(`DynamicLossScale.disabled()`). Both still skip non-finite steps, since a
NaN update would destroy the weights.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from mp_callbacks._backend import keras, tf

__all__ = ["DynamicLossScale"]

_ONLY_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA


def _require(condition: bool, argument: str, value: Any, requirement: str) -> None:
    if not condition:
        raise ValueError(
            f"DynamicLossScale: `{argument}` must be {requirement}; "
            f"received {argument}={value!r}."
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _nonfinite_flag(value: Any) -> tf.Tensor:
    """1 if `value` holds any inf or NaN, else 0 (int64; 0 for None)."""
    if value is None:
        return tf.constant(0, tf.int64)
    if isinstance(value, tf.IndexedSlices):
        value = value.values
    return tf.cast(
        tf.logical_not(tf.reduce_all(tf.math.is_finite(value))), tf.int64
    )


@keras.saving.register_keras_serializable(package="mp_callbacks")
class DynamicLossScale(tf.Module):
    """Dynamic loss scaling for mixed-precision training.

    Args:
        initial_scale: the scale to start from. A high value is best: a
            scale that is too high is lowered in a few skipped steps, one that
            is too low is raised only every `growth_interval` steps.
        growth_interval: number of consecutive finite steps after which the
            scale grows.
        growth_factor: factor (> 1) by which the scale grows.
        backoff_factor: factor in (0, 1) by which the scale shrinks after
            an overflow.
        min_scale: the scale never falls below this.
        max_scale: the scale never grows above this.
        hysteresis: number of overflowing steps tolerated before backing off
            (Megatron-LM and DeepSpeed's `hysteresis`); 1 backs off on every
            overflow.
        name: name of the TensorFlow module holding the variables.

    The variables are created when the object is made; under a
    `tf.distribute` strategy, make it inside `strategy.scope()`.

    Example (a hand-written loop):

    ```python
    import keras, tensorflow as tf
    from mp_callbacks import DynamicLossScale

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    loss_scale = DynamicLossScale(initial_scale=2.0**10)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y, model(x))
            loss = tf.reduce_mean(loss)
            scaled_loss = loss_scale.scale(loss)
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = loss_scale.unscale(grads)
        return loss_scale.apply_gradients(
            optimizer, grads, model.trainable_variables, loss=loss)

    applied = train_step(tf.ones((8, 4)), tf.zeros((8, 1)))
    print(bool(applied), loss_scale.get_scale())
    ```
    """

    def __init__(
        self,
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        name: str = "dynamic_loss_scale",
    ) -> None:
        for argument, value in (
            ("initial_scale", initial_scale),
            ("min_scale", min_scale),
            ("max_scale", max_scale),
        ):
            _require(
                _is_number(value) and math.isfinite(value) and value > 0,
                argument,
                value,
                "a finite number > 0",
            )
        _require(
            isinstance(growth_interval, int)
            and not isinstance(growth_interval, bool)
            and growth_interval >= 1,
            "growth_interval",
            growth_interval,
            "an integer >= 1",
        )
        _require(
            _is_number(growth_factor)
            and math.isfinite(growth_factor)
            and growth_factor > 1,
            "growth_factor",
            growth_factor,
            "a finite number > 1",
        )
        _require(
            _is_number(backoff_factor) and 0 < backoff_factor < 1,
            "backoff_factor",
            backoff_factor,
            "a number in the open interval (0, 1)",
        )
        _require(
            min_scale <= max_scale,
            "min_scale",
            min_scale,
            f"<= max_scale ({max_scale!r})",
        )
        _require(
            min_scale <= initial_scale <= max_scale,
            "initial_scale",
            initial_scale,
            f"within [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}]",
        )
        _require(
            isinstance(hysteresis, int)
            and not isinstance(hysteresis, bool)
            and hysteresis >= 1,
            "hysteresis",
            hysteresis,
            "an integer >= 1",
        )
        super().__init__(name=name)
        self.initial_scale = float(initial_scale)
        self.growth_interval = int(growth_interval)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.hysteresis = int(hysteresis)

        def state(value, dtype, var_name):
            return tf.Variable(
                value,
                dtype=dtype,
                trainable=False,
                aggregation=_ONLY_FIRST,
                name=var_name,
            )

        with self.name_scope:
            # The loss-scale state proper.
            self._scale = state(self.initial_scale, tf.float32, "scale")
            self._good_steps = state(0, tf.int64, "good_steps")
            self._hysteresis_left = state(
                self.hysteresis, tf.int64, "hysteresis_left"
            )
            # Cumulative step signals, read by callbacks every N steps so that
            # nothing between two reads is missed and nothing syncs per step.
            self._step_count = state(0, tf.int64, "step_count")
            self._skipped_count = state(0, tf.int64, "skipped_count")
            self._nonfinite_loss_count = state(0, tf.int64, "nonfinite_loss_count")
            self._divergent_count = state(0, tf.int64, "divergent_count")
            self._divergent_run = state(0, tf.int64, "divergent_run")
            self._max_divergent_run = state(0, tf.int64, "max_divergent_run")
        # Per-variable non-finite counts need the variable list: see build().
        self._nonfinite_counts = None
        self._variable_paths: list[str] = []
        self._variable_ids: tuple[int, ...] = ()

    # ------------------------------------------------------------------ config
    @classmethod
    def fixed(cls, scale: float, name: str = "fixed_loss_scale") -> "DynamicLossScale":
        """A constant loss scale (still skips non-finite steps)."""
        return cls(initial_scale=scale, min_scale=scale, max_scale=scale, name=name)

    @classmethod
    def disabled(cls, name: str = "no_loss_scale") -> "DynamicLossScale":
        """No loss scaling: scale 1.0, non-finite steps still skipped."""
        return cls.fixed(1.0, name=name)

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
    def from_config(cls, config: dict[str, Any]) -> "DynamicLossScale":
        return cls(**config)

    def __repr__(self) -> str:
        if not self.is_dynamic:
            return f"DynamicLossScale.fixed({self.initial_scale!r})"
        return (
            f"DynamicLossScale(initial_scale={self.initial_scale!r}, "
            f"growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis})"
        )

    # ----------------------------------------------------------------- build
    @property
    def built(self) -> bool:
        return self._nonfinite_counts is not None

    def build(self, variables: Sequence[Any]) -> None:
        """Creates the per-variable non-finite counters for `variables`.

        Called by `MixedPrecisionModel` before training, and lazily by the
        first `apply_gradients`. Under a `tf.distribute` strategy call it
        once inside `strategy.scope()` before the first step. Calling it again
        with the same variables is a no-op; with other variables it starts
        new counters.
        """
        variables = list(variables)
        ids = tuple(id(v) for v in variables)
        if self.built and ids == self._variable_ids:
            return
        with tf.init_scope(), self.name_scope:
            self._nonfinite_counts = tf.Variable(
                tf.zeros([len(variables)], tf.int64),
                trainable=False,
                aggregation=_ONLY_FIRST,
                name="nonfinite_gradient_counts",
            )
        self._variable_ids = ids
        self._variable_paths = [
            getattr(v, "path", None) or v.name for v in variables
        ]

    # -------------------------------------------------------------- hot path
    def current_scale(self) -> tf.Tensor:
        """The current scale as a float32 tensor (no host sync)."""
        return tf.identity(self._scale)

    def scale(self, loss: Any) -> tf.Tensor:
        """Returns `loss * scale`, in the dtype of `loss`."""
        if not self.scaling_active:
            return loss
        loss = tf.convert_to_tensor(loss)
        return loss * tf.cast(self._scale, loss.dtype)

    def unscale(self, grads: Iterable[Any]) -> list[Any]:
        """Divides each gradient by the scale; None gradients pass through."""
        grads = list(grads)
        if not self.scaling_active:
            return grads
        inverse = tf.math.reciprocal(self._scale)

        def unscale_one(grad):
            if grad is None:
                return None
            if isinstance(grad, tf.IndexedSlices):
                return tf.IndexedSlices(
                    grad.values * tf.cast(inverse, grad.values.dtype),
                    grad.indices,
                    grad.dense_shape,
                )
            return grad * tf.cast(inverse, grad.dtype)

        return [unscale_one(g) for g in grads]

    def apply_gradients(
        self,
        optimizer: keras.optimizers.Optimizer,
        grads: Iterable[Any],
        variables: Iterable[Any],
        loss: Any = None,
    ) -> tf.Tensor:
        """Applies unscaled `grads` if all are finite; updates the state.

        Args:
            optimizer: a Keras optimizer (not a `LossScaleOptimizer`).
            grads: unscaled gradients, one per variable (None allowed).
            variables: the variables the gradients belong to.
            loss: optional unscaled loss; a non-finite loss counts as
                divergence for `NaNGradientMonitor`.

        Returns:
            A boolean scalar tensor: True if the gradients were applied.

        Under a `tf.distribute` strategy call it inside `strategy.run`: the
        finiteness of every replica's gradients is all-reduced, so all
        replicas take the same decision and keep the same scale.
        """
        grads = list(grads)
        variables = list(variables)
        if len(grads) != len(variables):
            raise ValueError(
                "DynamicLossScale.apply_gradients: got "
                f"{len(grads)} gradients for {len(variables)} variables."
            )
        self.build(variables)
        if not optimizer.built:
            optimizer.build(variables)

        flags = tf.stack(
            [_nonfinite_flag(g) for g in grads] + [_nonfinite_flag(loss)]
        )
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None:
            raise RuntimeError(
                "DynamicLossScale.apply_gradients must run in a replica "
                "context: call it inside `strategy.run(...)`."
            )
        if replica_context.num_replicas_in_sync > 1:
            # One global decision: every replica sees every replica's flags.
            flags = replica_context.all_reduce(
                tf.distribute.ReduceOp.SUM, flags
            )
        grads_finite = tf.equal(tf.reduce_sum(flags[:-1]), 0)

        if (
            not tf.distribute.has_strategy()
            or tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            tf.cond(
                grads_finite,
                lambda: self._apply(optimizer, grads, variables),
                lambda: None,
            )
            self._update_state(flags)
        else:
            # A cond whose branch calls optimizer.apply (which merge_calls)
            # cannot run in a replica context: decide in cross-replica context,
            # as Keras's own LossScaleOptimizer._tf_apply does.
            def decide(distribution, grads, flags):
                flags = distribution.experimental_local_results(flags)[0]

                def apply_on_every_replica():
                    distribution.extended.call_for_each_replica(
                        self._apply, args=(optimizer, grads, variables)
                    )

                tf.cond(
                    tf.equal(tf.reduce_sum(flags[:-1]), 0),
                    apply_on_every_replica,
                    lambda: None,
                )
                self._update_state(flags)

            replica_context.merge_call(decide, args=(grads, flags))
        return grads_finite

    @staticmethod
    def _apply(optimizer, grads, variables):
        optimizer.apply(grads, variables)

    def _update_state(self, flags: tf.Tensor) -> None:
        """Advances the state machine; `flags` are already all-reduced."""
        per_variable = tf.minimum(flags[:-1], 1)
        grads_finite = tf.equal(tf.reduce_sum(per_variable), 0)
        loss_finite = tf.equal(flags[-1], 0)
        scale = self._scale.read_value()
        at_floor = scale <= self.min_scale

        good = self._good_steps + 1
        grow = tf.logical_and(grads_finite, good >= self.growth_interval)
        hysteresis_left = tf.maximum(self._hysteresis_left - 1, 0)
        back_off = tf.logical_and(
            tf.logical_not(grads_finite), hysteresis_left <= 0
        )
        new_scale = tf.where(
            grow,
            tf.minimum(scale * self.growth_factor, self.max_scale),
            tf.where(
                back_off,
                tf.maximum(scale * self.backoff_factor, self.min_scale),
                scale,
            ),
        )
        self._scale.assign(new_scale)
        self._good_steps.assign(
            tf.where(grads_finite & tf.logical_not(grow), good, 0)
        )
        self._hysteresis_left.assign(
            tf.where(
                grow,
                tf.constant(self.hysteresis, tf.int64),
                tf.where(grads_finite, self._hysteresis_left, hysteresis_left),
            )
        )

        skipped = tf.cast(tf.logical_not(grads_finite), tf.int64)
        divergent = tf.logical_or(
            tf.logical_not(loss_finite),
            tf.logical_and(tf.logical_not(grads_finite), at_floor),
        )
        run = tf.where(divergent, self._divergent_run + 1, 0)
        self._step_count.assign_add(1)
        self._skipped_count.assign_add(skipped)
        self._nonfinite_loss_count.assign_add(
            tf.cast(tf.logical_not(loss_finite), tf.int64)
        )
        self._divergent_count.assign_add(tf.cast(divergent, tf.int64))
        self._divergent_run.assign(run)
        self._max_divergent_run.assign(tf.maximum(self._max_divergent_run, run))
        self._nonfinite_counts.assign_add(per_variable)

    # ------------------------------------------------------ host-side reads
    def get_scale(self) -> float:
        """The current scale as a Python float (reads from the device)."""
        return float(self._scale.numpy())

    def diagnostics(self) -> dict[str, float | int]:
        """Cumulative step signals as Python numbers (one host read).

        Keys: `scale`, `good_steps`, `hysteresis_left`, `step_count`,
        `skipped_steps` (total skipped), `nonfinite_loss_steps`,
        `divergent_steps` (total divergent steps: a non-finite loss, or a
        skipped step with the scale at `min_scale`), `divergent_run`
        (current run of consecutive divergent steps)
        and `max_divergent_run` (longest such run since the last
        `reset_max_divergent_run`).
        """
        keys = (
            "scale",
            "good_steps",
            "hysteresis_left",
            "step_count",
            "skipped_steps",
            "nonfinite_loss_steps",
            "divergent_steps",
            "divergent_run",
            "max_divergent_run",
        )
        variables = (
            self._scale,
            self._good_steps,
            self._hysteresis_left,
            self._step_count,
            self._skipped_count,
            self._nonfinite_loss_count,
            self._divergent_count,
            self._divergent_run,
            self._max_divergent_run,
        )
        # One device-to-host transfer; float64 holds the counters exactly.
        values = tf.stack([tf.cast(v, tf.float64) for v in variables]).numpy()
        result: dict[str, float | int] = {
            key: int(value) for key, value in zip(keys, values)
        }
        result["scale"] = float(values[0])
        return result

    def reset_max_divergent_run(self) -> None:
        """Restarts the `max_divergent_run` latch from the current run."""
        self._max_divergent_run.assign(self._divergent_run)

    def nonfinite_gradient_counts(self) -> dict[str, int]:
        """Steps with a non-finite gradient, per variable path, in order.

        The order is that of the variables passed to `build` (for a model,
        its trainable variables: forward order for functional models).
        """
        if not self.built:
            return {}
        counts = self._nonfinite_counts.numpy().tolist()
        return dict(zip(self._variable_paths, (int(c) for c in counts)))

    # ------------------------------------------------------- save / restore
    def _state_variables(self) -> dict[str, tf.Variable]:
        state = {
            "scale": self._scale,
            "good_steps": self._good_steps,
            "hysteresis_left": self._hysteresis_left,
            "step_count": self._step_count,
            "skipped_count": self._skipped_count,
            "nonfinite_loss_count": self._nonfinite_loss_count,
            "divergent_count": self._divergent_count,
            "divergent_run": self._divergent_run,
            "max_divergent_run": self._max_divergent_run,
        }
        if self.built:
            state["nonfinite_counts"] = self._nonfinite_counts
        return state

    #: Prefix of this object's entries in a Keras weights store.
    STORE_PREFIX = "mp_loss_scale."

    def save_to_store(self, store: Any) -> None:
        """Writes the state into a Keras weights store (`save_own_variables`)."""
        for key, value in self.get_state().items():
            store[self.STORE_PREFIX + key] = value

    def load_from_store(self, store: Any) -> None:
        """Reads the state back from a Keras weights store."""
        prefix = self.STORE_PREFIX
        self.set_state({k[len(prefix):]: store[k] for k in store.keys() if k.startswith(prefix)})

    def get_state(self) -> dict[str, Any]:
        """The state as NumPy values, keyed by name."""
        return {k: v.numpy() for k, v in self._state_variables().items()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a state from `get_state` (unknown or misshapen keys are
        ignored, so a state saved before `build` still restores the scale)."""
        for key, variable in self._state_variables().items():
            if key in state:
                value = tf.convert_to_tensor(state[key], variable.dtype)
                if value.shape == variable.shape:
                    variable.assign(value)
