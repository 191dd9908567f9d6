"""float8 layers' delayed-scaling state, checked where training starts.

Keras's `quantize("float8")` keeps, per quantized tensor, an amax history
whose maximum sets the next scale. One inf or NaN in it makes that maximum
non-finite, and the scale then stays as it was until the value rolls out,
up to 1024 steps later. A step never writes one (a non-finite step is
skipped); a checkpoint of a run that diverged elsewhere can carry one in.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from mp_callbacks._backend import keras
from mp_callbacks.errors import MixedPrecisionWarning

__all__ = ["gradient_state", "repair_amax_histories"]

#: The float8 state that records *scaled* gradients under a loss scale:
#: the output gradient's scale and amax history (E5M2).
_GRADIENT_STATE = ("outputs_grad_scale", "outputs_grad_amax_history")


def _amax_histories(model: Any) -> list[Any]:
    return [
        v
        for v in model.variables
        if getattr(v, "overwrite_with_gradient", False) and v.name.endswith("amax_history")
    ]


def gradient_state(variables: Any) -> list[int]:
    """The positions in `variables` of float8 layers' output-gradient scale
    and amax history: under a loss scale they hold values of the scaled
    gradients, so when the scale changes by a factor they must follow it
    (else, for up to 1024 steps, E5M2's scale is set from a maximum on the
    old footing: a binade or more off, saturating or underflowing)."""
    return [
        i
        for i, v in enumerate(variables)
        if getattr(v, "overwrite_with_gradient", False) and v.name.endswith(_GRADIENT_STATE)
    ]


def repair_amax_histories(model: Any) -> list[str]:
    """Sets every inf or NaN in `model`'s float8 amax histories to 0 (a new
    history's value) and warns, naming each repaired history by its path;
    returns those paths. One host read of each history, none without
    float8 layers."""
    repaired = []
    for variable in _amax_histories(model):
        values = np.asarray(keras.ops.convert_to_numpy(variable.value))
        bad = ~np.isfinite(values)
        if bad.any():
            variable.assign(np.where(bad, 0, values).astype(values.dtype))
            repaired.append(f"{variable.path} ({int(bad.sum())} of {values.size})")
    if repaired:
        warnings.warn(
            MixedPrecisionWarning(
                "float8 amax histories held inf or NaN values (a checkpoint of a run that diverged?): "
                + ", ".join(repaired)
                + ". They were set to 0, a new history's value, so that each layer's scale follows its "
                "finite values again instead of staying frozen until they roll out (up to 1024 steps)."
            ),
            stacklevel=3,
        )
    return [entry.split(" (")[0] for entry in repaired]
