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
