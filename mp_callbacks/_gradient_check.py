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

from mp_callbacks._backend import BACKEND, counter_dtype, keras, tf
from mp_callbacks._unscale import overwrites_with_gradient

__all__ = [
    "CheckedGradients",
    "applied_norm",
    "check_gradients",
    "decision",
    "nonfinite_flag",
]


ops = keras.ops
_FLAG = counter_dtype()


def _total(values: list[Any]) -> Any:
    """The sum of scalar tensors (one AddN on TensorFlow)."""
    if BACKEND == "tensorflow":
        return tf.add_n(values)
    return ops.sum(ops.stack(values))


class CheckedGradients(NamedTuple):
    """What one pass over the gradients found (see `check_gradients`)."""

    flags: Any  #: int64 (int32 on JAX) [n]: 1 where a gradient holds inf or NaN
    global_norm: Any  #: float32: global L2 norm (meaningful when all flags are 0)
    #: bool: True when every gradient is finite (all flags 0), given
    #: directly so that the skip decision does not wait on the flags.
    all_finite: Any = None


def _dense(value: Any) -> Any:
    if BACKEND == "tensorflow" and isinstance(value, tf.IndexedSlices):
        return value.values
    return value


def half_sum_of_squares(grad: Any) -> Any:
    """sum(grad**2) / 2 in float32 (one fused kernel: L2Loss on
    TensorFlow, a dot product elsewhere); 0 for None."""
    if grad is None:
        return ops.zeros((), "float32")
    grad = _dense(grad)
    if grad.dtype != "float32":
        grad = ops.cast(grad, "float32")  # float16 squares overflow at 256
    if BACKEND == "tensorflow":
        return tf.nn.l2_loss(grad)
    # A dot product, not sum(square(grad)): XLA would share that square
    # with an optimizer's own g * g (Adagrad's, Adam's) and no longer
    # contract the update into one fused multiply-add, an ulp off stock.
    flat = ops.reshape(grad, (-1,))
    return 0.5 * ops.dot(flat, flat)


def nonfinite_flag(value: Any) -> Any:
    """1 if `value` holds any inf or NaN, else 0 (int64, int32 on JAX; 0
    for None; the largest flag for a list of losses)."""
    if value is None:
        return ops.zeros((), _FLAG)
    if isinstance(value, (list, tuple)):
        flags = [nonfinite_flag(v) for v in value]
        return flags[0] if len(flags) == 1 else ops.max(ops.stack(flags))
    return ops.cast(ops.logical_not(ops.all(ops.isfinite(_dense(value)))), _FLAG)


def check_gradients(grads: Sequence[Any]) -> CheckedGradients:
    """One pass over `grads`: which hold inf or NaN, and their global norm.

    Each gradient is read once, by one fused sum-of-squares kernel, which
    gives the norm and, since inf and NaN propagate through it, finiteness.
    Only when the total is not finite (an overflow, or squares beyond
    float32's range) does a second, exact pass run, inside a `tf.cond`, to
    tell which gradients hold inf or NaN; healthy steps never pay for it.
    On JAX one variadic reduction per gradient gives its sum of squares and
    its exact finiteness together, so there is no second pass at all.
    """
    grads = list(grads)
    if not grads:
        return CheckedGradients(ops.zeros([0], _FLAG), ops.zeros((), "float32"), ops.convert_to_tensor(True))
    if BACKEND == "jax":
        return _check_in_one_read(grads)
    # The sums are non-negative: their total is finite only if each is.
    total = _total([half_sum_of_squares(g) for g in grads])

    def exact_check() -> tuple[Any, Any]:
        flags = ops.stack([nonfinite_flag(g) for g in grads])
        return flags, ops.equal(ops.max(flags), 0)

    flags, all_finite = ops.cond(
        ops.isfinite(total),
        lambda: (ops.zeros([len(grads)], _FLAG), ops.convert_to_tensor(True)),
        exact_check,
    )
    return CheckedGradients(flags, ops.sqrt(2.0 * total), all_finite)


def _square_sum_and_finite(grad: Any) -> tuple[Any, Any]:
    """sum(grad**2) in float32 and whether every element is finite, from
    one read of `grad` (one variadic reduction; JAX only)."""
    import jax

    flat = ops.reshape(ops.cast(grad, "float32"), (-1,))  # float16 squares overflow at 256
    return jax.lax.reduce(
        (flat * flat, jax.numpy.isfinite(flat)),
        (jax.numpy.float32(0.0), jax.numpy.bool_(True)),
        lambda a, b: (a[0] + b[0], jax.numpy.logical_and(a[1], b[1])),
        (0,),
    )


def _check_in_one_read(grads: list[Any]) -> CheckedGradients:
    """`check_gradients` on JAX: exact per-gradient flags and the norm from
    one read of each gradient on every step, with no conditional. (A
    conditional holding the gradients keeps XLA from fusing the check into
    the kernels that make them: one more pass over them on ResNet50 with
    SGD, by XLA's byte count.)"""
    checked = [_square_sum_and_finite(g) for g in grads if g is not None]
    finite = iter(f for _, f in checked)
    flags = ops.stack(
        [ops.zeros((), _FLAG) if g is None else ops.cast(ops.logical_not(next(finite)), _FLAG) for g in grads]
    )
    total = _total([s for s, _ in checked]) if checked else ops.zeros((), "float32")
    return CheckedGradients(flags, ops.sqrt(total), ops.equal(ops.max(flags), 0))


def decision(checked: CheckedGradients | None, flags: Any, replicas: int = 1) -> Any:
    """True when the step's update applies: every gradient finite.

    `flags` are the step's per-variable flags followed by the loss's,
    all-reduced across replicas. With one replica the check's own answer is
    taken, so that the updates do not wait on the flags' reduction.
    """
    if replicas == 1 and checked is not None and checked.all_finite is not None:
        return checked.all_finite
    return ops.equal(ops.sum(flags[:-1]), 0)


def applied_norm(checked: CheckedGradients, grads: list[Any], variables: list[Any]) -> Any:
    """The global norm of the gradients, leaving out float8 state variables,
    whose "gradients" are their next values."""
    overwrite = [overwrites_with_gradient(v) for v in variables]
    if not any(overwrite):
        return checked.global_norm
    squares = [half_sum_of_squares(g) for g, skip in zip(grads, overwrite) if not skip]
    if not squares:
        return ops.zeros((), "float32")
    return ops.sqrt(2.0 * _total(squares))
