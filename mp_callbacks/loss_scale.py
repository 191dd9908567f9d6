"""`LossScaler`: dynamic loss scaling, usable alone or by the model.

One object holds the loss scale and its counters in TensorFlow variables and
makes the one decision a mixed-precision step needs: were all gradients
finite? If so they are applied and the scale may grow; if not, the step is
skipped and the scale may back off. `MixedPrecisionModel.train_step` uses it,
your own `train_step` can (`scale`, then `step`), and it works alone in a
hand-written `tf.function` loop, as PyTorch's `GradScaler` does.

This module is the public object: the scale's state in variables, `scale`
and `unscale`, the counters the callbacks read, save and restore. The step
it takes is TensorFlow's step module (`mp_callbacks.backends.tensorflow.step`:
check once, decide once, apply or skip, update the state), on the
backend-neutral state machine (`mp_callbacks._scale_state`) and gradient
check (`mp_callbacks._gradient_check`).

A fixed scale is the degenerate machine with `min_scale == max_scale`
(`LossScaler.fixed(128.0)`); no scaling is the fixed scale 1.0
(`LossScaler.disabled()`). Both still skip non-finite steps, since a
NaN update would destroy the weights.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mp_callbacks import _scale_state
from mp_callbacks._backend import keras, tf
from mp_callbacks._gradient_check import (
    CheckedGradients,
    check_gradients,
)
from mp_callbacks._loss_scale_argument import scaler_from_argument
from mp_callbacks._scale_config import ScaleConfig
from mp_callbacks._scale_state import (
    MAX_FIXED_LOSS_SCALE,
    MIN_LOSS_SCALE,
    STATE_VARIABLES,
    ScaleSettings,
    check_fixed_scale,
    check_scale,
)
from mp_callbacks._unscale import unscale
from mp_callbacks._validation import FLOAT32_MAX
from mp_callbacks.backends.tensorflow import step as tf_step
from mp_callbacks.backends.tensorflow.step_record import StepRecord, StepTraces
from mp_callbacks.backends.tensorflow.unscale_stage import stage_of

__all__ = [
    "MAX_FIXED_LOSS_SCALE",
    "MIN_LOSS_SCALE",
    "STATE_VARIABLES",
    "CheckedGradients",
    "LossScaler",
    "check_fixed_scale",
    "check_scale",
]

logger = logging.getLogger(__name__)

_ONLY_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA
# The hot-path methods branch only on Python values; AutoGraph has nothing
# to convert there, and some TensorFlow releases mis-convert them.
_no_autograph = tf.autograph.experimental.do_not_convert


class _Untracked:
    """Holds the model's variables without making them the loss scale's:
    a list set on a tf.Module would be walked into its `variables` and
    written into its checkpoints."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items


