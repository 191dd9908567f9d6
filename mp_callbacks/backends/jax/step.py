"""The loss-scaled step on JAX, as pure functions of the state.

JAX's step is stateless: every variable comes in as a value and the new
value goes out. A skipped step therefore only has to return what came in
instead of what the update computed: one conditional over the state, on
the device, with no host read.
The same functions serve `MixedPrecisionModel` and a `train_step` of your
own (two optimizers of a GAN share one scale and one decision).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from mp_callbacks import _scale_state
from mp_callbacks._backend import keras
from mp_callbacks._gradient_check import check_gradients, nonfinite_flag

__all__ = [
    "LossScaling",
    "StepOutcome",
    "check",
    "keep_if_skipped",
    "next_scale_state",
    "scale_loss",
    "unscale",
]

ops = keras.ops


class StepOutcome(NamedTuple):
    """What one check of a step's gradients decided."""

    applied: Any  #: bool scalar: every gradient finite, the update applies
    flags: Any  #: int [n + 1]: per gradient, then the loss, 1 where not finite
    global_norm: Any  #: float32: the gradients' global L2 norm


def scale_loss(loss: Any, scale: Any) -> Any:
    """The loss times the scale, in float32."""
    return ops.cast(loss, "float32") * scale


def unscale(grads: Sequence[Any], scale: Any) -> list[Any]:
    """Each gradient times 1/scale, in its own dtype (the rule TensorFlow's
    step and Keras's `LossScaleOptimizer` use)."""
    inverse = 1.0 / scale
    return [None if g is None else g * ops.cast(inverse, g.dtype) for g in grads]


def check(grads: Sequence[Any], loss: Any) -> StepOutcome:
    """One pass over the (unscaled) gradients: the decision, the flags the
    state machine counts, and the norm."""
    checked = check_gradients(list(grads))
    flags = ops.concatenate([checked.flags, ops.expand_dims(nonfinite_flag(loss), 0)])
    return StepOutcome(checked.all_finite, flags, checked.global_norm)


def keep_if_skipped(applied: Any, new: Any, old: Any) -> Any:
    """`new` where the step applies, `old` (what came in) where it is
    skipped: any structure of arrays (lists, tuples of lists), as one
    conditional. Both sides are computed before it, as stock Keras computes
    them: an elementwise select fused into the update lets XLA contract
    BatchNormalization's statistics differently (an ulp off stock in
    float32)."""
    return jax.lax.cond(applied, lambda: new, lambda: old)


def next_scale_state(
    settings: _scale_state.ScaleSettings, state: dict[str, Any], outcome: StepOutcome
) -> dict[str, Any]:
    """The loss scale's state after the step (`_scale_state.transition`,
    the one state machine every backend runs)."""
    return _scale_state.transition(settings, state, outcome.flags, outcome.applied)


class LossScaling:
    """The loss scale inside one stateless JAX step of a
    `MixedPrecisionModel`: its own step, or a `train_step` of yours
    (`model.loss_scaling(non_trainable_variables)`).

    Scale each loss inside the function you differentiate, unscale its
    gradients, check all of the step's gradients once, keep what came in
    where the step is skipped, and finish: the scale's next state goes back
    into the non-trainable variables, and the figures into the logs. Two
    optimizers (a GAN's) share the one scale and the one decision.
    """

    def __init__(
        self, settings: _scale_state.ScaleSettings, positions: dict[str, int], non_trainable: Any
    ) -> None:
        self._settings = settings
        self._at = positions
        #: The scale this step multiplies by (a float32 scalar).
        self.value = non_trainable[positions["scale"]]
        #: False for a fixed scale of 1: nothing is multiplied.
        self.active = settings.is_dynamic or settings.initial_scale != 1.0

    def scale(self, loss: Any) -> Any:
        """The loss to differentiate: times the scale, in float32."""
        return scale_loss(loss, self.value) if self.active else loss

    def unscale(self, grads: Sequence[Any]) -> list[Any]:
        """The gradients of a scaled loss, divided by the scale once."""
        return unscale(grads, self.value) if self.active else list(grads)

    def check(self, grads: Sequence[Any], losses: Any) -> StepOutcome:
        """The step's one decision, over all its (unscaled) gradients and
        its loss or losses: applied only if every one is finite."""
        return check(grads, losses)

    def keep_if_skipped(self, outcome: StepOutcome, new: Any, old: Any) -> Any:
        """`new` (what the optimizers computed) if the step applies, else
        `old` (the state that came in)."""
        return keep_if_skipped(outcome.applied, new, old)

    def hand_over_if_skipped(
        self, outcome: StepOutcome, non_trainable: Sequence[Any], batch: Any, receive: Any
    ) -> None:
        """Calls `receive(batch, step)` on the host where the step is
        skipped, `step` being the 0-based number of the step: a callback in
        the branch only skipped steps take, so healthy steps do no work for
        it (a kept copy in the state would be copied every step: XLA copies
        what a conditional passes through)."""
        step = non_trainable[self._at["step_count"]]
        jax.lax.cond(outcome.applied, lambda: None, lambda: jax.debug.callback(receive, batch, step))

    def finish(
        self, outcome: StepOutcome, non_trainable: Sequence[Any], batch_size: int
    ) -> tuple[list[Any], dict[str, Any]]:
        """The non-trainable values with the scale's next state and this
        epoch's figures in them, and the logs' `loss_scale`, `grad_norm`
        and `skipped_steps`."""
        values = list(non_trainable)
        before = {spec.name: values[self._at[spec.name]] for spec in _scale_state.STATE_VARIABLES}
        after = next_scale_state(self._settings, before, outcome)
        applied = ops.cast(outcome.applied, "float32")
        epoch = {
            "epoch_norm_sum": values[self._at["epoch_norm_sum"]]
            + ops.where(outcome.applied, outcome.global_norm, 0.0),
            "epoch_applied": values[self._at["epoch_applied"]] + applied,
            "epoch_skipped": values[self._at["epoch_skipped"]] + (1.0 - applied),
            "epoch_samples": values[self._at["epoch_samples"]] + float(batch_size),
        }
        increments = after.pop("nonfinite_counts")
        counts_at = self._at.get("nonfinite_counts")
        # Counted where the step's gradients are the model's trainable
        # variables', in order (a step of your own may check others).
        if counts_at is not None and tuple(values[counts_at].shape) == tuple(increments.shape):
            values[counts_at] = values[counts_at] + ops.cast(increments, values[counts_at].dtype)
        for name, value in {**after, **epoch}.items():
            if name in self._at:
                values[self._at[name]] = value
        applied_steps = epoch["epoch_applied"]
        logs = {
            "loss_scale": after["scale"],
            # An epoch without an applied step has no gradient norm (0 would
            # read as vanishing gradients).
            "grad_norm": ops.where(
                applied_steps > 0, epoch["epoch_norm_sum"] / ops.maximum(applied_steps, 1.0), float("nan")
            ),
            "skipped_steps": epoch["epoch_skipped"],
        }
        return values, logs
