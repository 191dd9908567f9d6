"""The step's backend-neutral pieces, in `keras.ops`: scale the loss,
unscale the gradients once, check them in one pass (the decision, the
flags the state machine counts, the norm). Each backend's `step.py`
builds its step from these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from mp_callbacks import _scale_state
from mp_callbacks._backend import keras
from mp_callbacks._gradient_check import applied_norm, check_gradients, nonfinite_flag
from mp_callbacks._unscale import unscale

__all__ = ["StepOutcome", "check", "finished_state", "scale_loss", "unscale"]

ops = keras.ops


class StepOutcome(NamedTuple):
    """What one check of a step's gradients decided."""

    applied: Any  #: bool scalar: every gradient finite, the update applies
    flags: Any  #: int [n + 1]: per gradient, then the loss, 1 where not finite
    global_norm: Any  #: float32: the gradients' global L2 norm


def scale_loss(loss: Any, scale: Any) -> Any:
    """The loss times the scale, in float32."""
    return ops.cast(loss, "float32") * scale


def check(grads: Sequence[Any], loss: Any, variables: Sequence[Any] | None = None) -> StepOutcome:
    """One pass over the (unscaled) gradients: the decision, the flags the
    state machine counts, and the norm (without the float8 state among
    `variables`, whose "gradients" are their next values; they are checked
    all the same, so that no inf or NaN enters an amax history)."""
    grads = list(grads)
    checked = check_gradients(grads)
    flags = ops.concatenate([checked.flags, ops.expand_dims(nonfinite_flag(loss), 0)])
    norm = checked.global_norm if variables is None else applied_norm(checked, grads, list(variables))
    return StepOutcome(checked.all_finite, flags, norm)


def finished_state(
    settings: _scale_state.ScaleSettings,
    values: dict[str, Any],
    outcome: StepOutcome,
    batch_size: int,
    xp: Any = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """After one step: the new values of the scale's state, the epoch's
    figures and the per-variable counters (those of `values`, by name), and
    the logs' `loss_scale`, `grad_norm` and `skipped_steps` (in `xp`'s
    functions, as `_scale_state.transition`)."""
    ops = keras.ops if xp is None else xp
    before = {spec.name: values[spec.name] for spec in _scale_state.STATE_VARIABLES}
    after = _scale_state.transition(settings, before, outcome.flags, outcome.applied, xp)
    applied = ops.cast(outcome.applied, "float32")
    epoch = {
        "epoch_norm_sum": values["epoch_norm_sum"] + ops.where(outcome.applied, outcome.global_norm, 0.0),
        "epoch_applied": values["epoch_applied"] + applied,
        "epoch_skipped": values["epoch_skipped"] + (1.0 - applied),
        "epoch_samples": values["epoch_samples"] + float(batch_size),
    }
    increments = after.pop("nonfinite_counts")
    counts = values.get("nonfinite_counts")
    new = {**after, **epoch}
    # Counted where the step's gradients are the model's trainable
    # variables', in order (a step of your own may check others).
    if counts is not None and tuple(counts.shape) == tuple(increments.shape):
        new["nonfinite_counts"] = counts + ops.cast(increments, counts.dtype)
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
    return {name: value for name, value in new.items() if name in values}, logs
