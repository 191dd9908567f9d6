"""`diagnose_batch`: where, layer by layer, a batch overflows.

One batch is replayed through the model in its own dtype policy, eagerly,
with every layer's inputs and outputs recorded (each layer's `call` is
wrapped for the duration, so functional, Sequential and subclassed models
are all seen at the granularity of their layers). The forward pass names
the first layer whose output is not finite; the backward pass, at the
model's current loss scale, names the first layer (nearest the loss first)
whose gradient goes non-finite, weightless layers included. It costs two
forward passes (one with every layer in float32, for reference) and one
backward pass, only when asked for: `NaNGradientMonitor` calls it once, at
divergence, on the batch `MixedPrecisionModel` kept.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from mp_callbacks._backend import BACKEND, keras, tf
from mp_callbacks._float8 import (
    FLOAT8_SATURATION_WARNING,
    FORMATS,
    float8_layers,
    tensor_figures,
    variable_values,
)
from mp_callbacks._keras_internals import (
    all_layers,
    has_layer_graph,
    layer_calls_wrapped,
    layer_dtype_policy,
    seed_generators_of,
    set_layer_dtype_policy,
)
from mp_callbacks._layer_labels import layer_labels
from mp_callbacks._loss_scale_source import LossScaleSource

__all__ = [
    "FLOAT16_ADVICE_THRESHOLD",
    "OutputRange",
    "PrecisionReport",
    "diagnose_batch",
    "float8_figures",
    "layer_output_ranges",
]

#: A float16 layer whose largest output uses more than this share of
#: float16's range is advised to compute in float32.
FLOAT16_ADVICE_THRESHOLD = 0.5


def dtype_max(dtype: Any) -> float:
    """Largest finite value of a dtype (65504 for float16)."""
    name = keras.backend.standardize_dtype(dtype)
    if "float" in name:
        return float(ml_dtypes.finfo(name).max)
    return 1.0 if name == "bool" else float(np.iinfo(name).max)  # an integer layer (Hashing)


def dtype_tiny(dtype: Any) -> float:
    """Smallest normal value of a floating dtype (6.1e-5 for float16)."""
    name = keras.backend.standardize_dtype(dtype)
    if name == "bfloat16":
        return 2.0**-126  # bfloat16 has float32's exponent range
    return float(np.finfo(name).tiny)


@dataclass
class LayerRecord:
    """What one call of a layer did with the batch.

    `name` is the layer's label (its name, or its path where the name
    repeats), with `" (call 2)"` and so on for each further call of a layer
    called more than once (a tied embedding: the lookup, then the head);
    `layer` is the label alone, what a fix changes."""

    name: str
    compute_dtype: str
    activation_max: float
    output_finite: bool
    gradient_finite: bool | None = None
    inputs_finite: bool = True
    underflow: float | None = None
    gradient_max: float | None = None
    layer: str = ""

    def __post_init__(self) -> None:
        self.layer = self.layer or self.name


#: A low-precision layer is flagged when its own output differs from float32's
#: by more than this share (relative L2 error) on the same inputs. bfloat16
#: rounds each value by up to 2**-9 (0.2 %), float16 by 2**-12: ordinary
#: layers stay well under a percent.
MAX_RELATIVE_ERROR = 0.05


@dataclass
class PrecisionReport:
    """Per-layer precision figures for one batch.

    Attributes:
        first_nonfinite_layer: the first layer, in forward order, whose
            output is not finite (None if every output is finite).
        forward_origin: the first layer, in forward order, whose inputs are
            finite and whose output is not: where the forward pass first
            made non-finite values (None if every output is finite).
        first_nonfinite_gradient_layer: the first layer, in backward order
            (nearest the loss first), whose gradient output (with respect to
            its inputs or its own weights) is not finite, weightless layers
            included (None if every gradient is finite, or no loss could be
            computed).
        activation_max: layer name -> largest |output| (inf or nan when the
            output is not finite).
        headroom: layer name -> the share of the layer's compute dtype's
            finite range that its largest |output| uses (1.0 or more:
            overflow). Close to 1 means trouble is near.
        underflow: layer name -> the share of the gradient values with
            respect to the layer's output that lie at or below the smallest
            normal number of its compute dtype (zero included) at the
            current loss scale: the values that have lost precision or
            vanished.
        float32_layers: the advice: layers to compute in float32 (the
            origin, when it computes in float16 or bfloat16, and float16
            layers whose true inputs or outputs, from a float32 replay of
            the batch, use more than half of float16's range).
        loss: the unscaled loss of the batch (None without a loss).
        loss_finite: whether that loss is finite.
        loss_scale: the loss scale the backward pass used.
        origin: where non-finite values first appear: the forward origin
            when the loss is not finite (the first call whose inputs are
            finite and whose output is not: a layer whose own operations
            overflowed, not a sublayer that only received the result; or
            "loss" when every layer output is finite but the loss is not),
            else the backward origin.
        notes: what could not be seen (subclassed models' own operations,
            no loss).
        layers: the per-layer records, in forward order.
        reference_max: layer name -> largest |output| when the same batch
            runs with every layer in float32: the magnitude a layer that
            overflowed should have held.
        gradient_max: layer name -> largest |gradient| of the unscaled
            loss with respect to the layer's inputs, own weights or output.
        precision_loss: bfloat16 layer name -> the relative L2 error of its
            output against the same layer computed in float32 on the same
            inputs (bfloat16 keeps 8 significant bits: it loses precision
            where float16 overflows). A layer past `MAX_RELATIVE_ERROR` is
            in `float32_layers`.
        float8: float8 layer name -> {"inputs", "kernel", "outputs_grad":
            `HeadroomMonitor`'s figures for that tensor at the layer's
            current scale (`saturation`, `underflow`, `amax_ratio`, and
            the what-if `current_underflow` and `mx_underflow`),
            "history_nonfinite": bool}; the output gradient is the one the
            layer received in the batch's backward pass (the loss times the
            loss scale), quantized to E5M2.

    A layer whose name repeats in the model is named by its path
    (`block2/proj`).
    """

    first_nonfinite_layer: str | None
    first_nonfinite_gradient_layer: str | None
    activation_max: dict[str, float]
    headroom: dict[str, float]
    underflow: dict[str, float]
    float32_layers: list[str]
    loss: float | None
    loss_finite: bool
    loss_scale: float
    origin: str | None
    notes: list[str] = field(default_factory=list)
    layers: list[LayerRecord] = field(default_factory=list)
    reference_max: dict[str, float] = field(default_factory=dict)
    gradient_max: dict[str, float] = field(default_factory=dict)
    precision_loss: dict[str, float] = field(default_factory=dict)
    float8: dict[str, dict[str, Any]] = field(default_factory=dict)
    forward_origin: str | None = None

    def layer_of(self, name: str | None) -> str | None:
        """The layer a record's name belongs to: `"embedding"` for
        `"embedding (call 2)"`; other names (`"loss"`, None) as they are."""
        return next((record.layer for record in self.layers if record.name == name), name)

    def __str__(self) -> str:
        header = (
            "layer",
            "dtype",
            "max |output|",
            "in float32",
            "range used",
            "grad underflow",
            "output",
            "gradient",
        )
        rows = []
        for record in self.layers:
            rows.append(
                (
                    record.name,
                    record.compute_dtype,
                    f"{record.activation_max:.4g}",
                    f"{self.reference_max[record.name]:.4g}" if record.name in self.reference_max else "-",
                    (
                        f"{self.headroom[record.name]:.2%}"
                        if math.isfinite(self.headroom[record.name])
                        else "overflow"
                        if record.name == self.forward_origin
                        else "inherited"
                    ),
                    "-" if record.underflow is None else f"{record.underflow:.1%}",
                    "ok" if record.output_finite else "NON-FINITE",
                    "-"
                    if record.gradient_finite is None
                    else ("ok" if record.gradient_finite else "NON-FINITE"),
                )
            )
        widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
        lines = [
            "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header] + rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        loss_text = "n/a" if self.loss is None else f"{self.loss:.6g}"
        lines.append("")
        lines.append(f"loss: {loss_text} (loss scale {self.loss_scale:g})")
        lines.append(f"first non-finite output: {self.first_nonfinite_layer or 'none'}")
        if self.forward_origin != self.first_nonfinite_layer:
            lines.append(f"made non-finite by its own operations: {self.forward_origin}")
        lines.append(
            f"first non-finite gradient (backward order): {self.first_nonfinite_gradient_layer or 'none'}"
        )
        lost = {name: error for name, error in self.precision_loss.items() if error > MAX_RELATIVE_ERROR}
        if lost:
            lines.append(
                "bfloat16 precision lost: "
                + ", ".join(f"{name} ({error:.1%} relative error)" for name, error in lost.items())
            )
        saturated = [
            f"{name} {tensor} ({figures[tensor]['saturation']:.1%})"
            for name, figures in self.float8.items()
            for tensor in ("inputs", "kernel", "outputs_grad")
            if figures.get(tensor, {}).get("saturation", 0.0) > FLOAT8_SATURATION_WARNING
        ]
        if saturated:
            lines.append("float8 saturated (clipped, silently): " + ", ".join(saturated))
        if self.float32_layers:
            lines.append(
                "compute in float32: "
                + ", ".join(self.float32_layers)
                + "  (mp_callbacks.with_float32_layers(model, report.float32_layers))"
            )
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def _floating_tensors(structure: Any) -> list[Any]:
    return [
        t
        for t in keras.tree.flatten(structure)
        if keras.ops.is_tensor(t) and "float" in keras.backend.standardize_dtype(t.dtype)
    ]


def _size(tensor: Any) -> int:
    return int(np.prod(keras.ops.shape(tensor)))


def _all_finite(tensors: list[Any]) -> bool:
    return all(bool(keras.ops.all(keras.ops.isfinite(t))) for t in tensors)


def _abs_max(tensors: list[Any]) -> float:
    values = [keras.ops.max(keras.ops.abs(keras.ops.cast(t, "float32"))) for t in tensors if _size(t) > 0]
    if not values:
        return 0.0
    if not _all_finite(tensors):
        has_nan = any(bool(keras.ops.any(keras.ops.isnan(t))) for t in tensors)
        return math.nan if has_nan else math.inf
    return max(float(keras.ops.convert_to_numpy(v)) for v in values)  # detached (torch)


def _worst(first: float, second: float) -> float:
    """The larger magnitude, NaN winning (`max` would drop a NaN second)."""
    return math.nan if math.isnan(first) or math.isnan(second) else max(first, second)


def _own_trainable_weights(layer: Any) -> list[Any]:
    children = {id(w) for child in all_layers(layer) for w in child.trainable_weights}
    return [w for w in layer.trainable_weights if id(w) not in children]


def _inspected_layers(model: keras.Model) -> list[Any]:
    return [layer for layer in all_layers(model) if not isinstance(layer, keras.layers.InputLayer)]


def _traced(tensors: list[Any]) -> bool:
    """A layer called inside a JAX transformation's body (an RNN's cell
    under `lax.scan`): its values exist only there, its caller is recorded."""
    if BACKEND != "jax":
        return False
    from mp_callbacks.backends.jax.replay import is_traced

    return is_traced(tensors)


@contextlib.contextmanager
def recording_layers(
    model: keras.Model,
    tape: Any = None,
    arguments: list[tuple[Any, tuple, dict]] | None = None,
    watch_inputs: bool = True,
) -> Iterator[list[tuple[Any, list[Any], list[Any]]]]:
    """While active, every call of one of `model`'s layers appends
    `(layer, floating inputs, floating outputs)` to the yielded list (in
    order of completion: forward order), watching them on `tape` if given
    (the inputs only with `watch_inputs`),
    and `(layer, args, kwargs)` to `arguments` if given. The layers are
    restored on exit."""
    records: list[tuple[Any, list[Any], list[Any]]] = []

    def wrap(layer: Any, original: Any) -> Any:
        def recorded_call(*args: Any, **kwargs: Any) -> Any:
            inputs = _floating_tensors((args, kwargs))
            if tape is not None and watch_inputs:
                for tensor in inputs:
                    tape.watch(tensor)
            outputs = original(*args, **kwargs)
            flat_outputs = _floating_tensors(outputs)
            if _traced(inputs + flat_outputs):
                return outputs
            if tape is not None:
                for tensor in flat_outputs:
                    tape.watch(tensor)
            records.append((layer, inputs, flat_outputs))
            if arguments is not None:
                arguments.append((layer, args, kwargs))
            return outputs

        return recorded_call

    with layer_calls_wrapped(_inspected_layers(model), wrap):  # a quantized layer: its quantized_call
        yield records


@contextlib.contextmanager
def computing_in_float32(model: keras.Model, layers: list[Any] | None = None) -> Iterator[None]:
    """While active, every layer of `model` (or the given `layers`)
    computes in float32 (its dtype policy is swapped, then restored;
    variables are untouched)."""
    swapped = []
    for layer in _inspected_layers(model) if layers is None else layers:
        policy = layer_dtype_policy(layer)
        if policy is None or getattr(policy, "quantization_mode", None) is not None:
            continue  # quantized layers keep their own kernels
        swapped.append((layer, policy))
        set_layer_dtype_policy(layer, FLOAT32_POLICY())
    try:
        yield
    finally:
        for layer, policy in swapped:
            set_layer_dtype_policy(layer, policy)


def FLOAT32_POLICY() -> Any:
    return keras.dtype_policies.get("float32")


def _reference_ranges(model: keras.Model, x: Any) -> dict[str, tuple[float, float]]:
    """The batch in float32: layer name -> (largest |input|, largest |output|),
    the true magnitudes that a low-precision layer should have held."""
    ranges: dict[str, tuple[float, float]] = {}
    labels = layer_labels(model)
    with computing_in_float32(model), recording_layers(model) as records:
        model(x, training=True)
    for layer, inputs, outputs in records:
        label = labels.get(id(layer), layer.name)
        old_in, old_out = ranges.get(label, (0.0, 0.0))
        ranges[label] = (_worst(old_in, _abs_max(inputs)), _worst(old_out, _abs_max(outputs)))
    return ranges


class OutputRange(NamedTuple):
    """One layer's outputs on a batch (the worst over its calls)."""

    dtype: str  #: the layer's compute dtype
    largest: float  #: largest |output| (inf or nan when not finite)
    inputs_finite: bool  #: every input it was given was finite
    weights_finite: bool  #: every weight it holds is finite


