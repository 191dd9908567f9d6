"""An estimate of one training step's memory, from shapes and dtypes.

On a CPU, the process's peak resident memory is mostly TensorFlow itself
and barely moves with the dtype policy. What mixed precision does change,
on any device, is the size of what a step holds: weights, their gradients,
the optimizer's slots and each layer's activations for one batch. This
module adds those up from the model's own variables and layer outputs.
It is an estimate (no allocator, no temporaries, no fused ops), labelled
as such wherever it is shown.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["estimate_step_memory"]

_MB = 2**20


def _dtype_name(dtype) -> str:
    name = getattr(dtype, "name", None) or str(dtype)
    return "bfloat16" if "bfloat16" in name else name


def _itemsize(dtype) -> int:
    name = _dtype_name(dtype)
    return 2 if name == "bfloat16" else np.dtype(name).itemsize


def _variable_bytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * _itemsize(v.dtype) for v in variables)


def _nested_layers(model) -> list:
    """Every layer of `model` and of the models nested in it (public
    `layers`: only layers of a graph have outputs to read)."""
    found = []
    for layer in getattr(model, "layers", []):
        found.append(layer)
        found.extend(_nested_layers(layer))
    return found


def _activation_bytes(model, batch_size: int) -> int | None:
    """Bytes of every layer's output for one batch, or None when the model
    has no symbolic outputs to read (a subclassed model)."""
    import keras

    import mp_callbacks  # noqa: F401  (checks Keras's backend first)

    total = 0
    seen = False
    for layer in _nested_layers(model):
        if type(layer).__name__ == "InputLayer":
            continue
        try:
            outputs = layer.output
        except (AttributeError, ValueError):
            continue
        for tensor in keras.tree.flatten(outputs):
            shape = tuple(tensor.shape)
            if not shape or any(d is None for d in shape[1:]):
                continue
            seen = True
            total += batch_size * int(np.prod(shape[1:])) * _itemsize(tensor.dtype)
    return total if seen else None


def estimate_step_memory(model, batch_size: int) -> dict[str, Any]:
    """Megabytes held by one training step of a built model: `weights`,
    `gradients`, `optimizer` (its slots, once built), `activations` (each
    layer's output for one batch, None for subclassed models) and `total`."""
    weights = _variable_bytes(model.weights)
    gradients = _variable_bytes(model.trainable_weights)
    optimizer = getattr(model, "optimizer", None)
    slots = (
        _variable_bytes([v for v in getattr(optimizer, "variables", []) if len(v.shape) > 0])
        if optimizer is not None
        else 0
    )
    activations = _activation_bytes(model, batch_size)
    parts = {
        "weights": weights / _MB,
        "gradients": gradients / _MB,
        "optimizer": slots / _MB,
        "activations": None if activations is None else activations / _MB,
    }
    parts["total"] = sum(value for value in parts.values() if value is not None)
    return {key: None if value is None else round(value, 3) for key, value in parts.items()}