@keras.saving.register_keras_serializable(package="mp_callbacks")
class LossScaler(ScaleConfig, tf.Module):
    """The loss scale of mixed-precision training, and the skip of
    non-finite steps: dynamic by default, fixed with `LossScaler.fixed(s)`,
    none with `LossScaler.disabled()` (non-finite steps are skipped in
    every case).

    After `growth_interval` finite steps in a row the scale grows by
    `growth_factor` (up to `max_scale`); an overflow spends one unit of
    `hysteresis` and, once that is spent, backs the scale off by
    `backoff_factor` (down to `min_scale`).

    Args:
        initial_scale: float. The scale to start from. A high value is
            best: a scale that is too high is lowered in a few skipped
            steps, one that is too low is raised only every
            `growth_interval` steps. Defaults to `2**15`.
        growth_interval: int. Consecutive finite steps after which the
            scale grows. Defaults to `2000`.
        growth_factor: float > 1. Factor by which the scale grows.
            Defaults to `2.0`.
        backoff_factor: float in (0, 1). Factor by which the scale shrinks
            after an overflow. Defaults to `0.5`.
        min_scale: float. The scale never falls below this. Defaults to
            `1.0`.
        max_scale: float. The scale never grows above this. Defaults to
            `2**24`. All three scales are at least 2**-24: below it,
            gradients underflow to zero.
        hysteresis: int >= 1. Overflowing steps tolerated before backing
            off (Megatron-LM's and DeepSpeed's `hysteresis`); 1 backs off
            on every overflow. Defaults to `1`.
        name: str. Name of the TensorFlow module holding the variables.
            Defaults to `"dynamic_loss_scale"`.

    Raises:
        ValueError: an argument out of its range (named, with the value).
        TypeError: an argument of the wrong type (a bool, a string).

    The variables are created when the object is made; under a
    `tf.distribute` strategy, make it inside `strategy.scope()`.

    Example (a hand-written loop):

    ```python
    import keras, tensorflow as tf
    from mp_callbacks import LossScaler

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    scaler = LossScaler(initial_scale=2.0**10)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y, model(x))
            loss = tf.reduce_mean(loss)
            scaled_loss = scaler.scale(loss)
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = scaler.unscale(grads)
        return scaler.apply_gradients(
            optimizer, grads, model.trainable_variables, loss=loss)

    applied = train_step(tf.ones((8, 4)), tf.zeros((8, 1)))
    print(bool(applied), scaler.get_scale())  # True 1024.0
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
        settings = ScaleSettings.checked(
            initial_scale, growth_interval, growth_factor, backoff_factor, min_scale, max_scale, hysteresis
        )
        super().__init__(name=name)
        self._take_settings(settings)

        initial = _scale_state.initial_values(settings)
        self._state: dict[str, tf.Variable] = {}
        # The state must not be replicated per device: one value, updated
        # identically by every replica after one all-reduced decision.
        with tf.init_scope(), self.name_scope:
            for spec in STATE_VARIABLES:
                self._state[spec.name] = tf.Variable(
                    initial[spec.name],
                    dtype=spec.dtype,
                    trainable=False,
                    aggregation=_ONLY_FIRST,
                    name=spec.name,
                )
        self._scale = self._state["scale"]
        # Per-variable non-finite counts need the variable list: see build().
        self._nonfinite_counts: Any = None  # a tf.Variable once built
        self._variable_paths: list[str] = []
        self._variable_ids: tuple[int, ...] = ()
        self._built = _Untracked([])
        # Whether the last recorded step scaled its loss (None: none traced yet).
        self._scaling_seen: bool | None = None
        self._warned_optimizers: set[int] = set()
        # What the step remembers while traced (not a tf.Module attribute
        # to walk: it holds no variable).
        self._traces = StepTraces()

    # ----------------------------------------------------------------- build
    @property
    def built(self) -> bool:
        return self._nonfinite_counts is not None

    def build(self, variables: Sequence[Any]) -> None:
        """Creates the per-variable non-finite counters for `variables`.

        Called by `MixedPrecisionModel` before training, and lazily by the
        first `apply_gradients`. Under a `tf.distribute` strategy call it
        once inside `strategy.scope()` before the first step. Calling it again
        with the same variables is a no-op; with the same variables followed
        by new ones (as `apply_gradients` does when a call brings new
        variables) it keeps their counts and adds zeros; with other variables
        it starts new counters.
        """
        variables = list(variables)
        ids = tuple(id(v) for v in variables)
        if self.built and (ids == self._variable_ids or set(ids) <= set(self._variable_ids)):
            return
        with tf.init_scope(), self.name_scope:
            counts = np.zeros([len(variables)], np.int64)
            known = len(self._variable_ids)
            if self.built and ids[:known] == self._variable_ids:
                counts[:known] = self._nonfinite_counts.numpy()
            self._nonfinite_counts = tf.Variable(
                counts,
                trainable=False,
                aggregation=_ONLY_FIRST,
                name="nonfinite_gradient_counts",
            )
        self._variable_ids = ids
        self._built = _Untracked(variables)
        self._variable_paths = [getattr(v, "path", None) or v.name for v in variables]

    # -------------------------------------------------------------- hot path
    @property
    def loss_scale(self) -> tf.Tensor:
        """The current scale as a float32 tensor (no host sync)."""
        return tf.identity(self._scale)

    # ------------------------------------------------------- step records
    # Per thread: MirroredStrategy traces each replica's step in a thread of
    # its own, and each replica keeps its own record and pending applies.
    @property
    def _record(self) -> StepRecord | None:
        """The training step being traced, when a MixedPrecisionModel records it."""
        return tf_step.record_of(self)

    def recording(self) -> contextlib.AbstractContextManager[StepRecord]:
        """Records one training step (see `backends.tensorflow.step_record`):
        while open, applies defer the state update to `finish_step`."""
        return tf_step.recording(self)

    def finish_step(self, record: StepRecord) -> None:
        """Advances the state machine once for the recorded step's applies."""
        tf_step.finish_step(self, record)

    @property
    def scales_losses(self) -> bool:
        """True when this scale multiplies the losses it trains on: it is
        not fixed at 1.0 and the last recorded step (if any) scaled its
        loss. False for a model's own `train_step` that never calls
        `scale`, whose gradients are then not scaled either."""
        return self.scaling_active and self._scaling_seen is not False

    # -------------------------------------------------------------- hot path
    @_no_autograph
    def scale(self, loss: Any) -> tf.Tensor:
        """Returns `loss * scale`, in the dtype of `loss`.

        Step 1 of 2 in your own training step: scale the loss inside the
        `GradientTape`, then pass the gradients of the scaled loss to `step`.
        """
        if self._record is not None:
            self._record.note_loss(loss)
            self._record.loss_scaled = True
        elif self._scaling_seen is None:
            self._scaling_seen = True
        if not self.scaling_active:
            return loss
        loss = tf.convert_to_tensor(loss)
        return loss * tf.cast(self._scale, loss.dtype)

    @_no_autograph
    def unscale(self, grads: Iterable[Any], variables: Iterable[Any] | None = None) -> list[Any]:
        """Divides each gradient by the scale; None gradients pass through
        (PyTorch's `GradScaler.unscale_`).

        The one unscaling rule: a step's gradients are divided once. After
        `unscale` (to clip them, say), the next `step` of the same
        `variables` (or, when none were given, the next `step` or
        `LossScaleOptimizer` apply through this scale) takes its gradients
        as unscaled and does not divide them again. `apply_gradients`
        always takes unscaled gradients.

        With `variables`, the "gradients" of variables that Keras overwrites
        with their gradient (`overwrite_with_gradient`: float8 layers' scales
        and amax histories) pass through unchanged, as in Keras's own
        `LossScaleOptimizer`.

        Raises:
            RuntimeError: these gradients (or these variables' gradients)
                were already unscaled in this step and not yet applied.
        """
        grads = list(grads)
        variables = None if variables is None else list(variables)
        unscaled = self._unscale(grads, variables)
        stage_of(self).mark_unscaled(grads, unscaled, variables)
        return unscaled

    def _unscale(self, grads: Iterable[Any], variables: Iterable[Any] | None = None) -> list[Any]:
        grads = list(grads)
        if not self.scaling_active:
            return grads
        return unscale(grads, self._scale, None if variables is None else list(variables))

    @_no_autograph
    def check_gradients(self, grads: Sequence[Any]) -> CheckedGradients:
        """One pass over `grads` (a list of tensors, `IndexedSlices` or None):
        which hold inf or NaN, and their global norm.

        Returns:
            A `CheckedGradients` with `all_finite` (a boolean scalar
            tensor), `flags` (one per gradient) and `global_norm`; pass it
            to `apply_gradients(checked=...)` so the pass is not made twice.
        """
        return check_gradients(grads)

    @_no_autograph
    def apply_gradients(
        self,
        optimizer: keras.optimizers.Optimizer,
        grads: Iterable[Any],
        variables: Iterable[Any],
        loss: Any = None,
        restore_on_skip: Sequence[tuple[Any, Any]] = (),
        update: bool | None = None,
        checked: CheckedGradients | None = None,
    ) -> tf.Tensor:
        """Applies unscaled `grads` if all are finite; updates the state.

        `step` is the same for the gradients of a scaled loss (it unscales
        them first); this method is for gradients you unscaled yourself
        (to clip them, say).

        Several optimizers, one scale (a GAN's generator and discriminator):
        call this once per optimizer with `update=False`, then `update()`
        once. Each optimizer is skipped only if its own gradients are not
        all finite (PyTorch's `GradScaler.step(optimizer)`), and the scale
        moves once per training step: it backs off if any optimizer's
        gradients overflowed (`GradScaler.update()`). Inside a
        `MixedPrecisionModel`'s training step this is the default: the
        model calls `update()` once at the end of the step. The variables
        of all the optimizers are counted together: `build` them all at
        once, or let the calls do it on the first step.

        Args:
            optimizer: `keras.optimizers.Optimizer`. A `LossScaleOptimizer` is
                unwrapped: its inner optimizer applies the gradients
                (Keras's own, which `compile` adds under `mixed_float16`,
                with a `MixedPrecisionWarning`: it would unscale them a
                second time). A `loss_scale_factor` set on the optimizer is
                cleared, with a warning, for the same reason.
            grads: list of tensors. Unscaled gradients, one per variable
                (None allowed).
            variables: list of variables the gradients belong to.
            loss: scalar tensor or None. The unscaled loss the gradients
                come from. Defaults to None (inside a
                `MixedPrecisionModel`'s step: the losses the step computed
                or scaled). A non-finite loss counts as
                divergence for `NaNGradientMonitor`, and sparse writes wait
                for it.
            restore_on_skip: list of `(variable, value)` pairs assigned back when
                the step is skipped: state that the forward pass already
                changed, such as BatchNormalization's moving statistics,
                read before the forward pass. Nothing is assigned on an
                applied step. Defaults to none.
            update: bool or None. Advance the state machine now (True), or
                leave it to one `update()` call after every optimizer of the
                step (False). Defaults to None: False inside a
                `MixedPrecisionModel`'s training step, True elsewhere.
            checked: `CheckedGradients` or None. The result of
                `check_gradients(grads)`, when the caller already made that
                pass: it is not made twice. Defaults to None (the pass is
                made here).

        Returns:
            A boolean scalar tensor: True if the gradients were applied.

        Raises:
            TypeError: `optimizer` is not a Keras optimizer.

        Under a `tf.distribute` strategy call it inside `strategy.run`: the
        finiteness of every replica's gradients is all-reduced, so all
        replicas take the same decision and keep the same scale.

        Inside a `tf.function` without a strategy, the update is not put in
        a `tf.cond`: each write the optimizer makes keeps the old value when
        the step is skipped, which healthy steps do not pay for. With
        `loss`, a sparse increment (SGD on an Embedding) does not wait for
        the decision: it is written once the loss is known to be finite,
        and the rows it touched are put back on a skip. An update that
        writes state in ways that cannot be gated (a custom `update_step`
        assigning a variable directly, weight constraints, `use_ema`,
        gradient accumulation) is put in a `tf.cond` instead; the design
        notes of the documentation say why and how this is checked.
        """
        variables = list(variables)
        # Unscaled gradients, by hand or otherwise: an unscale() of them is used up.
        stage_of(self).take_unscaled(variables)
        return tf_step.apply_unscaled(
            self, optimizer, grads, variables, loss, restore_on_skip, update_now=update, checked=checked
        )

    @_no_autograph
    def step(
        self,
        optimizer: keras.optimizers.Optimizer,
        grads: Iterable[Any],
        variables: Iterable[Any],
        loss: Any = None,
        update: bool | None = None,
    ) -> tf.Tensor:
        """Unscales the gradients of a scaled loss and applies them, unless
        one is not finite (PyTorch's `GradScaler.step(optimizer)`).

        Step 2 of 2 in your own training step, after `scale`:

            with tf.GradientTape() as tape:
                loss = ...
                scaled_loss = scaler.scale(loss)
            grads = tape.gradient(scaled_loss, variables)
            scaler.step(optimizer, grads, variables, loss=loss)

        Gradients already passed through `unscale` in this step (clipped
        since, say) are not divided again: see `unscale` for the rule.

        Args and Returns: as for `apply_gradients`, with `grads` the
        gradients of the scaled loss.
        """
        variables = list(variables)
        if stage_of(self).take_unscaled(variables) is None:
            grads = self._unscale(grads, variables)
        return tf_step.apply_unscaled(self, optimizer, grads, variables, loss=loss, update_now=update)

    @_no_autograph
    def update(self) -> None:
        """Advances the state machine once for the steps of several
        optimizers made with `apply_gradients(..., update=False)`.

        The step counts as overflowing (skipped, backing off) if any of
        those optimizers' gradients were non-finite, and as divergent if
        any loss was non-finite. Call it in the same `tf.function` as those
        calls, once per training step (a `MixedPrecisionModel` calls it at
        the end of its training steps).

        Raises:
            RuntimeError: no `apply_gradients(..., update=False)` is pending.
        """
        tf_step.update(self)

    def _update_state(self, flags: tf.Tensor, applied: tf.Tensor | None = None) -> None:
        """One transition of the state machine (`backends.tensorflow.step.update_state`)."""
        tf_step.update_state(self, flags, applied)

    # ------------------------------------------------------ host-side reads
    def get_scale(self) -> float:
        """The current scale as a Python float (reads from the device)."""
        return float(self._scale.numpy())

    def diagnostics(self) -> dict[str, Any]:
        """The state as Python numbers, in one host read.

        Keys are the names in `STATE_VARIABLES`: `scale` and `lowest_scale`
        (floats; `lowest_scale` is None when no step was taken since
        `reset_lowest_scale()`), and the counters `good_steps`, `hysteresis_left`,
        `step_count`, `skipped_steps` (total skipped), `nonfinite_loss_steps`,
        `divergent_steps` (a non-finite loss, or a skipped step with the scale
        at `min_scale`), `divergent_run` (current run of consecutive divergent
        steps), `max_divergent_run` (longest run since the last
        `reset_divergence_latches`) and `calibration_steps` (skipped steps
        before the first applied one, while a dynamic scale comes down from
        `initial_scale`).
        """
        names = [spec.name for spec in STATE_VARIABLES]
        # One device-to-host transfer; float64 holds the counters exactly
        # up to 2**53, far beyond any training run.
        values = tf.stack([tf.cast(self._state[name], tf.float64) for name in names]).numpy()
        state: dict[str, float | int | None] = {
            name: int(value) if name in _scale_state.COUNTERS else float(value)
            for name, value in zip(names, values)
        }
        if state["lowest_scale"] == FLOAT32_MAX:
            state["lowest_scale"] = None  # no step since reset_lowest_scale()
        return state

    def reset_divergence_latches(self) -> None:
        """Forgets earlier divergence: the current and the longest divergent
        run restart from 0. A new `fit` starts from here, so that a run that
        diverged earlier is not reported again on clean data."""
        self._state["divergent_run"].assign(0)
        self._state["max_divergent_run"].assign(0)

    def reset_max_divergent_run(self) -> None:
        """Restarts the `max_divergent_run` latch from the current run."""
        self._state["max_divergent_run"].assign(self._state["divergent_run"])

    def reset_lowest_scale(self) -> None:
        """Restarts the `lowest_scale` latch: it then holds the lowest scale
        that a step reaches from here on (float32's maximum until one does),
        so a collapse before the reset is not reported again."""
        self._state["lowest_scale"].assign(FLOAT32_MAX)

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
        state = dict(self._state)
        if self.built:
            state["nonfinite_counts"] = self._nonfinite_counts
        return state

    def get_state(self) -> dict[str, Any]:
        """The state as NumPy values, keyed by the names in `STATE_VARIABLES`
        (plus `nonfinite_counts` once built)."""
        return {k: v.numpy() for k, v in self._state_variables().items()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a state from `get_state` (or a weights file).

        Restores state, not hyperparameters. Unknown keys, and per-variable
        counts of another shape, are ignored (a state saved before `build`
        still restores the scale).

        Raises:
            ValueError: a scale that is not a finite number > 0, or a
                counter that is not a non-negative integer; nothing is
                changed (a scale restored as NaN, inf, 0 or negative could
                never recover).
        """
        for variable, value in _scale_state.validated_updates(self._state_variables(), state):
            variable.assign(value)


def loss_scale_from_argument(value: Any, owner: str = "MixedPrecisionModel") -> LossScaler | None:
    """A `loss_scale` argument as a LossScaler (None for "auto"): the one
    parser, `_loss_scale_argument.scaler_from_argument`, with this backend's class."""
    return scaler_from_argument(value, LossScaler, owner)
