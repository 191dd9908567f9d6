"""The one unscaling rule, for every backend and every entry point.

A gradient of the scaled loss is divided by the scale once, in its own
dtype; None passes through; and the "gradients" of variables that Keras
overwrites with their gradient (`overwrite_with_gradient`: a float8
layer's scales and amax histories, whose "gradient" is their next value)
are never divided. `MixedPrecisionModel`'s step, `LossScaler.unscale`, the
backends' `LossScaling.unscale` and `LossScaleOptimizer` all call `unscale`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mp_callbacks._backend import keras

__all__ = ["overwrites_with_gradient", "unscale"]

ops = keras.ops


def overwrites_with_gradient(variable: Any) -> bool:
    """float8 layers' scale and amax-history variables: their "gradient" is
    their next value, which must be neither unscaled nor optimized."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def unscale(grads: Sequence[Any], scale: Any, variables: Sequence[Any] | None = None) -> list[Any]:
    """Each gradient in `grads` times 1/`scale`, in its own dtype, but the
    gradients of `variables` (paired in order) that `overwrites_with_gradient`
    and None, which pass through. A sparse gradient (TensorFlow's
    `IndexedSlices`) keeps its indices."""
    grads = list(grads)
    keep = [False] * len(grads) if variables is None else [overwrites_with_gradient(v) for v in variables]
    if len(keep) != len(grads):
        raise ValueError(
            f"unscale: got {len(grads)} gradients for {len(keep)} variables; pass the variables "
            "the gradients were computed for, in the same order."
        )
    inverse = 1.0 / scale
    by_dtype: dict[Any, Any] = {}  # one cast of 1/scale per dtype, not one per gradient

    def times_inverse(values: Any) -> Any:
        if values.dtype not in by_dtype:
            by_dtype[values.dtype] = ops.cast(inverse, values.dtype)
        return values * by_dtype[values.dtype]

    unscaled: list[Any] = []
    for grad, kept in zip(grads, keep):
        if grad is None or kept:
            unscaled.append(grad)
        elif hasattr(grad, "indices") and hasattr(grad, "dense_shape"):
            unscaled.append(type(grad)(times_inverse(grad.values), grad.indices, grad.dense_shape))
        else:
            unscaled.append(times_inverse(grad))
    return unscaled