def layer_output_ranges(model: keras.Model, x: Any) -> dict[str, OutputRange]:
    """Forward pass in inference mode: layer label (`_layer_labels`: its
    name, or its path where the name repeats) -> `OutputRange`."""
    labels = layer_labels(model)
    with recording_layers(model) as records:
        model(x, training=False)
    ranges: dict[str, OutputRange] = {}
    for layer, inputs, outputs in records:
        label = labels.get(id(layer), layer.name)
        value = _abs_max(outputs)
        dtype = str(getattr(layer, "compute_dtype", "float32"))
        previous = ranges.get(label)
        inputs_finite = _all_finite(inputs)
        if previous is not None:
            value = value if not value <= previous.largest else previous.largest
            inputs_finite = inputs_finite and previous.inputs_finite
        weights_finite = _all_finite(
            [w.value for w in layer.weights if "float" in keras.backend.standardize_dtype(w.dtype)]
        )
        ranges[label] = OutputRange(dtype, value, inputs_finite, weights_finite)
    return ranges


# What TensorFlow raises for an op without a gradient (in that dtype).
_NO_GRADIENT: tuple[type[Exception], ...] = (TypeError, LookupError, ValueError, NotImplementedError) + (
    (tf.errors.OpError,) if tf is not None else ()
)


