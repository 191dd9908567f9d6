"""The gradient check: which gradients hold inf or NaN, their global norm,
and the one decision a step takes from that (apply or skip).

Contract: `check_gradients(grads)` reads every gradient once and returns
per-gradient non-finite flags, the global norm, and whether all are finite;
`decision(checked, flags, replicas)` is the only place that turns flags into
the step's decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from mp_callbacks._backend import tf

__all__ = ["CheckedGradients", "applied_norm", "check_gradients", "decision", "nonfinite_flag"]


class CheckedGradients(NamedTuple):
    """What one pass over the gradients found (see `check_gradients`)."""

    flags: tf.Tensor  #: int64 [n]: 1 where a gradient holds inf or NaN
    global_norm: tf.Tensor  #: float32: global L2 norm (meaningful when all flags are 0)
    #: bool: True when every gradient is finite (all flags 0), given
    #: directly so that the skip decision does not wait on the flags.
    all_finite: tf.Tensor | None = None


def _dense(value: Any) -> Any:
    return value.values if isinstance(value, tf.IndexedSlices) else value


def half_sum_of_squares(grad: Any) -> tf.Tensor:
    """sum(grad**2) / 2 in float32, one fused kernel (L2Loss); 0 for None."""
    if grad is None:
        return tf.constant(0.0, tf.float32)
    grad = _dense(grad)
    if grad.dtype != tf.float32:
        grad = tf.cast(grad, tf.float32)  # float16 squares overflow at 256
    return tf.nn.l2_loss(grad)


def nonfinite_flag(value: Any) -> tf.Tensor:
    """1 if `value` holds any inf or NaN, else 0 (int64; 0 for None; the
    largest flag for a list of losses)."""
    if value is None:
        return tf.constant(0, tf.int64)
    if isinstance(value, (list, tuple)):
        flags = [nonfinite_flag(v) for v in value]
        return flags[0] if len(flags) == 1 else tf.reduce_max(tf.stack(flags))
    return tf.cast(tf.logical_not(tf.reduce_all(tf.math.is_finite(_dense(value)))), tf.int64)


def check_gradients(grads: Sequence[Any]) -> CheckedGradients:
    """One pass over `grads`: which hold inf or NaN, and their global norm.

    Each gradient is read once, by one fused sum-of-squares kernel, which
    gives the norm and, since inf and NaN propagate through it, finiteness.
    Only when the total is not finite (an overflow, or squares beyond
    float32's range) does a second, exact pass run, inside a `tf.cond`, to
    tell which gradients hold inf or NaN; healthy steps never pay for it.
    """
    grads = list(grads)
    if not grads:
        return CheckedGradients(tf.zeros([0], tf.int64), tf.constant(0.0, tf.float32), tf.constant(True))
    # The sums are non-negative: their total is finite only if each is.
    total = tf.add_n([half_sum_of_squares(g) for g in grads])

    def exact_check() -> tuple[tf.Tensor, tf.Tensor]:
        flags = tf.stack([nonfinite_flag(g) for g in grads])
        return flags, tf.equal(tf.reduce_max(flags), 0)

    flags, all_finite = tf.cond(
        tf.math.is_finite(total),
        lambda: (tf.zeros([len(grads)], tf.int64), tf.constant(True)),
        exact_check,
    )
    return CheckedGradients(flags, tf.sqrt(2.0 * total), all_finite)


def decision(checked: CheckedGradients | None, flags: tf.Tensor, replicas: int = 1) -> tf.Tensor:
    """True when the step's update applies: every gradient finite.

    `flags` are the step's per-variable flags followed by the loss's,
    all-reduced across replicas. With one replica the check's own answer is
    taken, so that the updates do not wait on the flags' reduction.
    """
    if replicas == 1 and checked is not None and checked.all_finite is not None:
        return checked.all_finite
    return tf.equal(tf.reduce_sum(flags[:-1]), 0)


def applied_norm(checked: CheckedGradients, grads: list[Any], variables: list[Any]) -> tf.Tensor:
    """The global norm of the gradients, leaving out float8 state variables,
    whose "gradients" are their next values."""
    overwrite = [bool(getattr(v, "overwrite_with_gradient", False)) for v in variables]
    if not any(overwrite):
        return checked.global_norm
    squares = [half_sum_of_squares(g) for g, skip in zip(grads, overwrite) if not skip]
    if not squares:
        return tf.constant(0.0, tf.float32)
    return tf.sqrt(2.0 * tf.add_n(squares))
