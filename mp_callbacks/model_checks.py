"""`check_model`: the usual mixed-precision model mistakes (and their
troubleshooting) as a check that names the layer at fault."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mp_callbacks._backend import keras
from mp_callbacks._loss_scale_source import LossScaleSource

__all__ = ["Finding", "check_model"]

_LOW_PRECISION = ("float16", "bfloat16")
_SQUASHING = ("softmax", "sigmoid", "log_softmax")
_NORMALIZATION = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
    keras.layers.UnitNormalization,
)


@dataclass(frozen=True)
class Finding:
    """One problem found in a model.

    Attributes:
        layer: name of the layer at fault (the model's name for model-wide
            findings).
        kind: `"output_dtype"`, `"low_precision_output_op"`,
            `"tensor_core_alignment"` or `"missing_loss_scale"`.
        message: what is wrong and what to do.
    """

    layer: str
    kind: str
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.layer}: {self.message}"


def _compute_dtype(layer: Any) -> str | None:
    return getattr(layer, "compute_dtype", None)


def _activation_name(layer: Any) -> str | None:
    if isinstance(layer, keras.layers.Softmax):
        return "softmax"
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", None)
    return name if name in _SQUASHING else None


def _output_layers(model: keras.Model) -> list[Any]:
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return []
    layers = []
    for tensor in outputs or []:
        history = getattr(tensor, "_keras_history", None)
        if history is not None and history[0] not in layers:
            layers.append(history[0])
    return layers


def _is_pass_through(layer: Any) -> bool:
    """Layers that only cast or copy: what they get is what the loss gets."""
    if isinstance(layer, keras.layers.Identity):
        return True
    activation = getattr(layer, "activation", None)
    return isinstance(layer, keras.layers.Activation) and getattr(activation, "__name__", "") == "linear"


def _parents(layer: Any) -> list[Any]:
    parents = []
    for node in getattr(layer, "_inbound_nodes", []):
        for tensor in getattr(node, "input_tensors", []):
            history = getattr(tensor, "_keras_history", None)
            if history is not None and history[0] not in parents:
                parents.append(history[0])
    return parents


def _layers_feeding_loss(output_layers: list[Any]) -> list[Any]:
    """The output layers, and behind pass-through ones (a float32 cast
    after a softmax) the layers whose values reach the loss unchanged."""
    found, frontier = [], list(output_layers)
    while frontier:
        layer = frontier.pop(0)
        if layer in found:
            continue
        found.append(layer)
        if _is_pass_through(layer):
            frontier.extend(_parents(layer))
    return found


def _size_of(layer: Any) -> tuple[str, int] | None:
    for attribute in ("units", "filters"):
        value = getattr(layer, attribute, None)
        if isinstance(value, int):
            return attribute, value
    return None


def check_model(model: keras.Model) -> list[Finding]:
    """Checks a model for mixed-precision mistakes; returns the findings.

    * a model output that is not float32 under a mixed policy (softmax
      outputs must be float32);
    * a softmax, sigmoid or normalization computed in float16/bfloat16 that
      feeds the loss: it produces a model output, directly or through
      pass-through layers (a float32 `Activation("linear")` cast after a
      float16 softmax still feeds the loss a float16 softmax);
    * hidden layers whose size (units, filters) is not a multiple of 8,
      which Tensor Cores need for full speed (output sizes are set by the
      task and are not reported);
    * float16 computation with no loss scale.

    A correct model gives an empty list. Layers are named in each finding.
    """
    findings: list[Finding] = []
    layers = [layer for layer in model._flatten_layers(include_self=False)]
    low_precision = [layer for layer in layers if _compute_dtype(layer) in _LOW_PRECISION]
    if not low_precision and _compute_dtype(model) not in _LOW_PRECISION:
        return findings

    output_layers = _output_layers(model)
    for tensor, layer in zip(getattr(model, "outputs", None) or [], output_layers):
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if dtype != "float32":
            findings.append(Finding(
                layer.name, "output_dtype",
                f"model output is {dtype} under a mixed policy; give this layer "
                "dtype='float32' (or add keras.layers.Activation('linear', "
                "dtype='float32') after it) so the loss is computed in float32.",
            ))
    for layer in _layers_feeding_loss(output_layers):
        dtype = _compute_dtype(layer)
        if dtype not in _LOW_PRECISION:
            continue
        operation = _activation_name(layer)
        if operation is None and isinstance(layer, _NORMALIZATION):
            operation = type(layer).__name__
        if operation is not None:
            findings.append(Finding(
                layer.name, "low_precision_output_op",
                f"{operation} is computed in {dtype} and feeds the loss; it "
                "saturates and loses precision there. Give this layer "
                "dtype='float32'.",
            ))

    for layer in low_precision:
        if layer in output_layers:
            continue
        size = _size_of(layer)
        if size is not None and size[1] % 8:
            attribute, value = size
            findings.append(Finding(
                layer.name, "tensor_core_alignment",
                f"{attribute}={value} is not a multiple of 8; Tensor Cores (and "
                f"AMX tiles) run at full speed only on multiples of 8: try "
                f"{attribute}={-(-value // 8) * 8}.",
            ))

    if any(_compute_dtype(layer) == "float16" for layer in low_precision):
        source = LossScaleSource.of(model)
        # An uncompiled model has not chosen its loss scale yet.
        compiled = getattr(model, "optimizer", None) is not None or source.loss_scale is not None
        missing = compiled and not source.active
        if missing:
            findings.append(Finding(
                model.name, "missing_loss_scale",
                "layers compute in float16 but no loss scale is in use: small "
                "gradients underflow to zero. Use loss_scale='auto' or a "
                "DynamicLossScale.",
            ))
    return findings