#: One call of a layer in a replay: the layer, and its calls before it.
Call = tuple[Any, int]


def _gradient_targets(
    order: list[Call], calls: dict[tuple[int, int], tuple[list[Any], list[Any]]]
) -> tuple[list[tuple[Call, int, int, int]], list[Any]]:
    """(call, start, inputs and the layer's weights, outputs) spans into one
    target list; a layer's weights are in each of its calls' spans."""
    spans: list[tuple[Call, int, int, int]] = []
    targets: list[Any] = []
    for layer, index in order:
        inputs, outputs = calls[(id(layer), index)]
        ins = list(inputs) + _own_trainable_weights(layer)
        spans.append(((layer, index), len(targets), len(ins), len(outputs)))
        targets += ins + list(outputs)
    return spans, targets


def _gradients(
    tape: Any, loss: Any, targets: list[Any], spans: list[tuple[Any, int, int, int]], notes: list[str]
) -> list[Any]:
    """The gradients of `loss` for `targets`, span by span, leaving out
    (and naming in `notes`) those TensorFlow cannot compute."""
    gradients: list[Any] = [None] * len(targets)
    for (layer, _), start, n_in, n_out in spans:
        for first, count, what in ((start, n_in, "inputs"), (start + n_in, n_out, "outputs")):
            if not count:
                continue
            try:
                gradients[first : first + count] = tape.gradient(loss, targets[first : first + count])
            except _NO_GRADIENT as error:
                notes.append(
                    f"no gradient for the {what} of {layer.name!r} ({type(error).__name__}: {error})."
                )
    return gradients


