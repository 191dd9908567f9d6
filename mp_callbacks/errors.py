"""Exceptions and warning categories of mp_callbacks."""

from __future__ import annotations

__all__ = [
    "BackendNotSupportedError",
    "MixedPrecisionWarning",
    "NonFiniteGradientError",
    "UnsupportedArgumentError",
]


class MixedPrecisionWarning(UserWarning):
    """Something in mixed-precision training needs the user's attention."""


class UnsupportedArgumentError(TypeError, ValueError):
    """An unknown keyword argument: a `TypeError` as Python (and tf.keras)
    raises it, and a `ValueError` as Keras 3's `LossScaleOptimizer` does."""


class BackendNotSupportedError(NotImplementedError):
    """A feature of mp_callbacks that the running Keras backend does not
    have yet; the message names the backend and the alternative."""


#: Where each public name that does not run on every backend runs, and what
#: to use instead on the others.
_ALTERNATIVES = {
    "LossScaleOptimizer": (
        "TensorFlow and JAX backends",
        "on torch, mp_callbacks.MixedPrecisionModel scales the loss and skips non-finite steps "
        "(its loss_scaling() serves a train_step of your own), or use Keras's own "
        "keras.optimizers.LossScaleOptimizer",
    ),
}


def not_on_this_backend(name: str, backend: str) -> BackendNotSupportedError:
    """The error for a public name that does not run on `backend` yet."""
    where, alternative = _ALTERNATIVES.get(
        name, ("TensorFlow backend", f"for {name}, set KERAS_BACKEND=tensorflow")
    )
    return BackendNotSupportedError(
        f"mp_callbacks.{name} runs on Keras's {where}, not yet on {backend!r}, the "
        f"backend Keras is running on. The rest of mp_callbacks runs there (the backends page of "
        f"the docs lists what runs where); {alternative}."
    )


class NonFiniteGradientError(RuntimeError):
    """Training diverged: gradients (or the loss) stayed non-finite.

    Attributes:
        variables: paths of the variables whose gradients were non-finite,
            in the model's forward order.
        origin: the layer where non-finite values first appear: found by
            replaying the batch of the last skipped step (`report`), the
            forward-pass origin when the loss was not finite, else the
            backward-pass origin; "loss" when every layer output was finite
            but the loss was not. Without a kept batch (a stock model, or
            under tf.distribute), the layer nearest the loss among the
            variables with non-finite gradients.
        step: the global training step at which divergence was detected.
        scale: the loss scale at that step.
        report: the `PrecisionReport` of the replayed batch, or None.
    """

    def __init__(
        self,
        message: str,
        variables: list[str] | None = None,
        origin: str | None = None,
        step: int | None = None,
        scale: float | None = None,
        report: object | None = None,
    ) -> None:
        super().__init__(message)
        self.report = report
        self.variables = list(variables or [])
        self.origin = origin
        self.step = step
        self.scale = scale
