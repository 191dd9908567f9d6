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

__all__ = ["StepOutcome", "check", "keep_if_skipped", "next_scale_state", "scale_loss", "unscale"]

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


def keep_if_skipped(applied: Any, new: Sequence[Any], old: Sequence[Any]) -> list[Any]:
    """`new` where the step applies, `old` (what came in) where it is
    skipped, as one conditional over all the leaves. Both sides are
    computed before it, as stock Keras computes them: an elementwise
    select fused into the update lets XLA contract BatchNormalization's
    statistics differently (an ulp off stock in float32)."""
    return list(jax.lax.cond(applied, lambda: list(new), lambda: list(old)))


def next_scale_state(
    settings: _scale_state.ScaleSettings, state: dict[str, Any], outcome: StepOutcome
) -> dict[str, Any]:
    """The loss scale's state after the step (`_scale_state.transition`,
    the one state machine every backend runs)."""
    return _scale_state.transition(settings, state, outcome.flags, outcome.applied)