def diagnose_batch(
    model: keras.Model,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    loss_scale: float | None = None,
) -> PrecisionReport:
    """Replays one batch layer by layer and reports where precision fails.

    Args:
        model: `keras.Model`. A built model (functional, Sequential or
            subclassed; compiled, for the backward pass).
        x: the batch's inputs, as for `model.fit`.
        y: the batch's targets. Defaults to None.
        sample_weight: the batch's sample weights. Defaults to None.
        loss_scale: float or None. The loss scale of the backward pass.
            Defaults to None: the model's current one (1.0 when it does
            not scale).

    Returns:
        A `PrecisionReport`; `str(report)` is a table.

    The batch runs in training mode, as in `fit`; state the forward pass
    updates (BatchNormalization's moving statistics, a weight that
    SpectralNormalization writes) is put back afterwards.

    Example:

    ```python
    import keras, numpy as np
    import mp_callbacks as mp

    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    outputs = keras.layers.Dense(1, name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    x = np.ones((8, 4), "float32")
    x[0, 0] = np.inf
    report = mp.diagnose_batch(model, x, np.zeros((8, 1), "float32"))
    print(report.first_nonfinite_layer, report.origin)  # hidden hidden
    ```
    """
    x, y, sample_weight = _as_tensors((x, y, sample_weight))
    if loss_scale is None:
        loss_scale = LossScaleSource.of(model).read_scale()
    notes: list[str] = []
    if not has_layer_graph(model):
        notes.append(
            f"{type(model).__name__} is subclassed: its sub-layers are inspected, but "
            "operations written directly in its call() between them are not."
        )
    # Weights too: a forward pass in training mode may write them
    # (SpectralNormalization writes its layer's kernel).
    forward_state = list(
        {id(v): v for v in model.trainable_variables + model.non_trainable_variables}.values()
    )
    saved_state = [v.numpy() for v in forward_state]

    reference: dict[str, tuple[float, float]] = {}
    try:
        reference = _reference_ranges(model, x)
    except Exception as error:  # the reference is advice, not the diagnosis
        notes.append(f"no float32 reference pass ({type(error).__name__}: {error}).")
    finally:
        for variable, value in zip(forward_state, saved_state):
            variable.assign(value)

    def forward(watch_inputs: bool) -> _Replay:
        return _replay(
            model, (x, y, sample_weight), loss_scale, list(zip(forward_state, saved_state)), watch_inputs
        )

    def traced() -> list[Any]:
        return _traced_gradients(
            model, (x, y, sample_weight), float(loss_scale), list(zip(forward_state, saved_state))
        )

    if BACKEND in ("jax", "torch"):
        backward = _backward_from_probes(model, x, y, sample_weight, float(loss_scale))
    else:
        backward = _backward_on_tensorflow(forward, notes, traced if float8_layers(model) else None)
    labels = layer_labels(model)
    called_again = {id(layer) for layer, index in backward.order if index > 0}
    layer_records = {}
    for layer, index in backward.order:
        inputs, outputs = backward.calls[(id(layer), index)]
        label = labels.get(id(layer), layer.name)
        layer_records[(id(layer), index)] = LayerRecord(
            name=f"{label} (call {index + 1})" if index > 0 else label,
            compute_dtype=str(getattr(layer, "compute_dtype", "float32")),
            activation_max=_abs_max(outputs),
            output_finite=_all_finite(outputs),
            inputs_finite=_all_finite(inputs),
            layer=label,
        )
        if index == 0 and id(layer) in called_again:
            layer_records[(id(layer), 0)].name = f"{label} (call 1)"
    if backward.loss is None:
        notes.append(
            "no loss was computed (pass y and compile the model): backward "
            "origin and underflow are not reported."
        )
    else:
        _note_gradients(layer_records, backward.spans, backward.gradients, float(loss_scale))
    ordered = [layer_records[(id(layer), index)] for layer, index in backward.order]
    loss = backward.loss
    precision_loss = _bfloat16_precision_loss(model, x, ordered, notes)
    report = _report(ordered, reference, None if loss is None else float(loss), float(loss_scale), notes)
    report.precision_loss = precision_loss
    report.float8 = _float8_report(model, x, backward, notes)
    lost = [name for name, error in precision_loss.items() if error > MAX_RELATIVE_ERROR]
    report.float32_layers += [name for name in lost if name not in report.float32_layers]
    return report


