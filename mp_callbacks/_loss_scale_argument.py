"""The one parser of a `loss_scale=` argument, for every backend.

`MixedPrecisionModel(loss_scale=...)`, `set_loss_scale` and
`LossScaleOptimizer(loss_scale=...)` take the same values with the same
meanings on TensorFlow and JAX; the backend's `LossScaler` class comes in
as an argument.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from mp_callbacks._scale_state import check_fixed_scale
from mp_callbacks._validation import fail

__all__ = ["AUTO", "scaler_from_argument"]

AUTO = "auto"
_REQUIREMENT = "'auto', a LossScaler, a number in [2**-24, 2**64] (fixed scale) or None (no scaling)"


def scaler_from_argument(value: Any, scaler_class: Any, owner: str = "MixedPrecisionModel") -> Any:
    """A `loss_scale` argument as a `scaler_class` object.

    "auto" gives None (the model decides at compile); None, no scaling (a
    fixed scale of 1, non-finite steps still skipped); a LossScaler, itself;
    its config dict, or the dict Keras serializes it to, a new one; a number
    in [2**-24, 2**64], a fixed scale. Anything else raises, naming
    `loss_scale` and `owner`."""
    if isinstance(value, str):
        if value != AUTO:
            fail(owner, "loss_scale", value, _REQUIREMENT)
        return None
    if value is None:
        return scaler_class.disabled()
    if isinstance(value, scaler_class):
        return value
    if isinstance(value, dict) and value:
        config = value["config"] if "class_name" in value else value
        try:
            return scaler_class.from_config(dict(config))
        except TypeError:
            fail(owner, "loss_scale", value, _REQUIREMENT, TypeError)
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return scaler_class.fixed(check_fixed_scale(owner, "loss_scale", value))
    fail(owner, "loss_scale", value, _REQUIREMENT, TypeError)
