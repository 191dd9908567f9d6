"""Exceptions and warning categories of mp_callbacks."""

from __future__ import annotations

__all__ = ["MixedPrecisionWarning", "NonFiniteGradientError"]


class MixedPrecisionWarning(UserWarning):
    """Something in mixed-precision training needs the user's attention."""


class NonFiniteGradientError(RuntimeError):
    """Training diverged: gradients (or the loss) stayed non-finite.

    Attributes:
        variables: paths of the variables whose gradients were non-finite,
            in the model's forward order.
        origin: the layer nearest the loss among them, where a non-finite
            value is most likely born (None when no gradient was non-finite,
            for example when only the loss was).
        step: the global training step at which divergence was detected.
        scale: the loss scale at that step.
    """

    def __init__(
        self,
        message: str,
        variables: list[str] | None = None,
        origin: str | None = None,
        step: int | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__(message)
        self.variables = list(variables or [])
        self.origin = origin
        self.step = step
        self.scale = scale