def _float8_report(
    model: keras.Model, x: Any, backward: _Backward, notes: list[str]
) -> dict[str, dict[str, Any]]:
    """`float8_figures` on the batch, with each float8 layer's output
    gradient from the backward pass (its first call) quantized at its
    `outputs_grad_scale`."""
    if not float8_layers(model):
        return {}
    try:
        figures = float8_figures(model, x)
    except Exception as error:  # advice, not the diagnosis
        notes.append(f"no float8 figures ({type(error).__name__}: {error}).")
        return {}
    labels = layer_labels(model)
    for (layer, index), start, n_in, n_out in backward.spans:
        label = labels.get(id(layer), layer.name)
        if index or label not in figures or not n_out:
            continue
        grads = [g for g in backward.gradients[start + n_in : start + n_in + n_out] if g is not None]
        if not grads:
            notes.append(
                f"no output gradient for float8 layer {label!r}: the backward pass did not reach it."
            )
        else:
            values = np.concatenate(
                [np.ravel(keras.ops.convert_to_numpy(keras.ops.cast(g, "float32"))) for g in grads]
            )
            scale = float(variable_values(layer.outputs_grad_scale))
            figures[label]["outputs_grad"] = tensor_figures(values, scale, FORMATS["outputs_grad"])
    return figures


def _bfloat16_precision_loss(
    model: keras.Model, x: Any, ordered: list[LayerRecord], notes: list[str]
) -> dict[str, float]:
    """Each bfloat16 layer's relative error against float32 on the batch
    (`layer_selection.own_precision_loss`); none without bfloat16 layers."""
    if not any(record.compute_dtype == "bfloat16" for record in ordered):
        return {}
    try:
        measured = own_precision_loss(model, x)
    except Exception as error:  # advice, not the diagnosis
        notes.append(f"no bfloat16 precision figures ({type(error).__name__}: {error}).")
        return {}
    return {name: loss.error for name, loss in measured.items() if loss.dtype == "bfloat16"}


class _Backward(NamedTuple):
    """The replayed calls of layers in forward order, each call's inputs
    and outputs, the loss and the gradients at every call's inputs, its
    layer's own weights and its outputs (laid out by `spans`; empty
    without a loss)."""

    order: list[Call]
    calls: dict[tuple[int, int], tuple[list[Any], list[Any]]]
    loss: Any
    spans: list[tuple[Call, int, int, int]]
    gradients: list[Any]


