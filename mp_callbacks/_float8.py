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

import ml_dtypes
import numpy as np

from mp_callbacks._backend import BACKEND, keras
from mp_callbacks.errors import MixedPrecisionWarning

__all__ = ["float8_layers", "gradient_state", "repair_amax_histories", "tensor_figures", "variable_values"]

#: The float8 state that records *scaled* gradients under a loss scale:
#: the output gradient's scale and amax history (E5M2).
_GRADIENT_STATE = ("outputs_grad_scale", "outputs_grad_amax_history")


def variable_values(variable: Any) -> np.ndarray:
    """A variable's value in NumPy (its backend value's own `numpy()`: NumPy
    2 warns on converting a TensorFlow variable)."""
    if BACKEND == "tensorflow":
        return np.asarray(variable.value.numpy())
    return np.asarray(keras.ops.convert_to_numpy(variable.value))


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
        values = variable_values(variable)
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


#: The element formats of Keras's float8 layers, by quantized tensor.
FORMATS = {"inputs": "float8_e4m3fn", "kernel": "float8_e4m3fn", "outputs_grad": "float8_e5m2"}
#: A float8 tensor is said to saturate when more than this share of its
#: values is clipped.
FLOAT8_SATURATION_WARNING = 0.05
#: MX blocks (OCP Microscaling): 32 elements share a power-of-two scale.
MX_BLOCK = 32


def _quantized(values: np.ndarray, scale: float, dtype: Any) -> np.ndarray:
    """Keras's `quantize_and_dequantize` of `values` / `scale`, on the host."""
    top = float(ml_dtypes.finfo(dtype).max)
    return np.clip(values / scale, -top, top).astype(dtype).astype(np.float32)


def _underflow(values: np.ndarray, quantized: np.ndarray) -> float:
    nonzero = values != 0
    count = int(nonzero.sum())
    return float((nonzero & (quantized == 0)).sum()) / count if count else 0.0


def tensor_figures(values: Any, scale: float, format_name: str) -> dict[str, float]:
    """What quantizing `values` with Keras's delayed `scale` does, and what
    two other recipes would do with the same values:

    - `saturation`: share of the values beyond the format's range at this
      scale (clipped: no inf, no skip, silently wrong);
    - `underflow`: share of the nonzero values that quantize to 0;
    - `amax_ratio`: the values' amax over the amax the scale was computed
      from (`scale` times the format's max): above 1 saturates;
    - `current_underflow`: the underflow with a scale from these values'
      own amax (per-tensor current scaling: nothing saturates);
    - `mx_underflow`: the underflow with a power-of-two scale per block of
      32 values (MX, OCP Microscaling)."""
    dtype = getattr(ml_dtypes, format_name)
    top = float(ml_dtypes.finfo(dtype).max)
    flat = np.asarray(values, dtype=np.float32).ravel()
    amax = float(np.max(np.abs(flat))) if flat.size else 0.0
    figures = {
        "saturation": float(np.mean(np.abs(flat / scale) > top)) if flat.size else 0.0,
        "underflow": _underflow(flat, _quantized(flat, scale, dtype)),
        "amax_ratio": amax / (scale * top) if scale > 0 else float("inf"),
    }
    figures["current_underflow"] = _underflow(flat, _quantized(flat, amax / top, dtype)) if amax > 0 else 0.0
    padded = np.concatenate([flat, np.zeros((-flat.size) % MX_BLOCK, np.float32)]).reshape(-1, MX_BLOCK)
    block_amax = np.max(np.abs(padded), axis=1, keepdims=True)
    emax = int(np.floor(np.log2(top)))
    with np.errstate(divide="ignore"):
        exponent = np.where(
            block_amax > 0, np.floor(np.log2(np.where(block_amax > 0, block_amax, 1.0))) - emax, 0
        )
    blocks = np.power(2.0, exponent).astype(np.float32)
    mx = (np.clip(padded / blocks, -top, top).astype(dtype).astype(np.float32)).ravel()[: flat.size]
    figures["mx_underflow"] = _underflow(flat, mx)
    return figures


def float8_layers(model: Any) -> list[Any]:
    """`model`'s layers that `quantize("float8")` made float8 (Dense, EinsumDense)."""
    from mp_callbacks._keras_internals import all_layers

    return [layer for layer in all_layers(model) if getattr(layer, "quantization_mode", None) == "float8"]