def _backward_on_tensorflow(forward: Any, notes: list[str], traced: Any = None) -> _Backward:
    """Every layer's inputs, own weights and outputs, in one backward pass
    on one persistent tape; with `traced` (a model with float8 layers,
    whose gradient Keras computes only in a traced function), that pass
    again inside a `tf.function`."""
    replay = forward(watch_inputs=True)
    if replay.loss is None:
        return _Backward(replay.order, replay.calls, None, [], [])
    spans, targets = _gradient_targets(replay.order, replay.calls)
    if traced is not None:
        try:
            gradients = traced()
            if len(gradients) == len(targets):
                return _Backward(replay.order, replay.calls, replay.loss, spans, gradients)
            notes.append("the traced backward pass called other layers than the replay; not used.")
        except Exception as error:  # the eager pass below, with its own notes
            notes.append(f"no traced backward pass ({type(error).__name__}: {error}).")
    try:
        gradients = replay.tape.gradient(replay.scaled_loss, targets) if targets else []
    except _NO_GRADIENT as error:
        # TensorFlow has no bfloat16 gradient for an augmentation
        # layer's image transform, which training never needs (no weights
        # are behind it): the same pass again, watching only outputs.
        notes.append(
            "no gradient for some layers' inputs "
            f"({type(error).__name__}: {error}); each layer's gradients are "
            "taken at its weights and outputs."
        )
        del replay
        replay = forward(watch_inputs=False)
        spans, targets = _gradient_targets(replay.order, replay.calls)
        gradients = _gradients(replay.tape, replay.scaled_loss, targets, spans, notes)
    return _Backward(replay.order, replay.calls, replay.loss, spans, gradients)


def _backward_from_probes(
    model: keras.Model, x: Any, y: Any, sample_weight: Any, loss_scale: float
) -> _Backward:
    """The same figures from the gradients at zero probes: `jax.grad` on
    JAX (which has no tape), `torch.autograd.grad` on torch."""
    if BACKEND == "jax":
        from mp_callbacks.backends.jax.replay import replay
    else:
        from mp_callbacks.backends.torch.replay import replay

    result = replay(model, _inspected_layers(model), x, y, sample_weight, loss_scale)
    order, calls = _calls_in_order([(call.layer, call.inputs, call.outputs) for call in result.calls])
    if result.loss is None:
        return _Backward(order, calls, None, [], [])
    spans, _ = _gradient_targets(order, calls)
    weight_index = {id(v): i for i, v in enumerate(model.trainable_variables)}
    gradients: list[Any] = []
    for position, (layer, _) in enumerate(order):  # result.calls is in the same order
        gradients += list(result.input_gradients[position])
        gradients += [result.weight_gradients[weight_index[id(w)]] for w in _own_trainable_weights(layer)]
        gradients += list(result.output_gradients[position])
    return _Backward(order, calls, result.loss, spans, gradients)


def _calls_in_order(
    records: list[tuple[Any, list[Any], list[Any]]],
) -> tuple[list[Call], dict[tuple[int, int], tuple[list[Any], list[Any]]]]:
    """Each recorded call in forward order, numbered within its layer."""
    order: list[Call] = []
    calls: dict[tuple[int, int], tuple[list[Any], list[Any]]] = {}
    seen: dict[int, int] = {}
    for layer, inputs, outputs in records:
        index = seen.get(id(layer), 0)
        seen[id(layer)] = index + 1
        order.append((layer, index))
        calls[(id(layer), index)] = (inputs, outputs)
    return order, calls


def _as_tensors(structure: Any) -> Any:
    """The arrays of `structure` as the backend's tensors (None kept)."""
    if tf is not None:  # tf.nest keeps strings and ragged inputs as TensorFlow reads them
        return tf.nest.map_structure(lambda v: tf.convert_to_tensor(v) if v is not None else v, structure)
    return keras.tree.map_structure(
        lambda v: keras.ops.convert_to_tensor(v) if v is not None else v, structure
    )


class _Replay(NamedTuple):
    """One recorded forward pass: its tape, losses and each call of a layer
    in forward order (a layer called twice has two)."""

    tape: Any
    loss: Any
    scaled_loss: Any
    order: list[Call]
    calls: dict[tuple[int, int], tuple[list[Any], list[Any]]]


def _replay(
    model: keras.Model, data: tuple, loss_scale: float, state: list[tuple[Any, Any]], watch_inputs: bool
) -> _Replay:
    """The batch's forward pass in training mode, every layer's inputs and
    outputs recorded, with the state it updates put back after."""
    x, y, sample_weight = data
    tape = tf.GradientTape(persistent=True)
    loss = scaled_loss = None
    try:
        with recording_layers(model, tape, watch_inputs=watch_inputs) as records, tape:
            y_pred = model(x, training=True)
            if y is not None and getattr(model, "compiled", False):
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
                scaled_loss = tf.cast(loss, tf.float32) * tf.constant(loss_scale, tf.float32)
    finally:
        for variable, value in state:
            variable.assign(value)
    order, calls = _calls_in_order(records)
    return _Replay(tape, loss, scaled_loss, order, calls)


def _traced_gradients(
    model: keras.Model, data: tuple, loss_scale: float, state: list[tuple[Any, Any]]
) -> list[Any]:
    """`_replay`'s backward pass inside a `tf.function` (the targets of
    `_gradient_targets`, in the same order), with the state it updates put
    back after: Keras's float8 layers have a gradient only there."""

    def gradients(x: Any, y: Any, sample_weight: Any) -> list[Any]:
        tape = tf.GradientTape(persistent=True)
        with recording_layers(model, tape, watch_inputs=True) as records, tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            scaled_loss = tf.cast(loss, tf.float32) * tf.constant(loss_scale, tf.float32)
        _, targets = _gradient_targets(*_calls_in_order(records))
        return tape.gradient(scaled_loss, targets)

    try:
        return list(tf.function(gradients, autograph=False)(*data))
    finally:
        for variable, value in state:
            variable.assign(value)


def _note_gradients(
    layer_records: dict[tuple[int, int], LayerRecord], spans: list, gradients: list, loss_scale: float
) -> None:
    """Each call's gradient finiteness, largest gradient and underflow share."""
    for (layer, index), start, n_in, n_out in spans:
        grads = [g for g in gradients[start : start + n_in] if g is not None]
        if tf is not None:
            grads = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
        record = layer_records[(id(layer), index)]
        record.gradient_finite = _all_finite(grads) if grads else True
        out_grads = [g for g in gradients[start + n_in : start + n_in + n_out] if g is not None]
        if grads or out_grads:
            record.gradient_max = _abs_max(grads + out_grads) / loss_scale
        if out_grads:
            tiny = dtype_tiny(out_grads[0].dtype)
            total = sum(_size(g) for g in out_grads)
            small = sum(
                int(
                    keras.ops.sum(
                        keras.ops.cast(keras.ops.abs(keras.ops.cast(g, "float32")) <= tiny, "int32")
                    )
                )
                for g in out_grads
            )
            record.underflow = small / total if total else 0.0


def _report(
    ordered: list[LayerRecord],
    reference: dict[str, tuple[float, float]],
    loss_value: float | None,
    loss_scale: float,
    notes: list[str],
) -> PrecisionReport:
    """The report from the layers' records: where it first fails, forward
    and backward, the origin, and the layers to keep in float32."""
    headroom = {
        r.name: (
            r.activation_max / dtype_max(r.compute_dtype) if math.isfinite(r.activation_max) else math.inf
        )
        for r in ordered
    }
    first_forward = next((r.name for r in ordered if not r.output_finite), None)
    # Calls complete inner first: a sublayer that only received the non-finite
    # values its caller made with its own operations (the dropout after an
    # attention's softmax) completes before that caller. The first call whose
    # inputs are finite and whose output is not is where the values arose.
    forward_origin = next((r.name for r in ordered if not r.output_finite and r.inputs_finite), first_forward)
    first_backward = next((r.name for r in reversed(ordered) if r.gradient_finite is False), None)
    loss_finite = loss_value is None or math.isfinite(loss_value)
    origin = (forward_origin or "loss") if not loss_finite else (first_backward or forward_origin)
    # The origin, and every float16 layer whose true magnitudes (from the
    # float32 replay) fill more than half of float16's range on the way in
    # or out: downstream of an overflow, layers merely inherit inf/NaN, and
    # only the reference says which of them would overflow on their own.
    low_precision = {r.name for r in ordered if r.compute_dtype in ("float16", "bfloat16")}
    limit = FLOAT16_ADVICE_THRESHOLD * dtype_max("float16")
    advice = []
    for record in ordered:
        true_in, true_out = reference.get(record.layer, (0.0, record.activation_max))
        near_overflow = record.compute_dtype == "float16" and (
            max(true_in, true_out) > limit or FLOAT16_ADVICE_THRESHOLD < headroom[record.name] < math.inf
        )
        flagged = (record.name == origin and record.name in low_precision) or near_overflow
        if flagged and record.layer not in advice:  # a fix changes the layer, whichever call failed
            advice.append(record.layer)
    return PrecisionReport(
        first_nonfinite_layer=first_forward,
        forward_origin=forward_origin,
        first_nonfinite_gradient_layer=first_backward,
        activation_max={r.name: r.activation_max for r in ordered},
        headroom=headroom,
        underflow={r.name: r.underflow for r in ordered if r.underflow is not None},
        float32_layers=advice,
        loss=loss_value,
        loss_finite=loss_finite,
        loss_scale=loss_scale,
        origin=origin,
        notes=notes,
        layers=ordered,
        reference_max={name: out for name, (_, out) in reference.items()},
        gradient_max={r.name: r.gradient_max for r in ordered if r.gradient_max is not None},
    )


# ------------------------------------------------- precision against float32
_LOW_PRECISION = ("float16", "bfloat16")


def _norm(x: Any) -> float:
    """The Euclidean norm over every element (any rank)."""
    return float(keras.ops.sqrt(keras.ops.sum(keras.ops.square(x))))


def _relative_error(ours: list[Any], reference: list[Any]) -> float:
    worst = 0.0
    for a, b in zip(ours, reference):
        a = keras.ops.cast(a, "float32")
        b = keras.ops.cast(b, "float32")
        if not (bool(keras.ops.all(keras.ops.isfinite(a))) and bool(keras.ops.all(keras.ops.isfinite(b)))):
            continue  # overflow is judged by the diagnosis
        scale = _norm(b)
        difference = _norm(a - b)
        if scale == 0.0:
            scale = max(_norm(a), 1e-30)
        worst = max(worst, difference / scale)
    return worst


def _is_floating(value: Any) -> bool:
    return keras.ops.is_tensor(value) and "float" in keras.backend.standardize_dtype(value.dtype)


def _floating(structure: Any) -> list[Any]:
    return [t for t in keras.tree.flatten(structure) if _is_floating(t)]


def _to_float32(structure: Any) -> Any:
    return keras.tree.map_structure(
        lambda t: keras.ops.cast(t, "float32") if _is_floating(t) else t, structure
    )


class PrecisionLoss(NamedTuple):
    """What one low-precision layer's own computation loses against the
    same computation in float32 on the same inputs."""

    dtype: str  #: the layer's compute dtype
    error: float  #: relative L2 error of its outputs
    underflow: float  #: share of the float32 outputs' nonzero values that came out 0


def _underflow(ours: list[Any], reference: list[Any]) -> float:
    flushed = total = 0
    for a, b in zip(ours, reference):
        nonzero = keras.ops.not_equal(keras.ops.cast(b, "float32"), 0.0)
        zero = keras.ops.equal(keras.ops.cast(a, "float32"), 0.0)
        total += int(keras.ops.sum(keras.ops.cast(nonzero, "int32")))
        flushed += int(keras.ops.sum(keras.ops.cast(keras.ops.logical_and(nonzero, zero), "int32")))
    return flushed / total if total else 0.0


def own_precision_loss(model: keras.Model, x: Any, training: bool = True) -> dict[str, PrecisionLoss]:
    """Layer label (`_layer_labels`) -> `PrecisionLoss`: each low-precision
    layer's outputs against the same layer computed in float32 on the
    inputs it received in a pass of `x` (in training mode, as in `fit`, or
    in inference); the worst over its calls. Layers that compute in
    float32, and layers that draw random numbers, are left out. The state
    the passes change (BatchNormalization's statistics) is put back."""
    state = list(model.non_trainable_variables)
    saved = [keras.ops.copy(v.value) for v in state]  # copies: JAX donates the buffers it trains on
    calls: list[tuple[Any, tuple, dict]] = []
    losses: dict[str, PrecisionLoss] = {}
    labels = layer_labels(model)
    try:
        with recording_layers(model, arguments=calls) as records:
            model(x, training=training)
        for (layer, args, kwargs), (_, _, outputs) in zip(calls, records):
            dtype = getattr(layer, "compute_dtype", "float32")
            if dtype not in _LOW_PRECISION or not outputs:
                continue
            inner = all_layers(layer, include_self=True)
            if any(seed_generators_of(sub) for sub in inner):
                continue  # a replay would draw other random numbers
            with computing_in_float32(model, layers=inner):
                reference = _floating(layer(*_to_float32(args), **_to_float32(kwargs)))
            label = labels.get(id(layer), layer.name)
            previous = losses.get(label, PrecisionLoss(dtype, 0.0, 0.0))
            losses[label] = PrecisionLoss(
                dtype,
                max(previous.error, _relative_error(outputs, reference)),
                max(previous.underflow, _underflow(_floating(outputs), reference)),
            )
    finally:
        for variable, value in zip(state, saved):
            variable.assign(value)
    return losses


# ------------------------------------------------------------------ float8
def float8_figures(model: Any, x: Any) -> dict[str, dict[str, Any]]:
    """Layer label -> {"inputs": figures, "kernel": figures,
    "history_nonfinite": bool} for every float8 layer, on one inference
    pass of `x` (`tensor_figures`; the inputs as each layer received them
    in its first call). Host reads of the layers' tensors: for a probe."""
    layers = float8_layers(model)
    if not layers:
        return {}
    wanted = {id(layer) for layer in layers}
    seen_inputs: dict[int, Any] = {}
    with recording_layers(model) as records:
        model(x, training=False)
    for layer, inputs, _ in records:
        if id(layer) in wanted and inputs and id(layer) not in seen_inputs:
            seen_inputs[id(layer)] = keras.ops.convert_to_numpy(keras.ops.cast(inputs[0], "float32"))
    labels = layer_labels(model)
    figures: dict[str, dict[str, Any]] = {}
    for layer in layers:

        def read(name: str, owner: Any = layer) -> np.ndarray:
            return variable_values(getattr(owner, name)).astype(np.float32)

        entry: dict[str, Any] = {}
        if id(layer) in seen_inputs:
            entry["inputs"] = tensor_figures(
                seen_inputs[id(layer)], float(read("inputs_scale")), FORMATS["inputs"]
            )
        kernel = variable_values(layer.kernel).astype(np.float32)
        entry["kernel"] = tensor_figures(kernel, float(read("kernel_scale")), FORMATS["kernel"])
        histories = [read(v.name) for v in layer.weights if v.name.endswith("amax_history")]
        entry["history_nonfinite"] = any(not np.isfinite(h).all() for h in histories)
        figures[labels.get(id(layer), layer.name)] = entry
    return figures
